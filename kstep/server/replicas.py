"""`kstep serve --replicas N`: the same OpenAI-compatible app (app.py) as a Ray Serve application,
N replicas behind Ray Serve's HTTP proxy. Each replica is a Ray actor (its own process) that loads
every served model with its own engines (loading.py) and names itself in an `x-kstep-replica`
response header. Ray starts locally unless `--ray-address` joins a running cluster. SIGTERM (or
Ctrl-C) deletes the application (replicas drain their in-flight requests for up to the graceful
timeout), shuts Serve down, and stops the local Ray instance this process started.

With `-tp N` (or a model's `tp=N`) each replica is rank 0 of its models' groups: the deployment
reserves a placement group per replica (bundle 0 the replica, then one per other rank of each model,
STRICT_PACK), and the models load with the "ray" backend, whose rank actors take those bundles
(kstep/distributed/ray_ranks.py). A replica whose group is lost ends that model's requests with
503 (as one process does), answers 503 for it from then on and fails Serve's health check, so
Serve replaces it (its rank actors and placement group go with it) instead of the replica
exiting: unlike one process, whose lost model stays down, a replica's comes back (its other
models serve until it is replaced).

Ray is an optional dependency (`pip install -e .[ray]`): this module is imported only for --replicas."""
import signal
import sys
import threading
from dataclasses import dataclass, replace

import ray
from prometheus_client import Gauge
from ray import serve

from kstep.server.loading import LoadOptions, load_served_models
from kstep.server.model_specs import ModelSpec

REPLICA_HEADER = "x-kstep-replica"
APP_NAME = "kstep"
HEALTH_CHECK_SECONDS = 2.0  # how soon Serve finds a replica whose group is lost (its default: 10)


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
        self.failed = False

    def check_health(self) -> None:
        """Serve's health check: a replica whose model can no longer run is replaced."""
        if self.failed:
            raise RuntimeError("a model of this replica cannot run any more (its tensor-parallel group is lost)")

    def _fail(self) -> None:  # a model went down, once its requests in flight have their 503
        self.failed = True

    def __serve_build_asgi_app__(self):
        from kstep.server.app import build_app
        replica = serve.get_replica_context().replica_id.unique_id
        app = build_app(load_served_models(self.specs, self.options, announce=f"on replica {replica}"), self.config)
        app.state.replica = replica
        # scraped through the proxy, /metrics is one replica's: this series says which
        Gauge("kstep_replica", "The Ray Serve replica whose metrics these are (always 1)", ["replica"],
              registry=app.state.metrics.registry).labels(replica).set(1)
        app.add_middleware(ReplicaHeader, replica=replica)
        # a model down: Serve replaces the replica, which loads it again (its healthy models too)
        app.state.routes.on_model_down = lambda name: self._fail()
        app.state.routes.on_no_live_model = self._fail
        return app


def rank_bundles(specs: list[ModelSpec], options: LoadOptions) -> list[dict[str, float]]:
    """A replica's bundles for its models' other ranks, in load order (a rank: one thread, or one GPU)."""
    from kstep.distributed.ray_ranks import rank_bundle
    ranks = sum((spec.tensor_parallel_size or options.tensor_parallel_size) - 1 for spec in specs)
    return [rank_bundle(options.device, 1)] * ranks


def check_fits(bundles: list[dict[str, float]]) -> None:
    """One replica's placement group (STRICT_PACK: one node) fits a node of the Ray cluster, or a
    ValueError naming the numbers: Serve would wait for it for ever."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0) + amount
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if not any(all(r.get(k, 0) >= v for k, v in need.items()) for r in nodes):
        have = [{k: r.get(k, 0) for k in need} for r in nodes]
        raise ValueError(f"a replica and its ranks need {need} on one node; the Ray nodes have {have}")


def serve_replicas(specs: list[ModelSpec], options: LoadOptions, config, replica: ReplicaOptions) -> int:
    started_ray = replica.ray_address is None
    gpus = 1 if options.device == "cuda" else 0
    own = {"CPU": replica.cpus_per_replica, **({"GPU": gpus} if gpus else {})}
    ranks = rank_bundles(specs, options)
    ray.init(address=replica.ray_address, include_dashboard=False, logging_level="warning",
             log_to_driver=False)
    if ranks:
        try:
            check_fits([own, *ranks])
        except ValueError:
            if started_ray:
                ray.shutdown()
            raise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": replica.host, "port": replica.port})
        threads = options.threads or max(1, int(replica.cpus_per_replica))
        placement = {"placement_group_bundles": [own, *ranks], "placement_group_strategy": "STRICT_PACK"} \
            if ranks else {}
        deployment = serve.deployment(
            KstepReplica, name="kstep", num_replicas=replica.replicas,
            ray_actor_options={"num_cpus": replica.cpus_per_replica, "num_gpus": gpus}, **placement,
            graceful_shutdown_timeout_s=replica.graceful_timeout, max_ongoing_requests=max(64, config.max_queue),
            health_check_period_s=HEALTH_CHECK_SECONDS)
        app = deployment.bind(specs, replace(options, threads=threads, distributed_executor_backend="ray"), config)
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
