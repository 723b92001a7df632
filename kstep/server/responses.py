"""The Responses API's answer (OpenAI's POST /v1/responses): the body becomes a chat body
(responses_protocol.py) and takes the chat path (`Routes.chat_request`, `Routes.submit`); this
module reads its engine outputs and answers with a Response object, or with Responses' server-sent
events (an `event:` line and a `data:` line each, numbered by `sequence_number`, no `[DONE]`).

A reply is text (one `message` item) or, where tools are given and the model called them,
`function_call` items, never both (the chat path's grammar writes one or the other). A call's
arguments go out whole once the call is complete (one arguments delta per call), as the chat stream
sends its calls; text that may still open a call is held back until it is known not to."""
import asyncio
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from kstep.engine.request import Request as EngineRequest
from kstep.server.chat_protocol import ChatCompletionRequest
from kstep.server.errors import APIError, param_named_in
from kstep.server.responses_protocol import NamedFunction, ResponsesRequest
from kstep.server.routes import ModelRoute, Routes
from kstep.server.streaming import CLIENT_CLOSED_REQUEST, CLIENT_GONE, Stream
from kstep.server.tools import may_be_call, parse_tool_calls

log = logging.getLogger("kstep.server")

# The chat body's fields, as its errors name them, spelt as a Responses client wrote them.
RENAMED = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
_CHAT_WORD = re.compile(r"\b(" + "|".join(RENAMED) + r")\b")


def _renamed(e: APIError) -> APIError:
    """A chat path error as this endpoint's: the fields it names are the Responses body's."""
    message = _CHAT_WORD.sub(lambda found: RENAMED[found.group(1)], e.message)
    param = RENAMED.get(e.param, e.param) if e.param else None
    return APIError(e.status, message, param.split(".")[0] if param else None, e.code, e.kind)


def _chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    if (refused := body.refused()) is not None:
        field, message = refused
        raise APIError(400, message, field)
    if ignored := body.ignored():
        log.info("ignoring %s (no effect on the output)", ", ".join(ignored))
    try:
        return body.chat_body()
    except ValidationError as e:  # the chat body checks what this one let through
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise _renamed(APIError(400, f"{where}: {error['msg']}", str(error["loc"][0]) if error["loc"] else None)) \
            from None
    except ValueError as e:
        raise APIError(400, str(e), param_named_in(str(e), set(ResponsesRequest.model_fields))) from None


async def create_response(routes: Routes, body: ResponsesRequest, request: Request) -> dict | Response:
    """POST /v1/responses: the body on the chat path, answered as a Response (JSON or events)."""
    chat = _chat_body(body)
    try:
        route, engine_request = await routes.chat_request(chat, request)
    except APIError as e:
        raise _renamed(e) from None
    reply = Reply(body, route, engine_request, calls_tools=bool(chat.tools) and chat.tool_choice_name() != "none")
    queue = routes.submit(route, request, engine_request, reply.stream)
    if body.stream:
        if (gone := await reply.stream.admitted(queue, route.metrics)) is not None:
            return gone
        return StreamingResponse(reply.events(queue), media_type="text/event-stream")
    return await reply.collect(queue)


