"""The OpenAI endpoints' work for a server's models (app.py routes to it): pick the model, encode
and validate at the edge (errors.py says no), submit to its engine, respond (streaming.py). Also
which models are up: a model whose engine is down (a lost tensor-parallel rank) answers 503, the
others go on, and once none is up the server is told (`on_no_live_model`)."""
import asyncio
import logging
import os
import signal
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from kstep.engine.async_engine import AsyncEngine, ModelDown, ShuttingDown
from kstep.engine.request import Request as EngineRequest
from kstep.engine.scheduler import QueueFull
from kstep.llm import LLM
from kstep.params.family_defaults import defaults_for_mode
from kstep.server.errors import APIError, param_named_in
from kstep.server.metrics import ModelMetrics
from kstep.server.chat_protocol import ChatCompletionRequest
from kstep.server.protocol import CompletionRequest, SamplingFields
from kstep.server.streaming import Stream
from kstep.structured.compile_worker import CompileWorker
from kstep.server.tools import prompt_messages

log = logging.getLogger("kstep.server")
PREPARE_WORKERS = 2  # threads preparing requests (prompts, checks)
COMPILE_WORKERS = 1  # threads compiling new grammars: a hostile spec costs at most one core for a search's bound


@dataclass(slots=True)
class ModelRoute:
    """A served model's request path: its model, defaults, engine and metrics."""
    name: str
    llm: LLM
    defaults: dict
    engine: AsyncEngine
    metrics: ModelMetrics


