"""FastAPI routes of `kstep serve`: /v1/models, /v1/completions, /v1/chat/completions (JSON or
server-sent events), /health, /metrics, and the playground page at /. Validation happens here, at
the edge (errors.py says no): params are resolved for the served model before a request reaches the
engine.

A server may serve several models: each has its own engine (continuous batching, caches, decoding
defaults) on its own torch thread; a request's `model` picks one."""
import os
import secrets
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kstep.engine.async_engine import AsyncEngine, ShuttingDown
from kstep.engine.engine import Engine, RequestLimits, warm_up
from kstep.engine.request import Request as EngineRequest
from kstep.engine.scheduler import QueueFull
from kstep.llm import LLM
from kstep.params.validation import MAX_PASSES_PER_POSITION
from kstep.params.family_defaults import defaults_for_mode
from kstep.server.errors import APIError, BodySizeLimit, install_error_handlers, param_named_in
from kstep.server.metrics import Metrics, ModelMetrics
from kstep.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kstep.server.streaming import Stream


STATIC_DIR = Path(__file__).parent / "static"


@dataclass(slots=True)
class ServedModel:
    """A model as served: the name clients send, the loaded model, its decoding defaults (GenerationParams
    fields a request's own fields override) and the thread it was loaded on (`torch_thread`), which
    then runs every step of its engine."""
    name: str
    llm: LLM
    defaults: dict = field(default_factory=dict)
    executor: ThreadPoolExecutor | None = None


@dataclass(slots=True)
class ModelRoute:
    """A served model's request path: its model, defaults, engine and metrics."""
    name: str
    llm: LLM
    defaults: dict
    engine: AsyncEngine
    metrics: ModelMetrics


@dataclass(slots=True)
class ServeConfig:
    api_key: str | None = None
    max_batch_size: int = 16
    max_queue: int = 256
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256           # chat requests without max_tokens (completions: 16, as OpenAI)
    prefix_cache_bytes: int = 256 << 20     # AR prefix cache budget per model (0: off)
    # One request's ceiling (RequestLimits). Passes: None = MAX_PASSES_PER_POSITION x the model's
    # context; seconds in the batch: the official openai client's own default timeout. 0: no limit.
    max_request_passes: int | None = None
    max_request_seconds: float = 600.0

    def limits(self, llm: LLM) -> RequestLimits:
        passes = MAX_PASSES_PER_POSITION * llm.cfg.max_positions if self.max_request_passes is None \
            else self.max_request_passes
        return RequestLimits(passes or None, self.max_request_seconds or None)