def _usage(chat_usage: dict) -> dict:
    """Responses' usage from the chat path's (kstep's own figures, `nfe` first, kept beside)."""
    own = {k: v for k, v in chat_usage.items() if k not in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"], **own}


class Reply:
    """One response: its Response object, and its engine outputs as that object or as events."""

    def __init__(self, body: ResponsesRequest, route: ModelRoute, engine_request: EngineRequest, calls_tools: bool):
        self.body, self.route, self.params = body, route, engine_request.params
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.stream = Stream(self.id, route.name, True, engine_request, [""], calls_tools)
        self.numbers = itertools.count()  # the events' sequence numbers
        self.sent = ""                    # the message text streamed so far
        self.is_message_open = False

    def response(self, status: str, output: list[dict] | None = None, usage: dict | None = None) -> dict:
        """The Response object: the request's settings as applied (the model's defaults included)."""
        body = self.body
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) \
            if body.text is not None and body.text.format is not None else {"type": "text"}
        tool_choice = {"type": "function", "name": body.tool_choice.name} \
            if isinstance(body.tool_choice, NamedFunction) else body.tool_choice or "auto"
        tools = [{**t.model_dump(exclude_none=True), "parameters": t.parameters, "strict": t.strict}
                 for t in body.tools or []]
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "completed_at": int(time.time()) if status == "completed" else None,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": self.params.max_tokens,
                "metadata": body.metadata or {}, "model": self.route.name, "output": output or [],
                "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": None, "store": False, "temperature": self.params.temperature,
                "text": {"format": text_format}, "tool_choice": tool_choice, "tools": tools,
                "top_p": 1.0 if self.params.top_p is None else self.params.top_p, "truncation": "disabled",
                "usage": usage, "user": body.user if isinstance(body.user, str) else None}

    def _message(self, text: str, status: str) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call(call: dict, status: str) -> dict:
        return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "status": status,
                "call_id": call["id"], "name": call["function"]["name"],
                "arguments": "" if status == "in_progress" else call["function"]["arguments"]}

    def _output(self, text: str, reason: str | None, calls: list[dict] | None) -> tuple[str, list[dict]]:
        """The finished response's status and output items."""
        status = "incomplete" if reason == "length" else "completed"
        return status, [self._call(c, "completed") for c in calls] if calls else [self._message(text, status)]

    async def collect(self, queue: asyncio.Queue) -> dict | Response:
        done = await self.stream.collect(queue, self.route.metrics)
        if not isinstance(done, dict):  # the client left (a 499)
            return done
        choice = done["choices"][0]
        message = choice["message"]
        status, output = self._output(message["content"] or "", choice["finish_reason"], message.get("tool_calls"))
        return self.response(status, output, _usage(done["usage"]))

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _text_events(self, text: str) -> Iterator[str]:
        """The message's opening events (once), then the text committed since the last delta."""
        where = {"item_id": self.message_id, "output_index": 0}
        if not self.is_message_open:
            self.is_message_open = True
            yield self._event("response.output_item.added", output_index=0,
                              item={**self._message("", "in_progress"), "content": []})
            yield self._event("response.content_part.added", **where, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []})
        if len(text) > len(self.sent):
            delta, self.sent = text[len(self.sent):], text
            yield self._event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[])

    def _finish_events(self, text: str, reason: str | None, usage: dict) -> Iterator[str]:
        """The output items' closing events, then the whole response (completed or incomplete)."""
        calls = parse_tool_calls(text) if self.stream.calls_tools else None
        status, output = self._output(text, reason, calls)
        if calls:
            for index, (call, item) in enumerate(zip(calls, output, strict=True)):
                where = {"item_id": item["id"], "output_index": index}
                yield self._event("response.output_item.added", output_index=index, item=self._call(call, "in_progress"))
                yield self._event("response.function_call_arguments.delta", **where, delta=item["arguments"])
                yield self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"])
                yield self._event("response.output_item.done", output_index=index, item=item)
        else:
            yield from self._text_events(text)
            [item] = output
            where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            yield self._event("response.output_text.done", **where, text=text, logprobs=[])
            yield self._event("response.content_part.done", **where, part=item["content"][0])
            yield self._event("response.output_item.done", output_index=0, item=item)
        yield self._event(f"response.{status}", response=self.response(status, output, usage))

    async def events(self, queue: asyncio.Queue) -> AsyncIterator[str]:
        """The response's server-sent events, in OpenAI's order."""
        stream, metrics, engine = self.stream, self.route.metrics, self.route.engine
        is_done = False
        try:
            yield self._event("response.created", response=self.response("in_progress"))
            yield self._event("response.in_progress", response=self.response("in_progress"))
            while True:
                out = await stream.next_output(queue)
                if out is CLIENT_GONE:
                    return
                if out.error is not None:
                    is_done = True
                    metrics.observe_request(str(out.error_status))
                    yield self._event("error", code=out.error_code, message=out.error, param=None)
                    failed = {**self.response("failed"), "error": {"code": "server_error", "message": out.error}}
                    yield self._event("response.failed", response=failed)
                    return
                stream._absorb(out)
                text = stream.texts[0]
                if out.is_finished:
                    is_done = True
                    stream._observe_finish(metrics, out)
                    for event in self._finish_events(text, stream.finish_reasons[0], _usage(stream._usage(out))):
                        yield event
                    return
                if not (stream.calls_tools and may_be_call(text)):
                    for event in self._text_events(text):
                        yield event
        finally:
            stream.watcher.cancel()
            if not is_done:  # the client went away mid-stream: free its slot
                engine.abort(stream.request.request_id)
                metrics.observe_request(CLIENT_CLOSED_REQUEST)
