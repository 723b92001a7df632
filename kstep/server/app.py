"""FastAPI routes of `kstep serve`: /v1/models, /v1/completions, /v1/chat/completions (JSON or
server-sent events), /health, /metrics. Validation happens here, at the edge (errors.py says no):
params are resolved for the served model before a request reaches the engine."""
import secrets
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kstep.engine.async_engine import AsyncEngine
from kstep.engine.engine import Engine, warm_up
from kstep.engine.request import Request as EngineRequest
from kstep.engine.scheduler import QueueFull
from kstep.llm import LLM
from kstep.server.errors import APIError, BodySizeLimit, install_error_handlers, param_named_in
from kstep.server.metrics import Metrics
from kstep.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kstep.server.streaming import Stream


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
    install_error_handlers(app, metrics)
    routes = Routes(llm, config, async_engine, metrics)

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
        return routes.models()

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        return await routes.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await routes.chat_completions(body, request)

    return app


class Routes:
    """The OpenAI endpoints' work: encode and validate at the edge, submit, respond."""

    def __init__(self, llm: LLM, config: ServeConfig, engine: AsyncEngine, metrics: Metrics):
        self.llm, self.config, self.engine, self.metrics = llm, config, engine, metrics

    def models(self) -> dict:
        llm = self.llm
        return {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": 0, "owned_by": "kstep",
            "kind": llm.kind, "family": llm.cfg.family, "max_model_len": llm.cfg.max_positions}]}

    def _prepare(self, body: SamplingFields, prompts: list[list[int]], is_text: list[bool],
                 default_max_tokens: int) -> EngineRequest:
        """Params resolved for the model, text prompts token-healed, the context checked."""
        llm, config = self.llm, self.config
        if body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {config.model_name!r}",
                           "model", "model_not_found")
        if (field_name := body.unsupported()) is not None:
            raise APIError(400, f"{field_name} is not supported by kstep", field_name)
        try:
            params = llm.resolve(body.generation_params(config.defaults, default_max_tokens))
            stop = body.stop_strings()
        except ValueError as e:
            raise APIError(400, str(e), param_named_in(str(e), set(SamplingFields.model_fields))) from None
        healed = [llm.heal(ids, params, text) for ids, text in zip(prompts, is_text, strict=True)]
        prompts = [ids for ids, _, _ in healed]
        longest = max(len(p) for p in prompts)
        try:
            llm.check_fits(prompts, params)
        except ValueError as e:
            raise APIError(400, f"{e} tokens", "prompt" if longest >= llm.cfg.max_positions else "max_tokens",
                           "context_length_exceeded") from None
        include_canvas = bool(body.stream_options and body.stream_options.include_canvas)
        return EngineRequest(prompts, params, body.n, stop, include_canvas and body.stream,
                             given_back=[text for _, text, _ in healed], first_tokens=[ids for _, _, ids in healed])

    def _encode(self, prompt) -> list[int]:
        try:
            return self.llm.encode_prompt(prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None

    async def completions(self, body: CompletionRequest, request: Request):
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported by kstep", "suffix")
        raw = body.prompt
        if isinstance(raw, list) and not raw:
            raise APIError(400, "prompt is empty: give at least one token", "prompt")
        items = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
        prompts = [self._encode(p) for p in items]
        tokenizer = self.llm.tokenizer
        echo = [(p if isinstance(p, str) else tokenizer.decode(ids) if tokenizer else "") if body.echo else ""
                for p, ids in zip(items, prompts, strict=True)]
        engine_request = self._prepare(body, prompts, [isinstance(p, str) for p in items], 16)
        return await self._respond(request, engine_request, body, chat=False,
                                   prefixes=[echo[i // body.n] for i in range(engine_request.num_rows)])

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = self.llm.chat_prompt(messages)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:  # a template error is the request's fault (its messages), not the server's
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        # A chat prompt ends with the template's own text: taken as given (as `kstep generate --chat`).
        engine_request = self._prepare(body, [prompt], [False], self.config.default_max_tokens)
        return await self._respond(request, engine_request, body, chat=True,
                                   prefixes=[""] * engine_request.num_rows)

    async def _respond(self, request: Request, engine_request: EngineRequest, body: SamplingFields, chat: bool,
                       prefixes: list[str]):
        try:
            queue = self.engine.submit(engine_request)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", kind="rate_limit_error") from None
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        stream = Stream(response_id, self.config.model_name, chat, engine_request, prefixes)
        if body.stream:
            return StreamingResponse(stream.events(queue, self.engine, self.metrics), media_type="text/event-stream")
        return await stream.collect(queue, request, self.engine, self.metrics)
