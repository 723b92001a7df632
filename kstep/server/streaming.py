"""One response's output: a request's engine outputs as OpenAI JSON (collected) or server-sent
events (streamed, one chunk per step that committed text).

A response watches its client from the start: once the connection closes (ASGI `http.disconnect`,
which uvicorn reports as soon as the socket does), the request is aborted, so it leaves the batch
before the engine's next step, streaming or not, and is counted under status 499 (nginx's and
vLLM's "client closed request")."""
import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from kstep.engine.async_engine import AsyncEngine
from kstep.engine.request import Request as EngineRequest
from kstep.engine.request import ChoiceDelta, RequestOutput
from kstep.server.errors import APIError
from kstep.server.tools import may_be_call, parse_tool_calls
from kstep.server.metrics import ModelMetrics

CLIENT_GONE = object()  # queued when the client disconnects: the response stops reading the engine
CLIENT_CLOSED_REQUEST = "499"


def engine_error(out: RequestOutput) -> APIError:
    """A request the engine failed or refused, as the HTTP error it answers with."""
    kind = "invalid_request_error" if 400 <= out.error_status < 500 else "server_error"
    return APIError(out.error_status, out.error, code=out.error_code, kind=kind)


async def watch_disconnect(http_request: Request, on_gone: Callable[[], None]) -> None:
    """Call `on_gone` once the client has disconnected (cancel this task when the response is done:
    a completed response reads as a disconnect too)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.01)  # uvicorn blocks until then; a server that answers at once is not spun on
    on_gone()


class Stream:
    """One response: turns a request's engine outputs into OpenAI JSON or SSE chunks."""

    def __init__(self, response_id: str, model: str, chat: bool, engine_request: EngineRequest, prefixes: list[str],
                 calls_tools: bool = False, include_usage: bool = False):
        self.id, self.model, self.chat, self.request = response_id, model, chat, engine_request
        self.held: list[RequestOutput] = []  # an output read before the response started (admitted)
        # OpenAI's stream_options.include_usage: "usage": null on every chunk, then one more chunk with no
        # choices and the usage; without it a stream carries no usage
        self.include_usage = include_usage
        self.calls_tools = calls_tools  # a chat reply may be tool calls (server/tools.py): parsed, not sent as text
        self.sent = [""] * engine_request.num_rows  # a stream's content sent so far, per choice
        self.created = int(time.time())
        self.prefixes = prefixes
        self.texts = [""] * engine_request.num_rows
        self.finish_reasons: list[str | None] = [None] * engine_request.num_rows
        self.num_tokens = [0] * engine_request.num_rows  # committed completion tokens per choice
        self.first_token_time: float | None = None
        self.watcher: asyncio.Task | None = None  # watch_disconnect, from `watch`

    def _usage(self, out: RequestOutput) -> dict:
        usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                 "total_tokens": out.prompt_tokens + out.completion_tokens, "nfe": out.step}
        if out.limit is not None:  # a server limit ended it (finish_reason "length"): which one
            usage["server_limit"], usage["server_limit_value"] = out.limit
        if "drafted_tokens" in out.stats:  # speculation: what the drafts saved, and what they cost
            usage.update(draft_tokens=out.stats["drafted_tokens"], accepted_draft_tokens=out.stats["accepted_tokens"])
        if "positions_computed" in out.stats:
            usage["positions_computed"] = out.stats["positions_computed"]
        if "preemptions" in out.stats:  # its KV pages were taken back, and it recomputed (the same output)
            usage["preemptions"] = out.stats["preemptions"]
        if self.request.plan is not None:  # a time budget: what was planned, beside what happened
            usage.update(time_budget=self.request.params.time_budget, planned_passes=self.request.plan.passes,
                         predicted_seconds=round(self.request.plan.predicted_seconds, 6))
        return usage

    def _absorb(self, out: RequestOutput) -> list[tuple[int, str, str | None, ChoiceDelta]]:
        """Record the output; returns (index, text delta, finish_reason, the delta) per changed choice."""
        changes = []
        for c in out.choices:
            self.num_tokens[c.index] += len(c.token_ids)
            text = self.prefixes[c.index] + c.text  # `echo`: the prompt goes out with the first delta
            self.prefixes[c.index] = ""
            self.texts[c.index] += text
            self.finish_reasons[c.index] = c.finish_reason or self.finish_reasons[c.index]
            if text and self.first_token_time is None:
                self.first_token_time = time.monotonic()
            changes.append((c.index, text, c.finish_reason, c))
        return changes

    def _observe_finish(self, metrics: ModelMetrics, out: RequestOutput) -> None:
        metrics.observe_request("200", out.prompt_tokens, out.completion_tokens, out.step,
                                time.monotonic() - self.request.arrival_time)
        metrics.observe_drafts(out.stats)
        if self.request.params.structured is not None:
            metrics.observe_grammar(out.stats, [self._finish_reason(i) for i in range(len(self.texts))])
        if self.first_token_time is not None:
            metrics.observe_ttft(self.first_token_time - self.request.arrival_time)

    def watch(self, http_request: Request, queue: asyncio.Queue, engine: AsyncEngine) -> None:
        """From now on, abort the request when its client disconnects (`collect` / `events` stop
        watching once the response is done). Started before a stream's first chunk: a client that
        leaves before it is read from still frees its slot."""
        def gone() -> None:
            engine.abort(self.request.request_id)
            queue.put_nowait(CLIENT_GONE)
        self.watcher = asyncio.create_task(watch_disconnect(http_request, gone))

    async def next_output(self, queue: asyncio.Queue):
        """The request's next engine output (or CLIENT_GONE)."""
        return self.held.pop() if self.held else await queue.get()

    async def admitted(self, queue: asyncio.Queue, metrics: ModelMetrics) -> Response | None:
        """A stream's wait for the engine to admit its request before the response starts, so a request
        refused at admission gets its HTTP status (a 400 for KV caches larger than the whole pool, a 503
        at shutdown), not an event in a 200 stream. None once admitted; a 499 when the client left."""
        out = await self.next_output(queue)
        if out is CLIENT_GONE:
            self.watcher.cancel()
            metrics.observe_request(CLIENT_CLOSED_REQUEST)
            return Response(status_code=499)
        if out.error is not None:
            self.watcher.cancel()
            raise engine_error(out)
        if not out.admitted:  # (the engine's first output is its admission's: kept all the same)
            self.held.append(out)
        return None

    async def collect(self, queue: asyncio.Queue, metrics: ModelMetrics):
        try:
            while True:
                out = await self.next_output(queue)
                if out is CLIENT_GONE:
                    metrics.observe_request(CLIENT_CLOSED_REQUEST)
                    return Response(status_code=499)
                if out.error is not None:
                    raise engine_error(out)
                self._absorb(out)
                if out.is_finished:
                    break
        finally:
            self.watcher.cancel()
        self._observe_finish(metrics, out)
        if self.chat:
            choices = []
            for i, (text, reason) in enumerate(zip(self.texts, self.finish_reasons)):
                calls = parse_tool_calls(text) if self.calls_tools else None
                message = {"role": "assistant", "content": text} if not calls else \
                    {"role": "assistant", "content": None, "tool_calls": calls}
                choices.append({"index": i, "message": message, "logprobs": None,
                                "finish_reason": "tool_calls" if calls and reason == "stop" else reason})
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                       for i, (text, reason) in enumerate(zip(self.texts, self.finish_reasons))]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self._usage(out)}

    def _finish_reason(self, index: int) -> str | None:
        """A finished choice's reason as the reply gives it ("tool_calls" when its text holds calls)."""
        reason = self.finish_reasons[index]
        return "tool_calls" if reason == "stop" and self.calls_tools and parse_tool_calls(self.texts[index]) else reason

    def _chat_delta(self, index: int, reason: str | None) -> dict:
        """A chat chunk's choice: the content committed since the last one; with tools, held back
        while it may open a call, and once finished, the calls it made (`delta.tool_calls`, whole)."""
        text, delta = self.texts[index], {}
        calls = parse_tool_calls(text) if self.calls_tools and reason is not None else None
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            reason = "tool_calls" if reason == "stop" else reason
        elif not (self.calls_tools and reason is None and may_be_call(text)) and len(text) > len(self.sent[index]):
            delta["content"], self.sent[index] = text[len(self.sent[index]):], text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def events(self, queue: asyncio.Queue, engine: AsyncEngine, metrics: ModelMetrics) -> AsyncIterator[str]:
        """SSE chunks of newly committed text; the last carries the finish reasons and usage."""
        is_done = False
        try:
            if self.chat:  # OpenAI's first chat chunk announces the role
                yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None} for i in range(self.request.num_rows)])
            while True:
                out = await self.next_output(queue)
                if out is CLIENT_GONE:
                    return
                if out.error is not None:
                    is_done = True
                    metrics.observe_request(str(out.error_status))
                    error = {"error": {"message": out.error, "type": "server_error", "param": None,
                                       "code": out.error_code}}
                    yield f"data: {json.dumps(error)}\n\n"
                    break
                choices = []
                for index, text, reason, delta in self._absorb(out):
                    if self.chat:
                        choice = self._chat_delta(index, reason)
                    else:
                        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
                    if self.request.include_canvas:  # kstep's refinement view (any family)
                        choice["step"], choice["tokens"] = out.step, self.num_tokens[index]
                        if delta.canvas is not None:
                            choice["canvas"], choice["canvas_pieces"] = delta.canvas, delta.canvas_pieces
                            choice["canvas_edits"] = delta.canvas_edits
                    choices.append(choice)
                if out.is_finished:
                    is_done = True
                    self._observe_finish(metrics, out)
                    yield self._chunk(choices)
                    if self.include_usage:
                        yield self._chunk([], self._usage(out))
                    break
                if choices:
                    yield self._chunk(choices)
            yield "data: [DONE]\n\n"
        finally:
            self.watcher.cancel()
            if not is_done:  # the client went away mid-stream: free its slot
                engine.abort(self.request.request_id)
                metrics.observe_request(CLIENT_CLOSED_REQUEST)
