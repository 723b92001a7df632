"""FastAPI routes of `kstep serve`: /v1/models, /v1/completions, /v1/chat/completions (JSON or
server-sent events), /health, /metrics. Validation happens here, at the edge; a bad request gets
an OpenAI-style error body and never reaches the engine, so the others keep running."""
import asyncio
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kstep.engine.async_engine import AsyncEngine
from kstep.engine.engine import Engine, warm_up
from kstep.engine.request import Request as EngineRequest
from kstep.engine.request import RequestOutput
from kstep.engine.scheduler import QueueFull
from kstep.llm import LLM
from kstep.server.metrics import Metrics
from kstep.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)


@dataclass(slots=True)
class ServeConfig:
    model_name: str = "default"
    api_key: str | None = None
    max_batch_size: int = 16
    max_queue: int = 256
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256           # chat requests without max_tokens (completions: 16, as OpenAI)
    prefix_cache_bytes: int = 256 << 20     # AR prefix cache budget (0: off)
    defaults: dict = field(default_factory=dict)  # GenerationParams fields the server sets for its model


def _param_named_in(message: str) -> str | None:
    """The request field a GenerationParams error names first (its messages start with it)."""
    word = re.match(r"[a-z_]+", message)
    known = set(SamplingFields.model_fields)
    return word.group(0) if word and word.group(0) in known else None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class BodySizeLimit:
    """ASGI middleware: refuse bodies over the limit (413) before they are read into memory."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = APIError(413, f"request body exceeds the server's limit of {self.max_bytes} bytes",
                           code="body_too_large").response()
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_big(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise APIError(413, f"request body exceeds the server's limit of {self.max_bytes} bytes",
                               code="body_too_large")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except APIError as e:
            await e.response()(scope, receive, send)


def build_app(llm: LLM, config: ServeConfig, executor: ThreadPoolExecutor | None = None) -> FastAPI:
    """`executor`: the thread the model was loaded on (`torch_thread`), which then runs every step."""
    metrics = Metrics()
    engine = Engine(llm, config.max_batch_size, config.max_queue, config.prefix_cache_bytes)
    async_engine = AsyncEngine(engine, metrics.observe_step, executor)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.run_on_torch_thread(warm_up, llm)
        await async_engine.start()
        yield
        await async_engine.stop()

    app = FastAPI(title="kstep", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.state.engine, app.state.metrics, app.state.config = engine, metrics, config

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        metrics.observe_request(str(e.status))
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
        elif first.get("type") == "missing":
            message, param = f"missing required field {'.'.join(loc)!r}", ".".join(loc) or None
        else:
            message, param = f"{'.'.join(loc) or 'body'}: {first['msg']}", ".".join(loc) or None
        return await api_error(request, APIError(400, message, param))

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", kind="authentication_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": engine.scheduler.num_running, "waiting": engine.scheduler.num_waiting}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": 0, "owned_by": "kstep",
            "kind": "diffusion" if llm.is_diffusion else "autoregressive", "family": llm.cfg.family,
            "max_model_len": llm.cfg.max_positions}]}

    def prepare(body: SamplingFields, prompts: list[list[int]], default_max_tokens: int) -> EngineRequest:
        if body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {config.model_name!r}",
                           "model", "model_not_found")
        if (field_name := body.unsupported()) is not None:
            raise APIError(400, f"{field_name} is not supported by kstep", field_name)
        try:
            params = body.generation_params(config.defaults, default_max_tokens)
            if llm.is_diffusion:
                params.resolved_for_diffusion()
            stop = body.stop_strings()
        except ValueError as e:
            raise APIError(400, str(e), _param_named_in(str(e))) from None
        longest = max(len(p) for p in prompts)
        if longest + params.max_tokens > llm.cfg.max_positions:
            raise APIError(400, f"prompt ({longest} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                                f"context of {llm.cfg.max_positions} tokens",
                           "prompt" if longest >= llm.cfg.max_positions else "max_tokens", "context_length_exceeded")
        include_canvas = bool(body.stream_options and body.stream_options.include_canvas)
        return EngineRequest(prompts, params, body.n, stop, include_canvas and body.stream)

    def encode(prompt) -> list[int]:
        try:
            return llm.encode_prompt(prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported by kstep", "suffix")
        raw = body.prompt
        if isinstance(raw, list) and not raw:
            raise APIError(400, "prompt is empty: give at least one token", "prompt")
        items = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
        prompts = [encode(p) for p in items]
        echo = [(p if isinstance(p, str) else llm.tokenizer.decode(ids) if llm.tokenizer else "") if body.echo
                else "" for p, ids in zip(items, prompts, strict=True)]
        engine_request = prepare(body, prompts, 16)
        return await respond(request, engine_request, body, chat=False,
                             prefixes=[echo[i // body.n] for i in range(engine_request.num_rows)])

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = llm.chat_prompt(messages)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:  # a template error is the request's fault (its messages), not the server's
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        engine_request = prepare(body, [prompt], config.default_max_tokens)
        return await respond(request, engine_request, body, chat=True, prefixes=[""] * engine_request.num_rows)

    async def respond(request: Request, engine_request: EngineRequest, body: SamplingFields, chat: bool,
                      prefixes: list[str]):
        try:
            queue = async_engine.submit(engine_request)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", kind="rate_limit_error") from None
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        stream = Stream(response_id, config.model_name, chat, engine_request, prefixes)
        if body.stream:
            return StreamingResponse(stream.events(queue, async_engine, metrics),
                                     media_type="text/event-stream")
        return await stream.collect(queue, request, async_engine, metrics)

    return app


class Stream:
    """One response: turns a request's engine outputs into OpenAI JSON or SSE chunks."""

    def __init__(self, response_id: str, model: str, chat: bool, engine_request: EngineRequest, prefixes: list[str]):
        self.id, self.model, self.chat, self.request = response_id, model, chat, engine_request
        self.created = int(time.time())
        self.prefixes = prefixes
        self.texts = [""] * engine_request.num_rows
        self.finish_reasons: list[str | None] = [None] * engine_request.num_rows
        self.first_token_time: float | None = None

    def _usage(self, out: RequestOutput) -> dict:
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens, "nfe": out.step}

    def _absorb(self, out: RequestOutput) -> list[tuple[int, str, str | None, str | None]]:
        """Record the output; returns (index, text delta, finish_reason, canvas) per changed choice."""
        changes = []
        for c in out.choices:
            text = self.prefixes[c.index] + c.text  # `echo`: the prompt goes out with the first delta
            self.prefixes[c.index] = ""
            self.texts[c.index] += text
            self.finish_reasons[c.index] = c.finish_reason or self.finish_reasons[c.index]
            if text and self.first_token_time is None:
                self.first_token_time = time.monotonic()
            changes.append((c.index, text, c.finish_reason, c.canvas))
        return changes

    def _observe_finish(self, metrics: Metrics, out: RequestOutput) -> None:
        metrics.observe_request("200", out.prompt_tokens, out.completion_tokens, out.step,
                                time.monotonic() - self.request.arrival_time)
        if self.first_token_time is not None:
            metrics.ttft.observe(self.first_token_time - self.request.arrival_time)

    async def collect(self, queue: asyncio.Queue, http_request: Request, engine: AsyncEngine, metrics: Metrics):
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

    async def events(self, queue: asyncio.Queue, engine: AsyncEngine, metrics: Metrics) -> AsyncIterator[str]:
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
                for index, text, reason, canvas in self._absorb(out):
                    if self.chat:
                        choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                                  "finish_reason": reason}
                    else:
                        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
                    if canvas is not None:
                        choice["canvas"], choice["step"] = canvas, out.step
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
