"""Prometheus metrics (prometheus-client), one registry per server so that several servers can
live in one process (the tests). Every series carries a `model` label: the served name of the model
it is about ("" for a request refused before it named a served model)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kstep.engine.engine import Engine
from kstep.engine.request import StepStats
from kstep.engine.scheduler import Scheduler

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        m = ["model"]
        self.requests = Counter("kstep_requests", "Finished requests by HTTP status (or 'cancelled')",
                                ["model", "status"], registry=r)
        self.prompt_tokens = Counter("kstep_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.completion_tokens = Counter("kstep_completion_tokens", "Completion tokens of finished requests", m,
                                         registry=r)
        self.forward_passes = Counter("kstep_forward_passes", "Engine forward passes (each serves a batch)", m,
                                      registry=r)
        self.step_tokens = Histogram("kstep_step_committed_tokens", "Tokens committed per forward pass, whole batch",
                                     m, buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.request_tokens_per_pass = Histogram(
            "kstep_request_tokens_per_forward_pass", "Per finished request: completion tokens / its forward passes",
            m, buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 16, 32), registry=r)
        self.step_seconds = Histogram("kstep_step_seconds", "Latency of one engine step (one forward pass)", m,
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("kstep_batch_size", "Requests per forward pass", m,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.kv_pool_pages = Gauge("kstep_kv_pool_pages", "KV pool pages by state (used, cached, free, total); a draft "
                                   "model's under MODEL/draft", ["model", "state"], registry=r)
        self.preemptions = Counter("kstep_preemptions", "Requests preempted (KV pages taken back so another could "
                                   "grow; each resumed by recomputing)", m, registry=r)
        self.kv_pool_bytes = Gauge("kstep_kv_pool_bytes", "KV pool budget: bytes its storage takes", m, registry=r)
        self.queue_seconds = Histogram("kstep_queue_seconds", "Time from arrival to joining the batch (KV pages "
                                       "granted)", m, buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                       registry=r)
        self.queue_depth = Gauge("kstep_queue_depth", "Requests waiting for a batch slot", m, registry=r)
        self.running = Gauge("kstep_running_requests", "Requests in the running batch", m, registry=r)
        self.ttft = Histogram("kstep_time_to_first_token_seconds", "Time to the first streamed text", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prefix_hit_tokens = Gauge("kstep_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                       m, registry=r)
        self.prefix_query_tokens = Gauge("kstep_prefix_cache_query_tokens", "Prompt tokens looked up in the cache",
                                         m, registry=r)
        self.prefix_bytes = Gauge("kstep_prefix_cache_bytes", "Bytes held by the prefix cache", m, registry=r)
        self.expert_pairs = Gauge("kstep_expert_pairs", "Expert parallel: (token, expert) pairs each rank's experts "
                                  "have run, over every MoE layer", ["model", "rank"], registry=r)
        self.draft_tokens = Counter("kstep_draft_tokens", "Speculation (a draft model, ngram, or draft self): tokens "
                                    "(steps) drafted, and those kept", ["model", "outcome"], registry=r)
        self.request_seconds = Histogram("kstep_request_seconds", "Request latency, arrival to last byte", m,
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.grammar_compile = Histogram("kstep_grammar_compile_seconds", "Structured outputs: compiling a grammar "
                                         "(once per spec and model; cached after)", m,
                                         buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1), registry=r)
        self.grammar_mask = Histogram("kstep_grammar_mask_microseconds", "Structured outputs: per request, the mean "
                                      "time of one grammar mask (one position's allowed tokens)", m,
                                      buckets=(5, 10, 25, 50, 100, 250, 500, 1000, 5000), registry=r)
        self.grammar_forced = Counter("kstep_grammar_forced_tokens", "Structured outputs: tokens the grammar forced, "
                                      "placed without a forward pass", m, registry=r)
        self.constrained = Counter("kstep_constrained_requests", "Structured outputs and tool calls: requests by "
                                   "outcome (stop, tool_calls, length, refused)", ["model", "outcome"], registry=r)

    def for_model(self, model: str) -> "ModelMetrics":
        return ModelMetrics(self, model)

    def observe_request(self, model: str, status: str, prompt_tokens: int = 0, completion_tokens: int = 0,
                        nfe: int = 0, seconds: float | None = None) -> None:
        self.requests.labels(model, status).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.completion_tokens.labels(model).inc(completion_tokens)
        if nfe:
            self.request_tokens_per_pass.labels(model).observe(completion_tokens / nfe)
        if seconds is not None:
            self.request_seconds.labels(model).observe(seconds)


class ModelMetrics:
    """The metrics of one served model (its label bound)."""

    def __init__(self, metrics: Metrics, model: str):
        self.metrics, self.model = metrics, model
        self.preemptions_seen = 0

    def watch(self, scheduler: Scheduler) -> None:
        """The queue and batch gauges read the scheduler at each scrape, so they drop the moment a
        request leaves for any reason (finished, failed, cancelled, its client gone), step or no step."""
        self.metrics.queue_depth.labels(self.model).set_function(lambda: scheduler.num_waiting)
        self.metrics.running.labels(self.model).set_function(lambda: scheduler.num_running)

    def watch_pools(self, llm, prefix_cache=None) -> None:
        """The KV pool gauges read the pools at each scrape (the model's, its prefix cache's pages as
        `cached`, and its draft model's)."""
        pools = [(self.model, llm.runner.kv_pool, prefix_cache),
                 (f"{self.model}/draft", getattr(llm.drafter, "kv_pool", None), None)]
        for label, pool, cache in pools:
            if pool is None:
                continue
            for state in ("used", "cached", "free", "total"):
                self.metrics.kv_pool_pages.labels(label, state).set_function(
                    lambda p=pool, s=state, c=cache: p.usage(0 if c is None else c.only_held_pages())[s])
            self.metrics.kv_pool_bytes.labels(label).set(pool.nbytes)

    def observe_step(self, stats: StepStats, engine: Engine) -> None:
        m, label = self.metrics, self.model
        m.forward_passes.labels(label).inc(stats.num_passes)
        m.step_tokens.labels(label).observe(stats.num_committed)
        m.step_seconds.labels(label).observe(stats.seconds)
        m.batch_size.labels(label).observe(stats.batch_size)
        for seconds in stats.queue_seconds:
            m.queue_seconds.labels(label).observe(seconds)
        m.preemptions.labels(label).inc(engine.preemptions - self.preemptions_seen)
        self.preemptions_seen = engine.preemptions
        for rank, pairs in enumerate(engine.llm.runner.expert_load() or []):
            m.expert_pairs.labels(label, str(rank)).set(pairs)
        if engine.prefix_cache is not None:
            m.prefix_hit_tokens.labels(label).set(engine.prefix_cache.hit_tokens)
            m.prefix_query_tokens.labels(label).set(engine.prefix_cache.query_tokens)
            m.prefix_bytes.labels(label).set(engine.prefix_cache.nbytes)

    def observe_request(self, status: str, prompt_tokens: int = 0, completion_tokens: int = 0, nfe: int = 0,
                        seconds: float | None = None) -> None:
        self.metrics.observe_request(self.model, status, prompt_tokens, completion_tokens, nfe, seconds)

    def observe_drafts(self, stats: dict) -> None:
        """A finished request's drafts (its decoder's stats), if it speculated."""
        if "drafted_tokens" in stats:
            self.metrics.draft_tokens.labels(self.model, "drafted").inc(stats["drafted_tokens"])
            self.metrics.draft_tokens.labels(self.model, "accepted").inc(stats["accepted_tokens"])

    def observe_grammar(self, stats: dict, outcomes: list[str]) -> None:
        """A finished structured request: its grammar's figures and each choice's outcome."""
        m = self.metrics
        if "grammar_compile_seconds" in stats:
            m.grammar_compile.labels(self.model).observe(stats["grammar_compile_seconds"])
        if stats.get("grammar_masks"):
            m.grammar_mask.labels(self.model).observe(stats["grammar_mask_seconds"] / stats["grammar_masks"] * 1e6)
        m.grammar_forced.labels(self.model).inc(stats.get("grammar_forced_tokens", 0))
        for outcome in outcomes:
            m.constrained.labels(self.model, outcome).inc()

    def observe_refused_grammar(self) -> None:
        self.metrics.constrained.labels(self.model, "refused").inc()

    def observe_ttft(self, seconds: float) -> None:
        self.metrics.ttft.labels(self.model).observe(seconds)
