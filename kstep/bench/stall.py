"""`kstep bench stall`: whether compiling hostile grammars stalls other requests' streams. S streaming
requests run, and the longest gap between two chunks of any of them is measured, alone and while H
clients keep sending structured outputs that are expensive to refuse (a regex of a million forced
bytes, a string of a million characters at least: each new text costs a full completion search
before its 400). Each hostile spec is new (a counter in it), so no cache answers for it: the worst
case. Both runs in the same process, against the same server, one after the other.

The load is plain asyncio + httpx (no torch here), so it takes no cores from the server's torch thread
beyond what the HTTP work costs."""
import asyncio
import itertools
import json
import statistics
import time

import httpx

from kstep.flags import add_command

HOSTILE = (lambda i: {"structured_outputs": {"regex": f"x{i}(a{{1000}}){{1000}}"}},
           lambda i: {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": {
               "type": "string", "minLength": 1_000_000 + i}}}})


async def _stream_gaps(http: httpx.AsyncClient, url: str, model: str, max_tokens: int, seed: int) -> list[float]:
    """The gaps (seconds) between one streaming chat request's chunks."""
    body = {"model": model, "messages": [{"role": "user", "content": "Write a function."}], "max_tokens": max_tokens,
            "temperature": 0, "seed": seed, "stream": True, "ignore_eos": True}
    times = []
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:])]  # from the first token on (the role chunk is first)


async def _hostile(http: httpx.AsyncClient, url: str, model: str, counter, stop: asyncio.Event,
                   statuses: list[int]) -> None:
    while not stop.is_set():
        i = next(counter)
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 64,
                **HOSTILE[i % len(HOSTILE)](i)}
        statuses.append((await http.post(url + "/v1/chat/completions", json=body)).status_code)


async def _run(url: str, model: str, streams: int, hostile: int, max_tokens: int, counter) -> dict:
    stop, statuses = asyncio.Event(), []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=64)) as http:
        attackers = [asyncio.create_task(_hostile(http, url, model, counter, stop, statuses)) for _ in range(hostile)]
        await asyncio.sleep(0.5 if hostile else 0)  # the hostile compiles under way first
        gaps = await asyncio.gather(*(_stream_gaps(http, url, model, max_tokens, s) for s in range(streams)))
        stop.set()
        await asyncio.gather(*attackers)
    flat = sorted(g for row in gaps for g in row)
    return {"hostile_clients": hostile, "hostile_requests": len(statuses),
            "hostile_refused": sum(s == 400 for s in statuses), "gap_median_ms": 1000 * statistics.median(flat),
            "gap_p99_ms": 1000 * flat[min(len(flat) - 1, int(0.99 * len(flat)))], "gap_max_ms": 1000 * flat[-1]}


def run_stall(url: str, model: str, streams: int, hostile: int, max_tokens: int, repeats: int,
              progress=print) -> list[dict]:
    """Alone, then with `hostile` clients, `repeats` times interleaved (each row to `progress` as it ends)."""
    rows, counter = [], itertools.count(int(time.time()))  # a new spec every time, across runs and benches
    for _ in range(repeats):
        for h in (0, hostile):
            rows.append(asyncio.run(_run(url, model, streams, h, max_tokens, counter)))
            progress(json.dumps(rows[-1]))
    return rows


def add_stall(kinds) -> None:
    stall = add_command(kinds, "stall", "other streams' gaps while hostile grammars are compiled")
    stall.add_argument("--url", default=None, help="a running server (default: start `kstep serve --model MODEL`)")
    stall.add_argument("--model", default="default-ar")
    stall.add_argument("--streams", type=int, default=3, help="concurrent streaming requests measured")
    stall.add_argument("--hostile", type=int, default=5, help="concurrent clients sending hostile specs")
    stall.add_argument("--max-tokens", type=int, default=96)
    stall.add_argument("--repeats", type=int, default=3)
    stall.set_defaults(run=_main)


def _main(args) -> int:
    from contextlib import nullcontext

    from kstep.bench.server_process import running_server
    with (nullcontext((args.url, None)) if args.url else running_server(args.model, "--served-model-name", "bench")) \
            as (url, _):
        model = args.model if args.url else "bench"
        run_stall(url, model, args.streams, args.hostile, args.max_tokens, args.repeats,
                  lambda line: print(line, flush=True))
    return 0
