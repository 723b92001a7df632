"""`kstep bench serve`: C concurrent streaming clients for T seconds against a kstep server, with
continuous batching and with `--max-batch-size 1`, and the ratio.

The load generator is plain asyncio + httpx (no torch in this process's hot path), so it does not
compete with the server's torch threads for the cores. Each server is started here as a
subprocess (or one is given with --url) and measured one at a time.
"""
import asyncio
import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kstep.bench.server_process import running_server


@dataclass(slots=True)
class Sample:
    status: int
    seconds: float
    ttft: float | None
    completion_tokens: int
    nfe: int


async def _one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str, settings: dict) -> Sample:
    start = time.perf_counter()
    ttft, usage = None, {}
    body = {"model": model, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            **settings}
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Sample(r.status_code, time.perf_counter() - start, None, 0, 0)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(500, time.perf_counter() - start, ttft, 0, 0)
                if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
                usage = chunk.get("usage") or usage
    except httpx.HTTPError:
        return Sample(0, time.perf_counter() - start, ttft, 0, 0)
    return Sample(200, time.perf_counter() - start, ttft, usage.get("completion_tokens", 0), usage.get("nfe", 0))


async def run_load(url: str, model: str, prompts: list[str], concurrency: int, duration: float,
                   settings: dict) -> tuple[list[Sample], float]:
    """Each client sends requests back to back until `duration` has passed; requests in flight at
    the deadline finish and count. Returns the samples and the wall time until the last one."""
    deadline = time.perf_counter() + duration
    samples: list[Sample] = []
    counter = iter(range(10**9))
    start = time.perf_counter()

    async def client():
        while time.perf_counter() < deadline:
            samples.append(await _one_request(http, url, model, prompts[next(counter) % len(prompts)], settings))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


def summarize(samples: list[Sample], seconds: float) -> dict:
    ok = [s for s in samples if s.status == 200]
    latencies = sorted(s.seconds for s in ok)
    ttfts = sorted(s.ttft for s in ok if s.ttft is not None)

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else None
    tokens = sum(s.completion_tokens for s in ok)
    return {"requests": len(samples), "failed": len(samples) - len(ok), "seconds": seconds,
            "requests_per_s": len(ok) / seconds, "output_tokens_per_s": tokens / seconds,
            "latency_p50_s": pct(latencies, 0.5), "latency_p99_s": pct(latencies, 0.99),
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
            "mean_completion_tokens": statistics.mean(s.completion_tokens for s in ok) if ok else 0,
            "mean_nfe": statistics.mean(s.nfe for s in ok) if ok else 0}


@contextmanager
def server(model: str, max_batch_size: int, threads: int | None, extra: list[str]):
    args = ["--max-batch-size", str(max_batch_size), "--served-model-name", "bench", *extra]
    if threads is not None:
        args += ["--threads", str(threads)]
    with running_server(model, *args) as (url, _):
        yield url


def shared_prefix_text(model: str, num_tokens: int, source: list[str]) -> str:
    """About `num_tokens` tokens of held-out code, to put in front of every prompt."""
    from kstep.bundled import resolve_model
    from kstep.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(resolve_model(model))
    text = ""
    for chunk in source * 100:
        if len(tokenizer.encode(text, add_special_tokens=False)) >= num_tokens:
            break
        text += chunk + "\n"
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def run_bench(model: str, concurrency: int, duration: float, max_tokens: int, prompts: list[str],
              settings: dict, threads: int | None, url: str | None, out: Path, progress=print,
              shared_prefix_tokens: int = 0, replicas: int | None = None) -> dict:
    """Batched vs `--max-batch-size 1`; with shared_prefix_tokens, every prompt starts with the same
    text and the runs are prefix cache on vs off (both batched); with replicas, one Ray Serve replica
    vs that many (both batched, each replica `threads` CPUs)."""
    settings = {"max_tokens": max_tokens, **settings}
    runs = {}
    if shared_prefix_tokens:
        prefix = shared_prefix_text(model, shared_prefix_tokens, prompts)
        prompts = [prefix + p for p in prompts]
        configs = [("prefix cache", concurrency, []), ("no prefix cache", concurrency, ["--prefix-cache-mib", "0"])]
    elif replicas:
        per_replica = ["--cpus-per-replica", str(threads or 1)]
        configs = [("1 replica", concurrency, ["--replicas", "1", *per_replica]),
                   (f"{replicas} replicas", concurrency, ["--replicas", str(replicas), *per_replica])]
    else:
        configs = [("batched", concurrency, []), ("unbatched", 1, [])]
    if url:
        configs = [("given", None, [])]
    for name, batch, extra in configs:
        progress(f"bench serve: {name} (max batch {batch or '?'}), {concurrency} clients for {duration:.0f} s ...")
        if url:
            samples, seconds = asyncio.run(run_load(url, _served_name(url), prompts, concurrency, duration, settings))
        else:
            with server(model, batch, threads, extra) as base:
                samples, seconds = asyncio.run(run_load(base, "bench", prompts, concurrency, duration, settings))
        runs[name] = {"max_batch_size": batch, **summarize(samples, seconds)}
        progress(format_row(name, runs[name]))
    result = {"model": model, "concurrency": concurrency, "duration_s": duration, "settings": settings,
              "threads": threads, "shared_prefix_tokens": shared_prefix_tokens, "replicas": replicas, "runs": runs}
    if "batched" in runs and runs["unbatched"]["output_tokens_per_s"] > 0:
        result["throughput_ratio"] = runs["batched"]["output_tokens_per_s"] / runs["unbatched"]["output_tokens_per_s"]
    if replicas and runs["1 replica"]["output_tokens_per_s"] > 0:
        result["replica_ratio"] = runs[f"{replicas} replicas"]["output_tokens_per_s"] / runs["1 replica"][
            "output_tokens_per_s"]
    if "prefix cache" in runs and runs["prefix cache"]["ttft_p50_s"]:
        result["ttft_ratio_without_over_with_cache"] = runs["no prefix cache"]["ttft_p50_s"] / runs["prefix cache"][
            "ttft_p50_s"]
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_serve_prefix.json" if shared_prefix_tokens else \
        "bench_serve_replicas.json" if replicas else "bench_serve.json"
    (out / name).write_text(json.dumps(result, indent=2))
    return result