def _terminate() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class Routes:
    """The OpenAI endpoints' work: pick the model, encode and validate at the edge, submit, respond.
    A model going down is told to `on_model_down` (its name), and once none is up, to
    `on_no_live_model` (kstep serve: exit non-zero; by default the process is asked to terminate)."""

    def __init__(self, default_max_tokens: int, routes: list[ModelRoute]):
        self.default_max_tokens = default_max_tokens
        # Preparing a request (rendering and tokenizing its prompt, checking it) runs in `workers`, and
        # compiling a new grammar (up to a completion search's bound: kstep/structured/search.py) in
        # `compilers` first, never on the event loop, its search in `compile_worker`'s process: one
        # request's preparation never stalls another's stream, and new grammars wait for each other,
        # not for the requests that bring none.
        self.workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="kstep-prepare")
        self.compilers = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="kstep-compile")
        self.compile_worker = CompileWorker()
        for route in routes:
            route.llm.grammar.planner = self.compile_worker.plan
        self.by_name = {r.name: r for r in routes}
        self.on_model_down: Callable[[str], None] = lambda name: None
        self.on_no_live_model: Callable[[], None] = _terminate
        self._told_none_live = False
        for route in routes:
            route.engine.on_fatal = lambda name=route.name: self._model_down(name)

    def _model_down(self, name: str) -> None:
        live = self.live()
        log.error("model %r cannot run any more (%s); %s", name, self.by_name[name].engine.down,
                  f"still serving {', '.join(live)}" if live else "no model is left: the server stops")
        self.on_model_down(name)
        if not live and not self._told_none_live:  # once (a model found down while counting the live ones)
            self._told_none_live = True
            self.on_no_live_model()

    def live(self) -> list[str]:
        """The models that can still run (their ranks looked at now)."""
        return [name for name, route in self.by_name.items() if route.engine.is_up()]

    # Shutdown (server/shutdown.py): refuse new requests, then end the ones in flight.
    def refuse_new(self) -> None:
        for route in self.by_name.values():
            route.engine.is_closing = True

    def num_in_flight(self) -> int:
        """Requests whose last output has not reached their handler: queued, running, or finished in
        the step now running (the scheduler lets go of a request before the step's outputs are handed
        over, so counting its running and waiting ones let a drain end such a request with a 503)."""
        return sum(len(r.engine.queues) for r in self.by_name.values())

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
        if not route.engine.is_up():
            raise self._down(route)
        return route

    @staticmethod
    def _down(route: ModelRoute) -> APIError:
        return APIError(503, f"model {route.name!r} is down: {route.engine.down}; it stays down until the server "
                             "restarts (GET /health shows which models are up)", "model", "model_down", "server_error")

    def _prepare(self, route: ModelRoute, body: SamplingFields, prompts: list[list[int]], is_text: list[bool],
                 default_max_tokens: int, suffix: list[int] | None = None) -> EngineRequest:
        """Params resolved for the model (a structured output's grammar compiled: module note), text
        prompts token-healed, the context checked."""
        llm = route.llm
        if (field_name := body.unsupported()) is not None:
            raise APIError(400, f"{field_name} is not supported by kstep", field_name)
        if ignored := body.ignored():
            log.info("ignoring %s (no effect on the output)", ", ".join(ignored))
        try:
            defaults = defaults_for_mode(llm.family, route.defaults, body.mode or route.defaults.get("mode"))
            params = llm.resolve(body.generation_params(defaults, default_max_tokens))
            grammar = None if params.structured is None else llm.grammar.compile(params.structured)  # cached
            stop = body.stop_strings()
        except ValueError as e:
            if body.asks_structured():
                route.metrics.observe_refused_grammar()
            raise APIError(400, str(e), param_named_in(str(e), set(type(body).model_fields))) from None
        if stop and grammar is not None and grammar.trigger is None:
            raise APIError(400, f"stop: a stop string cannot end an output that {params.structured.field} asks "
                                "for: its grammar decides where it ends, and a stop string would cut it mid-way "
                                "(with tool_choice \"auto\" and no response_format, stop ends a text answer)",
                           "stop")
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
                             suffixes=suffixes, plan=plan, grammar=grammar)

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
        engine_request, echo = await self.off_loop(route, body, self._prepare_completion)
        return await self._respond(route, request, engine_request, body, chat=False,
                                   prefixes=[echo[i // body.n] for i in range(engine_request.num_rows)])

    async def off_loop(self, route: ModelRoute, body: SamplingFields, prepare: Callable):
        """`prepare(route, body)` in a worker thread, once the body's grammar is compiled (or refused:
        `prepare` then finds the refusal cached and says why)."""
        loop = asyncio.get_running_loop()
        try:
            spec = body.structured()
        except ValueError:
            spec = None  # `prepare` refuses the body, naming the field
        if spec is not None:
            try:
                await loop.run_in_executor(self.compilers, route.llm.grammar.compile, spec)
            except ValueError:
                pass
        return await loop.run_in_executor(self.workers, prepare, route, body)

    def _prepare_completion(self, route: ModelRoute, body: CompletionRequest) -> tuple[EngineRequest, list[str]]:
        """A completion body's engine request, and per prompt the text `echo` sends first."""
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
        return self._prepare(route, body, prompts, [isinstance(p, str) for p in items], 16, suffix), echo

    async def chat_request(self, body: ChatCompletionRequest, request: Request) -> tuple[ModelRoute, EngineRequest]:
        """A chat body's model and its engine request, prompt rendered and everything checked (the chat
        endpoint's, and the Responses API's once it has made its input a chat body: server/responses.py)."""
        route = self.route(body, request)
        await self._ready_for_budget(route, body)
        return route, await self.off_loop(route, body, self._prepare_chat)

    def _prepare_chat(self, route: ModelRoute, body: ChatCompletionRequest) -> EngineRequest:
        try:
            template = (route.llm.tokenizer.chat_template if route.llm.tokenizer else None) or ""
            messages, tools = prompt_messages([m.prompt_dict() for m in body.messages], body.tool_dicts(), template)
            prompt = route.llm.chat_prompt(messages, tools)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:  # a template error is the request's fault (its messages), not the server's
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        # A chat prompt ends with the template's own text: taken as given (as `kstep generate --chat`).
        return self._prepare(route, body, [prompt], [False], self.default_max_tokens)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        route, engine_request = await self.chat_request(body, request)
        return await self._respond(route, request, engine_request, body, chat=True,
                                   prefixes=[""] * engine_request.num_rows,
                                   calls_tools=bool(body.tools) and body.tool_choice_name() != "none")

    def submit(self, route: ModelRoute, request: Request, engine_request: EngineRequest, stream: Stream) -> asyncio.Queue:
        """Queue a prepared request on its model's engine; `stream` watches the client from now on
        (its disconnect aborts the request). Returns the queue its engine outputs arrive on."""
        try:
            queue = route.engine.submit(engine_request)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", kind="rate_limit_error") from None
        except ShuttingDown as e:
            raise APIError(503, str(e), code="server_shutdown", kind="server_error") from None
        except ModelDown:  # went down while this request was being prepared
            raise self._down(route) from None
        stream.watch(request, queue, route.engine)
        return queue

    async def _respond(self, route: ModelRoute, request: Request, engine_request: EngineRequest, body: SamplingFields,
                       chat: bool, prefixes: list[str], calls_tools: bool = False):
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = Stream(response_id, route.name, chat, engine_request, prefixes, calls_tools, include_usage)
        queue = self.submit(route, request, engine_request, stream)
        if body.stream:
            if (gone := await stream.admitted(queue, route.metrics)) is not None:
                return gone
            return StreamingResponse(stream.events(queue, route.engine, route.metrics), media_type="text/event-stream")
        return await stream.collect(queue, route.metrics)
