"""Prometheus metrics (prometheus-client), one registry per server so that several servers can
live in one process (the tests)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kstep.engine.engine import Engine, StepStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kstep_requests", "Finished requests by HTTP status (or 'cancelled')",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("kstep_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("kstep_completion_tokens", "Completion tokens of finished requests",
                                         registry=r)
        self.forward_passes = Counter("kstep_forward_passes", "Engine forward passes (each serves a batch)",
                                      registry=r)
        self.step_tokens = Histogram("kstep_step_committed_tokens", "Tokens committed per forward pass, whole batch",
                                     buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.request_tokens_per_pass = Histogram(
            "kstep_request_tokens_per_forward_pass", "Per finished request: completion tokens / its forward passes",
            buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 16, 32), registry=r)
        self.step_seconds = Histogram("kstep_step_seconds", "Latency of one engine step (one forward pass)",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("kstep_batch_size", "Requests per forward pass",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.queue_depth = Gauge("kstep_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("kstep_running_requests", "Requests in the running batch", registry=r)
        self.ttft = Histogram("kstep_time_to_first_token_seconds", "Time to the first streamed text",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prefix_hit_tokens = Gauge("kstep_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                       registry=r)
        self.prefix_query_tokens = Gauge("kstep_prefix_cache_query_tokens", "Prompt tokens looked up in the cache",
                                         registry=r)
        self.prefix_bytes = Gauge("kstep_prefix_cache_bytes", "Bytes held by the prefix cache", registry=r)
        self.request_seconds = Histogram("kstep_request_seconds", "Request latency, arrival to last byte",
                                         buckets=LATENCY_BUCKETS, registry=r)

    def observe_step(self, stats: StepStats, engine: Engine) -> None:
        self.forward_passes.inc(stats.num_passes)
        self.step_tokens.observe(stats.num_committed)
        self.step_seconds.observe(stats.seconds)
        self.batch_size.observe(stats.batch_size)
        self.queue_depth.set(engine.scheduler.num_waiting)
        self.running.set(engine.scheduler.num_running)
        if engine.prefix_cache is not None:
            self.prefix_hit_tokens.set(engine.prefix_cache.hit_tokens)
            self.prefix_query_tokens.set(engine.prefix_cache.query_tokens)
            self.prefix_bytes.set(engine.prefix_cache.nbytes)

    def observe_request(self, status: str, prompt_tokens: int = 0, completion_tokens: int = 0, nfe: int = 0,
                        seconds: float | None = None) -> None:
        self.requests.labels(status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if nfe:
            self.request_tokens_per_pass.observe(completion_tokens / nfe)
        if seconds is not None:
            self.request_seconds.observe(seconds)