def run_budget_bench(model: str, concurrency: int, duration: float, max_tokens: int, prompts: list[str],
                     settings: dict, threads: int | None, fractions: list[float], out: Path, progress=print) -> dict:
    """Time budgets under load: one batched server; first the default decoding (its median latency at
    this load is the reference), then each fraction of it as every request's `time_budget`: the share
    of requests answered within budget, those refused (429: infeasible at the current load), tokens
    and passes per request."""
    settings = {"max_tokens": max_tokens, "min_tokens": max_tokens, **settings}
    runs: dict[str, dict] = {}
    batch = 16
    with server(model, batch, threads, []) as base:
        samples, seconds = asyncio.run(run_load(base, "bench", prompts, concurrency, duration, settings))
        runs["no budget"] = {"budget_s": None, "max_batch_size": batch, **summarize(samples, seconds)}
        progress(format_row("no budget", runs["no budget"]))
        reference = runs["no budget"]["latency_p50_s"]
        for fraction in fractions:
            budget = fraction * reference
            samples, seconds = asyncio.run(run_load(base, "bench", prompts, concurrency, duration,
                                                    {**settings, "time_budget": budget}))
            answered = [s for s in samples if s.status == 200]
            name = f"{fraction:.0%} of the default's p50"
            runs[name] = {"budget_s": budget, "max_batch_size": batch, **summarize(samples, seconds),
                          "refused_429": sum(s.status == 429 for s in samples),
                          "within_budget": sum(s.seconds <= budget for s in answered) / max(1, len(answered))}
            progress(format_row(name, runs[name]) + f" within budget {runs[name]['within_budget']:.0%}")
    result = {"model": model, "concurrency": concurrency, "duration_s": duration, "settings": settings,
              "threads": threads, "reference_latency_s": reference, "runs": runs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serve_budget.json").write_text(json.dumps(result, indent=2))
    return result


def format_budget_table(result: dict) -> str:
    lines = [f"{result['model']}: {result['concurrency']} clients, {result['settings']['max_tokens']} tokens, "
             f"the default's p50 latency {result['reference_latency_s']:.3f} s",
             "| budget | budget s | answered | within budget | refused (429) | tokens | passes | output tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["runs"].items():
        within = "-" if r["budget_s"] is None else f"{r['within_budget']:.0%}"
        budget = "-" if r["budget_s"] is None else f"{r['budget_s']:.3f}"
        lines.append(f"| {name} | {budget} | {r['requests'] - r['failed']} | {within} | {r.get('refused_429', 0)} | "
                     f"{r['mean_completion_tokens']:.1f} | {r['mean_nfe']:.1f} | {r['output_tokens_per_s']:.1f} |")
    return "\n".join(lines)


def _served_name(url: str) -> str:
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def format_row(name: str, r: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return (f"| {name} | {r['max_batch_size'] or '-'} | {r['requests']} | {r['failed']} | {r['requests_per_s']:.2f} | "
            f"{r['output_tokens_per_s']:.1f} | {fmt(r['latency_p50_s'])} | {fmt(r['latency_p99_s'])} | "
            f"{fmt(r['ttft_p50_s'])} | {fmt(r['ttft_p99_s'])} |")


def format_table(result: dict) -> str:
    lines = ["| server | max batch | requests | failed | requests/s | output tokens/s | latency p50 s | "
             "latency p99 s | TTFT p50 s | TTFT p99 s |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [format_row(name, r) for name, r in result["runs"].items()]
    if "throughput_ratio" in result:
        lines.append(f"\nbatched / unbatched output tokens/s: {result['throughput_ratio']:.2f}x")
    if "replica_ratio" in result:
        lines.append(f"\n{result['replicas']} replicas / 1 replica output tokens/s: {result['replica_ratio']:.2f}x")
    if "ttft_ratio_without_over_with_cache" in result:
        lines.append(f"\ntime to first token p50, without / with the prefix cache "
                     f"({result['shared_prefix_tokens']}-token shared prefix): "
                     f"{result['ttft_ratio_without_over_with_cache']:.2f}x")
    return "\n".join(lines)

