"""`kstep bench serve --sweep 1,4,16,64,256`: one `kstep serve`, loaded at each concurrency in turn
(C clients sending back to back for the duration, as `kstep bench serve` does). Per concurrency:
requests, failures, output tokens/s, time to first token and per-request inter-token time (p50, p99),
the server's peak RSS during that load (VmHWM, reset before each), and preemptions (/metrics).

The load is plain asyncio + httpx (no torch here)."""
import asyncio
import json
import re
import time
from pathlib import Path

import httpx

from kstep.bench.serve import Sample, run_load, summarize


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:  # "5": the peak RSS starts again from now
        f.write("5")


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _preemptions(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(r"^kstep_preemptions_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M))


def _inter_token(samples: list[Sample]) -> list[float]:
    """Per streamed request: its mean time between tokens after the first."""
    return sorted((s.seconds - s.ttft) / (s.completion_tokens - 1) for s in samples
                  if s.status == 200 and s.ttft is not None and s.completion_tokens > 1)


def run_sweep(model: str, concurrencies: list[int], duration: float, max_tokens: int, prompts: list[str],
              settings: dict, serve_args: list[str], out: Path, progress=print) -> list[dict]:
    from kstep.bench.server_process import running_server
    rows = []
    settings = {"max_tokens": max_tokens, **settings}
    with running_server(model, "--served-model-name", "bench", *serve_args) as (url, proc):
        for concurrency in concurrencies:
            _reset_peak(proc.pid)
            before = _preemptions(url)
            start = time.perf_counter()
            samples, seconds = asyncio.run(run_load(url, "bench", prompts, concurrency, duration, settings))
            itl = _inter_token(samples)
            row = {"concurrency": concurrency, **summarize(samples, seconds),
                   "status_5xx": sum(s.status >= 500 for s in samples),
                   "itl_p50_s": itl[len(itl) // 2] if itl else None,
                   "itl_p99_s": itl[min(len(itl) - 1, int(0.99 * len(itl)))] if itl else None,
                   "server_peak_rss_bytes": peak_rss(proc.pid), "preemptions": _preemptions(url) - before,
                   "wall_s": time.perf_counter() - start}
            progress(format_row(row))
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serve_sweep.json").write_text(json.dumps(rows, indent=1))
    return rows


def format_row(r: dict) -> str:
    fmt = lambda v, scale=1.0: "-" if v is None else f"{v * scale:.0f}"  # noqa: E731
    return (f"| {r['concurrency']} | {r['requests']} | {r['failed']} | {r['output_tokens_per_s']:.1f} | "
            f"{fmt(r['ttft_p50_s'], 1000)} | {fmt(r['ttft_p99_s'], 1000)} | {fmt(r['itl_p50_s'], 1000)} | "
            f"{fmt(r['itl_p99_s'], 1000)} | {r['server_peak_rss_bytes'] / 2**20:.0f} | {r['preemptions']:.0f} |")


def format_table(rows: list[dict]) -> str:
    return "\n".join(["| clients | requests | failed | output tokens/s | TTFT p50 ms | TTFT p99 ms | inter-token "
                      "p50 ms | inter-token p99 ms | peak RSS MiB | preemptions |",
                      "|---|---|---|---|---|---|---|---|---|---|", *map(format_row, rows)])
