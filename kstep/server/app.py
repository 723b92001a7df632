"""FastAPI routes of `kstep serve`: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses
(JSON or server-sent events), /health (health.py), /metrics, and the playground page at /. Validation
happens at the edge (routes.py; errors.py says no): params are resolved for the served model
before a request reaches the engine.

A server may serve several models: each has its own engine (continuous batching, caches, decoding
defaults) on its own torch thread; a request's `model` picks one. A model that cannot run any more
(a lost tensor-parallel rank) is down alone: the others go on serving."""
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kstep.distributed.runner import TensorParallelRunner
from kstep.engine.async_engine import AsyncEngine
from kstep.engine.engine import Engine
from kstep.engine.offline import warm_up
from kstep.engine.request import RequestLimits
from kstep.llm import LLM
from kstep.params.validation import MAX_PASSES_PER_POSITION
from kstep.server.errors import APIError, BodySizeLimit, install_error_handlers
from kstep.server.health import health_response
from kstep.server.metrics import Metrics
from kstep.server.chat_protocol import ChatCompletionRequest
from kstep.server.protocol import CompletionRequest
from kstep.server.responses import create_response
from kstep.server.responses_protocol import ResponsesRequest
from kstep.server.routes import ModelRoute, Routes


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
class ServeConfig:
    api_key: str | None = None
    max_batch_size: int = 16
    max_num_batched_tokens: int | None = 2048  # a step's tokens: admission, and longer prefills in chunks (Engine)
    long_prefill_token_threshold: int | None = None  # a prompt's chunk, when smaller than the step's budget
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


def rank_check(llm: LLM) -> Callable[[], None] | None:
    """What tells whether the model's ranks are all alive (raising GroupLost), where it has others."""
    return llm.runner.check_ranks if isinstance(llm.runner, TensorParallelRunner) else None


def _route(m: ServedModel, config: ServeConfig, metrics: Metrics) -> ModelRoute:
    engine = Engine(m.llm, config.max_batch_size, config.max_queue, config.prefix_cache_bytes, config.limits(m.llm),
                    config.max_num_batched_tokens, long_prefill_token_threshold=config.long_prefill_token_threshold)
    model_metrics = metrics.for_model(m.name)
    model_metrics.watch(engine.scheduler)
    model_metrics.watch_pools(m.llm, engine.prefix_cache)
    return ModelRoute(m.name, m.llm, m.defaults, AsyncEngine(engine, model_metrics.observe_step, m.executor,
                                                             rank_check(m.llm)), model_metrics)


def build_app(models: list[ServedModel], config: ServeConfig) -> FastAPI:
    if not models or len({m.name for m in models}) != len(models):
        raise ValueError(f"served model names must be given and distinct, got {[m.name for m in models]}")
    metrics = Metrics()
    routes = Routes(config.default_max_tokens, [_route(m, config, metrics) for m in models])

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        routes.compile_worker.start()
        for route in routes.by_name.values():
            await route.engine.run_on_torch_thread(warm_up, route.llm)
            await route.engine.start()
        yield
        for route in routes.by_name.values():
            await route.engine.stop()
            route.llm.close()  # a tensor-parallel model's other ranks stop with it
        routes.compile_worker.close()

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
    async def health(model: str | None = None):
        return health_response(routes, getattr(app.state, "replica", None), model)

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

    @app.post("/v1/responses", dependencies=[Depends(check_key)])
    async def responses(body: ResponsesRequest, request: Request):  # on the chat path (server/responses.py)
        return await create_response(routes, body, request)

    return app
