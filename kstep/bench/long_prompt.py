"""`kstep bench long-prompt`: a long prompt joining running streams (issue 45's chunked prefill). S
streaming requests run; once each has its first token, one request with an N-token prompt joins. Per
server setting of `--max-num-batched-tokens` (a chunk; 0: none, the whole prompt in one step, as
before chunking; with --step-tokens, that is the step budget and each chunk its
`--long-prefill-token-threshold`): the streams' gaps between chunks (median, p99, longest) and the long request's time
to its first token. Each setting is its own `kstep serve` of the same checkpoint, one after the
other, so every figure of a run is measured beside its baseline.

The load is plain asyncio + httpx (no torch here), so it takes no cores from the server's torch thread
beyond what the HTTP work costs."""
import asyncio
import json
import random
import statistics
import time

import httpx

from kstep.flags import add_command

NO_CHUNKS = 10 ** 9  # a budget no prompt reaches: one whole prefill


async def _stream(http: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event | None,
                  times: list[float]) -> None:
    """One streaming completion; the time of each chunk with text into `times`."""
    async with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
                if started is not None:
                    started.set()


async def _run(url: str, model: str, streams: int, prompt_tokens: int, vocab: int, tail_seconds: float) -> dict:
    rng = random.Random(0)
    long_prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=httpx.Limits(max_connections=64)) as http:
        started = [asyncio.Event() for _ in range(streams)]
        times: list[list[float]] = [[] for _ in range(streams)]
        runners = [asyncio.create_task(_stream(http, url, {"model": model, "prompt": [5 + s, 17, 29], "max_tokens": 2000,
                                                           "temperature": 0, "ignore_eos": True}, started[s], times[s]))
                   for s in range(streams)]
        await asyncio.gather(*(e.wait() for e in started))
        sent, first = time.perf_counter(), []
        await _stream(http, url, {"model": model, "prompt": long_prompt, "max_tokens": 4, "temperature": 0,
                                  "ignore_eos": True}, None, first)
        await asyncio.sleep(tail_seconds)  # the streams' steps after it, beside it
        for task in runners:
            task.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
    gaps = sorted(b - a for row in times for a, b in zip(row, row[1:]) if b > sent - 1.0)  # around its arrival
    return {"long_prompt_first_token_s": round(first[0] - sent, 3), "gap_median_ms": round(1000 * statistics.median(gaps), 1),
            "gap_p99_ms": round(1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 1),
            "gap_max_ms": round(1000 * gaps[-1], 1)}


def run_long_prompt(model: str, chunks: list[int], streams: int, prompt_tokens: int, serve_args: list[str],
                    tail_seconds: float = 3.0, progress=print, step_tokens: int | None = None) -> list[dict]:
    """`step_tokens`: the step budget (--max-num-batched-tokens), each chunk then its own
    --long-prefill-token-threshold; None: each chunk is the step budget."""
    from kstep.bench.server_process import running_server
    from kstep.bundled import resolve_model
    from kstep.weights import read_model_config
    vocab = read_model_config(resolve_model(model)).vocab_size
    rows = []
    for chunk in chunks:
        budget = ["--max-num-batched-tokens", str(chunk or NO_CHUNKS)] if step_tokens is None else \
            ["--max-num-batched-tokens", str(step_tokens), "--long-prefill-token-threshold", str(chunk or NO_CHUNKS)]
        with running_server(model, "--served-model-name", "bench", *budget, *serve_args) as (url, _):
            row = {"chunk": chunk or "none", "step_tokens": step_tokens or chunk or "none", "streams": streams,
                   "prompt_tokens": prompt_tokens,
                   **asyncio.run(_run(url, "bench", streams, prompt_tokens, vocab, tail_seconds))}
        progress(json.dumps(row))
        rows.append(row)
    return rows


def add_long_prompt(kinds) -> None:
    bench = add_command(kinds, "long-prompt", "running streams' gaps while a long prompt joins, per prefill chunk")
    bench.add_argument("--model", required=True, help="a checkpoint (e.g. a random qwen2.5-0.5b-shape one)")
    bench.add_argument("--chunks", default="256,0", help="--max-num-batched-tokens values to compare (0: none)")
    bench.add_argument("--step-tokens", type=int, default=None,
                       help="--max-num-batched-tokens for every run, each chunk then its --long-prefill-token-threshold "
                            "(default: each chunk is the step budget)")
    bench.add_argument("--streams", type=int, default=8)
    bench.add_argument("--prompt-tokens", type=int, default=4000)
    bench.add_argument("--dtype", default="float32")
    bench.add_argument("--out", default=None, help="write the rows as JSON here")
    bench.set_defaults(run=_main)


def _main(args) -> int:
    chunks = [int(c) for c in args.chunks.split(",")]
    if any(c < 0 for c in chunks) or args.streams <= 0 or args.prompt_tokens <= 0 or (args.step_tokens or 1) <= 0:
        raise ValueError(f"--chunks {args.chunks!r} must be >= 0, --streams, --prompt-tokens and --step-tokens "
                         "positive")
    rows = run_long_prompt(args.model, chunks, args.streams, args.prompt_tokens,
                           ["--dtype", args.dtype, "--max-batch-size", str(args.streams + 1)],
                           progress=lambda line: print(line, flush=True), step_tokens=args.step_tokens)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