def build_app(models: list[ServedModel], config: ServeConfig) -> FastAPI:
    if not models or len({m.name for m in models}) != len(models):
        raise ValueError(f"served model names must be given and distinct, got {[m.name for m in models]}")
    metrics = Metrics()
    routes = Routes(config, [
        ModelRoute(m.name, m.llm, m.defaults, AsyncEngine(
            Engine(m.llm, config.max_batch_size, config.max_queue, config.prefix_cache_bytes, config.limits(m.llm)),
            metrics.for_model(m.name).observe_step, m.executor), metrics.for_model(m.name)) for m in models])

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for route in routes.by_name.values():
            await route.engine.run_on_torch_thread(warm_up, route.llm)
            await route.engine.start()
        yield
        for route in routes.by_name.values():
            await route.engine.stop()
            route.llm.close()  # a tensor-parallel model's other ranks stop with it

    app = FastAPI(title="kstep", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.state.routes, app.state.metrics, app.state.config = routes, metrics, config
    install_error_handlers(app, metrics)

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", kind="authentication_error")

    @app.get("/health")
    async def health():
        schedulers = {name: r.engine.engine.scheduler for name, r in routes.by_name.items()}
        return {"status": "ok", "pid": os.getpid(), "replica": getattr(app.state, "replica", None),
                "running": sum(s.num_running for s in schedulers.values()),
                "waiting": sum(s.num_waiting for s in schedulers.values()),
                "models": {name: {"running": s.num_running, "waiting": s.num_waiting} for name, s in schedulers.items()}}

    @app.get("/", include_in_schema=False)
    async def playground():  # the browser playground: static files, no build step, nothing fetched from elsewhere
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

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
    """The OpenAI endpoints' work: pick the model, encode and validate at the edge, submit, respond."""

    def __init__(self, config: ServeConfig, routes: list[ModelRoute]):
        self.config = config
        self.by_name = {r.name: r for r in routes}

    # Shutdown (server/shutdown.py): refuse new requests, then end the ones in flight.
    def refuse_new(self) -> None:
        for route in self.by_name.values():
            route.engine.is_closing = True

    def num_in_flight(self) -> int:
        return sum(r.engine.engine.scheduler.num_running + r.engine.engine.scheduler.num_waiting
                   for r in self.by_name.values())

    def end_in_flight(self) -> None:
        """Every model's queued and running requests end now, each answered with a 503."""
        for route in self.by_name.values():
            route.engine.end_all("the server is shutting down: the request was stopped before it finished")

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "kstep", "kind": r.llm.kind,
            "family": r.llm.cfg.family, "max_model_len": r.llm.cfg.max_positions} for name, r in self.by_name.items()]}

    def route(self, body: SamplingFields, request: Request) -> ModelRoute:
        route = self.by_name.get(body.model)
        if route is None:
            served = ", ".join(repr(name) for name in self.by_name)
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {served}",
                           "model", "model_not_found")
        request.state.model = route.name  # errors from here on are this model's (metrics)
        return route

    def _prepare(self, route: ModelRoute, body: SamplingFields, prompts: list[list[int]], is_text: list[bool],
                 default_max_tokens: int, suffix: list[int] | None = None) -> EngineRequest:
        """Params resolved for the model, text prompts token-healed, the context checked."""
        llm = route.llm
        if (field_name := body.unsupported()) is not None:
            raise APIError(400, f"{field_name} is not supported by kstep", field_name)
        try:
            defaults = defaults_for_mode(llm.family, route.defaults, body.mode or route.defaults.get("mode"))
            params = llm.resolve(body.generation_params(defaults, default_max_tokens))
            stop = body.stop_strings()
        except ValueError as e:
            raise APIError(400, str(e), param_named_in(str(e), set(SamplingFields.model_fields))) from None
        healed = [llm.heal(ids, params, text) for ids, text in zip(prompts, is_text, strict=True)]
        prompts = [ids for ids, _, _ in healed]
        longest = max(len(p) for p in prompts)
        suffixes = [suffix] * len(prompts) if suffix else []
        try:
            llm.check_fits(prompts, params, suffixes)
        except ValueError as e:
            raise APIError(400, f"{e} tokens", "prompt" if longest >= llm.cfg.max_positions else "max_tokens",
                           "context_length_exceeded") from None
        plan = None
        if params.time_budget is not None:
            params, plan = self._plan_budget(route, params, longest, len(suffix or []))
        include_canvas = bool(body.stream_options and body.stream_options.include_canvas)
        return EngineRequest(prompts, params, body.n, stop, include_canvas and body.stream,
                             given_back=[text for _, text, _ in healed], first_tokens=[ids for _, _, ids in healed],
                             suffixes=suffixes, plan=plan)

    @staticmethod
    def _plan_budget(route: ModelRoute, params, prompt_len: int, suffix_len: int):
        """A time budget's plan for the batch the request joins: 400 when even an idle engine cannot
        meet it, 429 when only the current load is in the way (both name the minimum)."""
        llm = route.llm
        try:
            plan = llm.plan_budget(params, prompt_len, suffix_len)
        except ValueError as e:
            raise APIError(400, str(e), "time_budget") from None
        load = route.engine.engine.load_seconds()
        if not load:
            return plan.params, plan
        try:
            plan = llm.plan_budget(params, prompt_len, suffix_len, load)
        except ValueError as e:
            raise APIError(429, f"{e} at the current load (the running batch's steps take {load * 1000:.1f} ms); "
                                "retry later or with a larger budget", "time_budget", "time_budget_infeasible",
                           "rate_limit_error") from None
        return plan.params, plan

    @staticmethod
    def _encode(llm: LLM, prompt) -> list[int]:
        try:
            return llm.encode_prompt(prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None

    @staticmethod
    async def _ready_for_budget(route: ModelRoute, body: SamplingFields) -> None:
        """A time budget plans from measured pass costs: time them once, on the model's torch thread."""
        if body.time_budget is not None and not route.llm.pass_costs.is_calibrated:
            await route.engine.run_on_torch_thread(route.llm.calibrate_pass_costs)

    async def completions(self, body: CompletionRequest, request: Request):
        route = self.route(body, request)
        await self._ready_for_budget(route, body)
        suffix = None
        if body.suffix:  # infilling: the completion is what goes between prompt and suffix
            try:
                suffix = route.llm.encode_suffix(body.suffix)
            except ValueError as e:
                raise APIError(400, str(e), "suffix") from None
        raw = body.prompt
        if isinstance(raw, list) and not raw:
            raise APIError(400, "prompt is empty: give at least one token", "prompt")
        items = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
        prompts = [self._encode(route.llm, p) for p in items]
        tokenizer = route.llm.tokenizer
        echo = [(p if isinstance(p, str) else tokenizer.decode(ids) if tokenizer else "") if body.echo else ""
                for p, ids in zip(items, prompts, strict=True)]
        engine_request = self._prepare(route, body, prompts, [isinstance(p, str) for p in items], 16, suffix)
        return await self._respond(route, request, engine_request, body, chat=False,
                                   prefixes=[echo[i // body.n] for i in range(engine_request.num_rows)])

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        route = self.route(body, request)
        await self._ready_for_budget(route, body)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = route.llm.chat_prompt(messages)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:  # a template error is the request's fault (its messages), not the server's
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        # A chat prompt ends with the template's own text: taken as given (as `kstep generate --chat`).
        engine_request = self._prepare(route, body, [prompt], [False], self.config.default_max_tokens)
        return await self._respond(route, request, engine_request, body, chat=True,
                                   prefixes=[""] * engine_request.num_rows)

    async def _respond(self, route: ModelRoute, request: Request, engine_request: EngineRequest, body: SamplingFields,
                       chat: bool, prefixes: list[str]):
        try:
            queue = route.engine.submit(engine_request)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", kind="rate_limit_error") from None
        except ShuttingDown as e:
            raise APIError(503, str(e), code="server_shutdown", kind="server_error") from None
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        stream = Stream(response_id, route.name, chat, engine_request, prefixes)
        stream.watch(request, queue, route.engine)
        if body.stream:
            return StreamingResponse(stream.events(queue, route.engine, route.metrics), media_type="text/event-stream")
        return await stream.collect(queue, route.metrics)
