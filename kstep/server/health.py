"""`GET /health`: whether the server and each of its models can serve, as a JSON body and as the
status code a probe reads.

- `/health`: 200 while at least one model is up, `status` "ok" (all up) or "degraded" (some down:
  the rest still serve, so a readiness probe keeps routing to them); 503 with "down" once none is
  (kstep serve is then exiting non-zero).
- Each model's entry has its KV pool's budget and its pages by state (`kv_pool`: used by requests,
  cached by the prefix cache, free), its draft model's beside it.
- `/health?model=NAME`: 200 if that model is up, 503 if it is down (a probe for one model: point
  a liveness probe at the model a replica must serve, so a pod that lost it is restarted); 404 for
  a name not served.

Every model's ranks are looked at on each call (a lost tensor-parallel rank shows at once, idle or
not), besides the engines' own watchers."""
import os

from fastapi.responses import JSONResponse

from kstep.distributed.runner import TensorParallelRunner
from kstep.server.errors import APIError
from kstep.server.routes import ModelRoute, Routes


def kv_pools(llm, prefix_cache=None) -> dict:
    """The model's KV pool (and its draft model's), budget and pages by state (the model's prefix
    cache's pages as `cached`)."""
    pools = {"model": llm.runner.kv_pool}
    if getattr(llm.drafter, "kv_pool", None) is not None:
        pools["draft"] = llm.drafter.kv_pool
    cached = {"model": 0 if prefix_cache is None else prefix_cache.only_held_pages()}
    return {name: {"bytes": pool.nbytes, "page_tokens": pool.page_tokens, "pages": pool.usage(cached.get(name, 0))}
            for name, pool in pools.items() if pool is not None}


def model_health(route: ModelRoute) -> dict:
    """One model's entry: up or down (and why), its load, and its other ranks where it has some."""
    scheduler, is_up = route.engine.engine.scheduler, route.engine.is_up()
    out = {"status": "ok" if is_up else "down", "running": scheduler.num_running, "waiting": scheduler.num_waiting}
    if not is_up:
        out["error"] = route.engine.down
    out["kv_pool"] = kv_pools(route.llm, route.engine.engine.prefix_cache)
    runner = route.llm.runner
    if isinstance(runner, TensorParallelRunner):
        out["ranks"] = runner.ranks()
    return out


def health_response(routes: Routes, replica: str | None, model: str | None) -> JSONResponse:
    if model is not None and model not in routes.by_name:
        served = ", ".join(repr(name) for name in routes.by_name)
        raise APIError(404, f"model {model!r} does not exist; this server serves {served}", "model", "model_not_found")
    models = {name: model_health(route) for name, route in routes.by_name.items()}
    up = [name for name, m in models.items() if m["status"] == "ok"]
    status = "ok" if len(up) == len(models) else "degraded" if up else "down"
    body = {"status": status, "pid": os.getpid(), "replica": replica,
            "running": sum(m["running"] for m in models.values()),
            "waiting": sum(m["waiting"] for m in models.values()), "models": models}
    is_healthy = model in up if model is not None else bool(up)
    return JSONResponse(body, status_code=200 if is_healthy else 503)
