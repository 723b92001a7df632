"""One response's output: a request's engine outputs as OpenAI JSON (collected) or server-sent
events (streamed, one chunk per step that committed text)."""
import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from kstep.engine.async_engine import AsyncEngine
from kstep.engine.request import Request as EngineRequest
from kstep.engine.request import ChoiceDelta, RequestOutput
from kstep.server.errors import APIError
from kstep.server.metrics import ModelMetrics


class Stream:
    """One response: turns a request's engine outputs into OpenAI JSON or SSE chunks."""

    def __init__(self, response_id: str, model: str, chat: bool, engine_request: EngineRequest, prefixes: list[str]):
        self.id, self.model, self.chat, self.request = response_id, model, chat, engine_request
        self.created = int(time.time())
        self.prefixes = prefixes
        self.texts = [""] * engine_request.num_rows
        self.finish_reasons: list[str | None] = [None] * engine_request.num_rows
        self.num_tokens = [0] * engine_request.num_rows  # committed completion tokens per choice
        self.first_token_time: float | None = None

    def _usage(self, out: RequestOutput) -> dict:
        usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                 "total_tokens": out.prompt_tokens + out.completion_tokens, "nfe": out.step}
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
        if self.first_token_time is not None:
            metrics.observe_ttft(self.first_token_time - self.request.arrival_time)

    async def collect(self, queue: asyncio.Queue, http_request: Request, engine: AsyncEngine, metrics: ModelMetrics):
        while True:
            try:
                out = await asyncio.wait_for(queue.get(), timeout=0.25)
            except TimeoutError:
                if await http_request.is_disconnected():
                    engine.abort(self.request.request_id)
                    metrics.observe_request("cancelled")
                    return Response(status_code=499)
                continue
            if out.error is not None:
                raise APIError(500, out.error, code="engine_error", kind="server_error")
            self._absorb(out)
            if out.is_finished:
                break
        self._observe_finish(metrics, out)
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": reason} for i, (text, reason) in enumerate(zip(self.texts, self.finish_reasons))]
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                       for i, (text, reason) in enumerate(zip(self.texts, self.finish_reasons))]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self._usage(out)}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
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
                out = await queue.get()
                if out.error is not None:
                    is_done = True
                    metrics.observe_request("500")
                    error = {"error": {"message": out.error, "type": "server_error", "param": None,
                                       "code": "engine_error"}}
                    yield f"data: {json.dumps(error)}\n\n"
                    break
                choices = []
                for index, text, reason, delta in self._absorb(out):
                    if self.chat:
                        choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                                  "finish_reason": reason}
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
                    yield self._chunk(choices, self._usage(out))
                    break
                if choices:
                    yield self._chunk(choices)
            yield "data: [DONE]\n\n"
        finally:
            if not is_done:  # the client went away mid-stream: free its slot
                engine.abort(self.request.request_id)
                metrics.observe_request("cancelled")
