"""`kstep bench quant`: what weight-only quantization buys and costs on each bundled model, in one
run: weight memory, time per forward pass (a 64-token generation / its passes), and the held-out
NLL change (the diffusion model's ELBO bound with fixed Monte-Carlo draws)."""
import json
import statistics
import time
from pathlib import Path

import torch

from kstep.eval.prompts import held_out_code_prompts
from kstep.bundled import resolve_model
from kstep.layers.quantized import model_bytes
from kstep.llm import load
from kstep.train.report import held_out_nll_of, held_out_windows


def seconds_per_pass(llm, prompt: str, n: int, repeats: int) -> float:
    llm.generate(prompt, max_tokens=8, ignore_eos=True)  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = llm.generate(prompt, max_tokens=n, ignore_eos=True)[0]
        runs.append((time.perf_counter() - start) / result.nfe)
    return statistics.median(runs)


def run_quant(models: list[str], modes: list[str | None], windows: int, seq_len: int, mc_samples: int,
              n: int, repeats: int, out: Path, progress=print) -> list[dict]:
    prompt = held_out_code_prompts(1)[0]
    rows = []
    for model in models:
        batch = held_out_windows(resolve_model(model), seq_len, windows)
        base = None
        for mode in modes:
            llm = load(model, quantize=mode)
            with torch.inference_mode():
                row = {"model": model, "quantize": mode or "none", "weight_mib": model_bytes(llm.model) / 2**20,
                       "seconds_per_pass": seconds_per_pass(llm, prompt, n, repeats),
                       "held_out_nll": held_out_nll_of(llm, batch, mc_samples)}
            base = base or row
            row["memory_ratio"] = row["weight_mib"] / base["weight_mib"]
            row["time_ratio"] = row["seconds_per_pass"] / base["seconds_per_pass"]
            row["nll_change"] = row["held_out_nll"] - base["held_out_nll"]
            rows.append(row)
            progress(format_row(row))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_quant.json").write_text(json.dumps({"windows": windows, "seq_len": seq_len, "n": n,
                                                      "rows": rows}, indent=2))
    return rows


def format_row(r: dict) -> str:
    return (f"| {r['model']} | {r['quantize']} | {r['weight_mib']:.1f} ({r['memory_ratio']:.2f}x) | "
            f"{r['seconds_per_pass'] * 1000:.2f} ({r['time_ratio']:.2f}x) | {r['held_out_nll']:.3f} "
            f"({r['nll_change']:+.3f}) |")


def format_table(rows: list[dict]) -> str:
    head = ["| model | quantize | weight MiB (vs none) | ms per pass (vs none) | held-out NLL (change) |",
            "|---|---|---|---|---|"]
    return "\n".join(head + [format_row(r) for r in rows])
