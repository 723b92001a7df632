"""`kstep bench burst`: N requests at once (issue 45) against a `kstep serve` whose KV pool holds a
fraction of what they would take together. Prompts of mixed lengths (token ids) and max_tokens up to
M, greedy, `ignore_eos` (every request runs its whole length), from a seeded RNG. Reported: statuses
(failures, 5xx), preemptions (from usage), wall time and output tokens/s, the server's peak RSS
(VmHWM) beside its pool's budget, and whether each of a sample of the requests, sent again alone
afterwards, gets the same text.

The load is plain asyncio + httpx (no torch here)."""
import asyncio
import json
import random
import time
from collections import Counter

import httpx

from kstep.bench.sweep import peak_rss
from kstep.flags import add_command

PROMPT_LENGTHS = (4, 32, 128, 512)


def plan(num_requests: int, max_tokens: int, vocab: int, fixed_tokens: bool = False, settings: dict | None = None,
         seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(vocab) for _ in range(rng.choice(PROMPT_LENGTHS))],
             "max_tokens": max_tokens if fixed_tokens else rng.randint(16, max_tokens), "temperature": 0,
             "ignore_eos": True, **(settings or {})} for _ in range(num_requests)]


async def _send(http: httpx.AsyncClient, url: str, body: dict) -> tuple[int, str | None, dict]:
    r = await http.post(url + "/v1/completions", json={"model": "bench", **body})
    if r.status_code != 200:
        return r.status_code, None, {}
    data = r.json()
    return 200, data["choices"][0]["text"], data["usage"]


async def _burst(url: str, bodies: list[dict]) -> list[tuple[int, str | None, dict]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=len(bodies) + 4)) \
            as http:
        return await asyncio.gather(*(_send(http, url, b) for b in bodies))


async def _alone(url: str, bodies: list[dict]) -> list[tuple[int, str | None, dict]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as http:
        return [await _send(http, url, b) for b in bodies]


def run_burst(model: str, num_requests: int, max_tokens: int, pool_fraction: float, check: int,
              serve_args: list[str], progress=print, fixed_tokens: bool = False, settings: dict | None = None,
              kv_cache_memory: int | None = None) -> dict:
    from kstep.bench.server_process import running_server
    from kstep.bundled import resolve_model
    from kstep.weights import read_model_config
    cfg = read_model_config(resolve_model(model))
    bodies = plan(num_requests, max_tokens, cfg.vocab_size, fixed_tokens, settings)
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # float32 keys and values (about: per layer)
    together = sum(len(b["prompt"]) + b["max_tokens"] for b in bodies) * per_token
    budget = kv_cache_memory or int(together * pool_fraction)
    args = ["--served-model-name", "bench", "--kv-cache-memory", str(budget), *serve_args]
    with running_server(model, *args) as (url, proc):
        start = time.perf_counter()
        burst = asyncio.run(_burst(url, bodies))
        seconds = time.perf_counter() - start
        peak = peak_rss(proc.pid)
        pool = httpx.get(url + "/health").json()["models"]["bench"]["kv_pool"]["model"]
        sample = random.Random(1).sample(range(num_requests), min(check, num_requests))
        alone = asyncio.run(_alone(url, [bodies[i] for i in sample]))
    ok = [r for r in burst if r[0] == 200]
    result = {"model": model, "requests": num_requests, "max_tokens": max_tokens, "pool_fraction": pool_fraction,
              "pool_bytes": pool["bytes"], "together_bytes": together, "failed": num_requests - len(ok),
              "statuses": dict(sorted(Counter(str(r[0]) for r in burst).items())),
              "status_5xx": sum(r[0] >= 500 for r in burst), "preempted_requests": sum(bool(r[2].get("preemptions"))
                                                                                         for r in ok),
              "preemptions": sum(r[2].get("preemptions", 0) for r in ok), "seconds": round(seconds, 1),
              "output_tokens_per_s": round(sum(r[2]["completion_tokens"] for r in ok) / seconds, 1),
              "server_peak_rss_bytes": peak, "checked_alone": len(sample),
              "same_as_alone": sum(burst[i][1] == a[1] for i, a in zip(sample, alone))}
    progress(json.dumps(result))
    return result


def add_burst(kinds) -> None:
    bench = add_command(kinds, "burst", "N requests at once on a KV pool that holds a fraction of them")
    bench.add_argument("--model", default="default-ar")
    bench.add_argument("--requests", type=int, default=256)
    bench.add_argument("--max-tokens", type=int, default=512)
    bench.add_argument("--pool-fraction", type=float, default=0.1, help="the pool's share of what all would take")
    bench.add_argument("--check", type=int, default=32, help="requests sent again alone afterwards and compared")
    bench.add_argument("--fixed-tokens", action="store_true", help="every request asks for --max-tokens")
    bench.add_argument("--kv-cache-memory", type=int, default=None, help="the pool's bytes (instead of the fraction)")
    bench.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE", help="a request field (JSON)")
    bench.add_argument("--serve-arg", action="append", default=[], help="a `kstep serve` flag, e.g. "
                                                                        "--serve-arg=--max-num-batched-tokens=512")
    bench.add_argument("--max-batch-size", type=int, default=64)
    bench.add_argument("--out", default=None, help="write the result as JSON here")
    bench.set_defaults(run=_main)


def _main(args) -> int:
    if args.requests <= 0 or args.max_tokens < 16 or not 0 < args.pool_fraction <= 1 or args.check < 0:
        raise ValueError("--requests > 0, --max-tokens >= 16, --pool-fraction in (0, 1] and --check >= 0, please")
    settings = {}
    for item in args.setting:
        key, _, value = item.partition("=")
        settings[key] = json.loads(value)
    result = run_burst(args.model, args.requests, args.max_tokens, args.pool_fraction, args.check,
                       ["--max-batch-size", str(args.max_batch_size), *args.serve_arg],
                       lambda line: print(line, flush=True), args.fixed_tokens, settings, args.kv_cache_memory)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
