"""`kstep bench tp`: one model at a published shape on one rank and on N ranks, on the same cores,
in one run: the AR decode step and a 32-token block pass whose every position is read, with its
logits gathered or its top tokens merged (all against `context` cached positions), what share of
the pass rank 0 spends in collectives, and each rank's memory (its parameters, and each process's
resident and peak resident memory as the kernel counts them).

One rank runs all the cores' threads, then one thread (the work one rank of N does, at N times the
weights); N ranks run one thread each (what -tp N does on a CPU), so the comparison is the same
machine split two ways. Random weights: the time does not depend on
them."""
import os
import statistics
import time
from pathlib import Path

import torch

import kstep
from kstep.random_checkpoint import write_random_checkpoint
from kstep.runner.top_tokens import TopRequest

GIB = 1024 ** 3
# (name, tokens, positions with outputs, top tokens instead of logits): the AR step; a block of 32
# whose every position is read (a diffusion pass), its logits gathered to rank 0, or its top tokens
# (the statistics of each rank's vocabulary slice: a greedy decoder's ask)
PASSES = (("decode_step", 1, 1, True), ("block_pass_32", 32, 32, False), ("block_top_32", 32, 32, True))


def checkpoint(root: Path, family: str, shape: str, dtype: torch.dtype) -> Path:
    """The shape's random checkpoint under root (written once, reused)."""
    path = root / f"{family}-{shape}-{str(dtype).removeprefix('torch.')}"
    if not (path / "config.json").is_file():
        write_random_checkpoint(path, family=family, shape=shape, dtype=dtype)
    return path


def process_memory(pid: int | str = "self") -> tuple[int, int]:
    """(resident, peak resident) bytes of a process (Linux /proc)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def _timed(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(path: Path, dtype: torch.dtype, size: int, context: int, repeats: int, threads: int = 0) -> dict:
    """One rank count's figures for the checkpoint at `path` (one rank: `threads`, default every core)."""
    if size == 1:
        torch.set_num_threads(threads or os.cpu_count() or 1)
    llm = kstep.load(path, dtype=dtype, tensor_parallel_size=size)
    runner = llm.runner
    try:
        vocab = llm.cfg.vocab_size
        ids = torch.randint(0, vocab, (1, context + 32), generator=torch.Generator().manual_seed(0))
        kv = runner.allocate_kv(1, context + 32)
        runner.logits(runner.causal_pass(ids[:, :context], torch.arange(context)[None], None, 0, kv))

        def run(tokens: int, outputs: int, top: bool):
            positions = torch.arange(context, context + tokens)[None]

            def forward():
                p = runner.causal_pass(ids[:, context:context + tokens], positions, None, context, kv)
                p.logits_from, p.top = tokens - outputs, TopRequest() if top else None
                return runner.execute([p])
            return forward
        group = getattr(runner, "group", None)
        row = {"ranks": size, "threads_per_rank": torch.get_num_threads()}
        for name, tokens, outputs, top in PASSES:
            before = sum(group.seconds.values()) if group else 0.0
            seconds = _timed(run(tokens, outputs, top), repeats)
            waited = (sum(group.seconds.values()) - before) / (repeats + 1) if group else 0.0
            row[f"{name}_ms"] = round(seconds * 1e3, 2)
            row[f"{name}_collective_share"] = round(waited / seconds, 3) if group else 0.0
        pids = ["self"] + [c.process.pid for c in getattr(runner, "channels", []) if hasattr(c, "process")]
        memory = [process_memory(pid) for pid in pids]
        row["rank0_param_gib"] = round(sum(p.numel() * p.element_size() for p in llm.model.parameters()) / GIB, 3)
        row["rss_gib"] = [round(m[0] / GIB, 2) for m in memory]
        row["peak_rss_gib"] = [round(m[1] / GIB, 2) for m in memory]
        return row
    finally:
        if size > 1:
            runner.close()


def format_table(rows: list[dict]) -> str:
    lines = ["| model | ranks | decode step ms (in collectives) | block of 32, logits, ms (in collectives) | "
             "block of 32, top tokens, ms (in collectives) | rank 0 weights GiB | resident GiB per process (peak) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = " | ".join(f"{r[f'{name}_ms']} ({r[f'{name}_collective_share']:.0%})" for name, *_ in PASSES)
        lines.append(f"| {r['model']} | {r['ranks']} x {r['threads_per_rank']} thread(s) | {cells} | "
                     f"{r['rank0_param_gib']} | "
                     + ", ".join(f"{a} ({b})" for a, b in zip(r["rss_gib"], r["peak_rss_gib"])) + " |")
    return "\n".join(lines)


def measure_alone(path: Path, dtype: torch.dtype, size: int, context: int, repeats: int, threads: int = 0) -> dict:
    """`measure` in a process of its own: each run's peak memory is its own, not the last one's."""
    import json
    import subprocess
    import sys
    code = ("import json, sys, torch; from pathlib import Path; from kstep.bench.tp import measure\n"
            "if __name__ == '__main__':\n"
            f"    print(json.dumps(measure(Path({str(path)!r}), torch.{str(dtype).removeprefix('torch.')}, "
            f"{size}, {context}, {repeats}, {threads})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"bench tp at {size} rank(s) failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
