"""`kstep serve --replicas N`: the same OpenAI-compatible app (app.py) as a Ray Serve application,
N replicas behind Ray Serve's HTTP proxy. Each replica is a Ray actor (its own process) that loads
every served model with its own engines (loading.py) and names itself in an `x-kstep-replica`
response header. Ray starts locally unless `--ray-address` joins a running cluster. SIGTERM (or
Ctrl-C) deletes the application (replicas drain their in-flight requests for up to the graceful
timeout), shuts Serve down, and stops the local Ray instance this process started.

Ray is an optional dependency (`pip install -e .[ray]`): this module is imported only for --replicas."""
import signal
import sys
import threading
from dataclasses import dataclass

import ray
from prometheus_client import Gauge
from ray import serve

from kstep.server.loading import LoadOptions, load_served_models
from kstep.server.model_specs import ModelSpec

REPLICA_HEADER = "x-kstep-replica"
APP_NAME = "kstep"


@dataclass(slots=True, frozen=True)
class ReplicaOptions:
    replicas: int
    cpus_per_replica: float = 1.0
    ray_address: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    graceful_timeout: float = 30.0


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that served it."""

    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (REPLICA_HEADER.encode(), self.replica)]
            await send(message)
        await self.app(scope, receive, named)


@serve.ingress()
class KstepReplica:
    """One replica: its app is built when Ray Serve initialises it (the models load there)."""

    def __init__(self, specs: list[ModelSpec], options: LoadOptions, config):
        self.specs, self.options, self.config = specs, options, config

    def __serve_build_asgi_app__(self):
        from kstep.server.app import build_app
        replica = serve.get_replica_context().replica_id.unique_id
        app = build_app(load_served_models(self.specs, self.options, announce=f"on replica {replica}"), self.config)
        app.state.replica = replica
        # scraped through the proxy, /metrics is one replica's: this series says which
        Gauge("kstep_replica", "The Ray Serve replica whose metrics these are (always 1)", ["replica"],
              registry=app.state.metrics.registry).labels(replica).set(1)
        app.add_middleware(ReplicaHeader, replica=replica)
        return app


def serve_replicas(specs: list[ModelSpec], options: LoadOptions, config, replica: ReplicaOptions) -> int:
    started_ray = replica.ray_address is None
    ray.init(address=replica.ray_address, include_dashboard=False, logging_level="warning",
             log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": replica.host, "port": replica.port})
        gpus = 1 if options.device == "cuda" else 0
        threads = options.threads or max(1, int(replica.cpus_per_replica))
        deployment = serve.deployment(
            KstepReplica, name="kstep", num_replicas=replica.replicas,
            ray_actor_options={"num_cpus": replica.cpus_per_replica, "num_gpus": gpus},
            graceful_shutdown_timeout_s=replica.graceful_timeout, max_ongoing_requests=max(64, config.max_queue))
        app = deployment.bind(specs, LoadOptions(options.device, options.dtype, threads, options.draft,
                                                 options.quantize, options.shared_defaults), config)
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"kstep serve: {replica.replicas} replicas of {', '.join(s.name for s in specs)} on "
              f"http://{replica.host}:{replica.port}/v1 (Ray Serve)", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        try:
            serve.delete(APP_NAME)  # replicas drain in-flight requests, up to the graceful timeout
            serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
    return 0
