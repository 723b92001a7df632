"""`kstep bench compare`: diffusion against AR on this machine, against the cost model's floors.

For each output length N and each side (diffusion exact; diffusion dual cache + threshold; AR with
its KV cache), one request at a time on the same prompts, in one process, one after another:
end-to-end latency (median over prompts x repeats), forward passes, tokens per pass, tokens/s and
time to first streamed token (the first committed text). Every generation produces exactly N
tokens that are not end-of-sequence (`min_tokens` = N), so sides and lengths do the same work
whatever the models say (a fine-tuned model would otherwise fill the tail with end-of-sequence
tokens, which a diffusion model unmasks in few passes and AR must still emit one by one).

The cost model (kstep/bench/cost_model.py) turns this device's calibrated bandwidth and matmul
throughput into a floor per side and length; measured / floor says how far each side is from what
the hardware allows, and a profile of one generation per side says where the rest goes. The
crossover is the N where diffusion's latency drops below AR's: measured (interpolated between
measured lengths) and predicted from the floors, also for named accelerators (data-sheet figures,
bf16), clearly marked as predictions.
"""
import json
import math
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kstep.bench.cost_model import (
    ACCELERATORS,
    Device,
    PassCost,
    ar_cost,
    block_diffusion_cost,
    calibrate,
    diffusion_cost,
)
from kstep.bench.compare_report import plot
from kstep.bench.compare_sides import SIDES, Side
from kstep.bench.profiling import cpu_profile
from kstep.bench.uniform_cost import uniform_diffusion_cost
from kstep.llm import LLM, load
from kstep.params import AUTOREGRESSIVE, BLOCK_DIFFUSION, DIFFUSION, UNIFORM_DIFFUSION, GenerationParams
from kstep.runner.model_runner import execute_passes

GRID = [2 ** k for k in range(3, 13)]  # 8 .. 4096: where floors and crossovers are predicted




def default_sides(diffusion_kind: str) -> list[str]:
    """The sides that run on a diffusion model of this kind, and AR."""
    return [name for name, side in SIDES.items() if side.kind in (diffusion_kind, AUTOREGRESSIVE)]


def params_for(side: Side, n: int, block_length: int) -> GenerationParams:
    settings = dict(side.settings)
    if side.kind == DIFFUSION:
        settings["block_length"] = block = min(block_length, n)
        if "steps_per_token" in settings:  # K = N * fraction, rounded to whole passes per block
            blocks = n // block
            settings["steps"] = blocks * max(1, round(block * settings.pop("steps_per_token")))
    return GenerationParams(max_tokens=n, temperature=0.0, ignore_eos=True, min_tokens=n, **settings)


def timed_generation(llm: LLM, prompt_ids: list[int], params: GenerationParams) -> dict:
    """One request alone, stepped here so the first committed text can be timed."""
    runner = llm.runner
    start = time.perf_counter()
    decoder = llm.make_decoder([prompt_ids], llm.resolve(params))
    first, out = None, None
    while passes := decoder.next_passes():
        out = decoder.update(execute_passes(passes))
        if first is None and out.committed_lengths[0] > 0:
            runner.synchronize()
            first = time.perf_counter() - start
    runner.synchronize()
    seconds = time.perf_counter() - start
    # what one pass computes: a canvas (masked diffusion), a block (block diffusion), a token (AR)
    canvas = len(prompt_ids) + params.max_tokens if llm.kind == DIFFUSION else \
        llm.resolve(params).block_length if llm.kind == BLOCK_DIFFUSION else 1
    canvases = decoder.stats().get("positions_computed", decoder.nfe * canvas) / canvas  # draft self: > nfe
    return {"seconds": seconds, "ttft": first if first is not None else seconds, "nfe": decoder.nfe,
            "tokens": out.committed_lengths[0], "canvases_per_pass": canvases / max(1, decoder.nfe)}


def profile_generation(llm: LLM, prompt_ids: list[int], params: GenerationParams) -> dict:
    """Where one generation's time goes: attention, LM head, the rest of the model's matmuls and
    ops, the decoder's sampling/unmasking, and what is left (Python and framework overhead)."""
    labels = {"attention": "kstep.attention", "lm_head": "kstep.lm_head", "forward": "kstep.forward",
              "sampling_unmasking": "kstep.update"}
    runner = llm.runner
    with cpu_profile() as prof:
        start = time.perf_counter()
        decoder = llm.make_decoder([prompt_ids], llm.resolve(params))
        while passes := decoder.next_passes():
            with torch.profiler.record_function("kstep.forward"):
                logits = execute_passes(passes)
                runner.synchronize()
            with torch.profiler.record_function("kstep.update"):
                decoder.update(logits)
        wall = time.perf_counter() - start
    totals = {key: 0.0 for key in labels}
    for event in prof.key_averages():
        for key, label in labels.items():
            if event.key == label:
                totals[key] += event.cpu_time_total / 1e6
    forward = totals.pop("forward")
    shares = {"attention": totals["attention"], "lm_head": totals["lm_head"],
              "other_model_ops": max(0.0, forward - totals["attention"] - totals["lm_head"]),
              "sampling_unmasking": totals["sampling_unmasking"]}
    shares["overhead"] = max(0.0, wall - forward - totals["sampling_unmasking"])
    return {"wall_seconds": wall, **{k: v / wall for k, v in shares.items()}}


def floor_cost(llm: LLM, side: Side, prompt_len: int, n: int, passes: float, block_length: int,
               dtype_bytes: int, canvases_per_pass: float = 1.0) -> PassCost:
    if not side.is_diffusion:
        return ar_cost(llm.cfg, prompt_len, n, dtype_bytes)
    if side.kind == UNIFORM_DIFFUSION:
        return uniform_diffusion_cost(llm.cfg, prompt_len, n, passes, dtype_bytes)
    params = llm.resolve(params_for(side, n, block_length))
    if side.kind == BLOCK_DIFFUSION:
        return block_diffusion_cost(llm.cfg, prompt_len, n, passes, min(params.block_length, n), dtype_bytes,
                                    canvases_per_pass)
    return diffusion_cost(llm.cfg, prompt_len, n, passes, min(params.block_length, n), params.cache, dtype_bytes,
                          canvases_per_pass)


def interpolate_crossover(ns: list[float], ratio: list[float]) -> float | None:
    """First N where diffusion/AR latency drops below 1, log-log interpolated between points."""
    if ratio and ratio[0] < 1:
        return ns[0]
    for (n0, r0), (n1, r1) in zip(zip(ns, ratio), zip(ns[1:], ratio[1:])):
        if r0 >= 1 > r1:
            a, b = math.log(r0), math.log(r1)
            return math.exp(math.log(n0) + (math.log(n1) - math.log(n0)) * a / (a - b))
    return None


def passes_at(n: int, measured: dict[int, float]) -> float:
    """K for a diffusion side at length N: measured K/N, interpolated in log N, held flat outside."""
    points = sorted(measured.items())
    if n <= points[0][0]:
        return points[0][1] / points[0][0] * n
    if n >= points[-1][0]:
        return points[-1][1] / points[-1][0] * n
    for (n0, k0), (n1, k1) in zip(points, points[1:]):
        if n0 <= n <= n1:
            w = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return ((1 - w) * k0 / n0 + w * k1 / n1) * n
    return float(n)


def run_compare(diffusion_model: str, ar_model: str, prompts: list[str], lengths: list[int], sides: list[str],
                repeats: int, block_length: int, device: str, dtype: str, out: Path,
                calibration: Device | None = None) -> dict:
    models = {True: load(diffusion_model, device, dtype), False: load(ar_model, device, dtype)}
    dtype_bytes = torch.tensor([], dtype=models[True].runner.dtype).element_size()
    here = calibration or calibrate(device, models[True].runner.dtype)
    chosen = [SIDES[s] for s in sides]
    encoded = {flag: [llm.encode_prompt(p) for p in prompts] for flag, llm in models.items()}
    for flag, llm in models.items():  # warm-up: first-call allocations are not the model's cost
        timed_generation(llm, encoded[flag][0], params_for(chosen[0] if chosen[0].is_diffusion == flag
                                                            else SIDES["ar"], 8, block_length))
    rows = []
    cells = [(n, side) for n in lengths for side in chosen]
    bar = tqdm(cells, desc="bench compare", unit="cell")
    for n, side in bar:
        llm = models[side.is_diffusion]
        runs = [timed_generation(llm, ids, params_for(side, n, block_length))
                for ids in encoded[side.is_diffusion] for _ in range(repeats)]
        prompt_len = round(statistics.mean(len(ids) for ids in encoded[side.is_diffusion]))
        nfe = statistics.mean(r["nfe"] for r in runs)
        canvases = statistics.mean(r["canvases_per_pass"] for r in runs)
        seconds = statistics.median(r["seconds"] for r in runs)
        cost = floor_cost(llm, side, prompt_len, n, nfe, block_length, dtype_bytes, canvases)
        floor = cost.floor_seconds(here)
        rows.append({"side": side.name, "n": n, "seconds": seconds, "ttft_seconds": statistics.median(
            r["ttft"] for r in runs), "nfe": nfe, "tokens_per_pass": n / nfe, "tokens_per_s": n / seconds,
            "floor_seconds": floor, "measured_over_floor": seconds / floor, "prompt_tokens": prompt_len,
            "samples": len(runs), "canvases_per_pass": canvases})
        # the last cell on the progress bar only: the table, with its header, is printed once at the end
        bar.set_postfix_str(f"{side.name} N={n}: {seconds:.3f} s, {nfe:.1f} passes")
    profiles = {}
    n_profile = min(64, max(lengths))
    for side in chosen:
        llm = models[side.is_diffusion]
        profiles[side.name] = {"n": n_profile, **profile_generation(llm, encoded[side.is_diffusion][0],
                                                                     params_for(side, n_profile, block_length))}
    result = {"diffusion_model": diffusion_model, "ar_model": ar_model, "device": device, "dtype": dtype,
              "calibration": {"name": here.name, "bandwidth_gb_s": here.bandwidth_gb_s,
                              "matmul_tflops": here.matmul_tflops, "source": here.source},
              "prompts": len(prompts), "repeats": repeats, "block_length": block_length, "rows": rows,
              "profiles": profiles}
    result["predictions"] = predict(models, chosen, rows, block_length, here, dtype_bytes)
    result["crossover"] = crossovers(rows, result["predictions"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "compare.png")
    return result


def predict(models: dict, sides: list[Side], rows: list[dict], block_length: int, here: Device,
            dtype_bytes: int) -> dict:
    """Floors over GRID for each side: on this device (measured calibration, this dtype) and on each
    named accelerator (data sheet, bf16)."""
    devices = {"here": (here, dtype_bytes), **{key: (d, 2) for key, d in ACCELERATORS.items()}}
    out = {}
    for key, (device, nbytes) in devices.items():
        per_side = {}
        for side in sides:
            measured = {r["n"]: r["nfe"] for r in rows if r["side"] == side.name}
            canvases = {r["n"]: r["canvases_per_pass"] for r in rows if r["side"] == side.name}
            prompt_len = next(r["prompt_tokens"] for r in rows if r["side"] == side.name)
            llm = models[side.is_diffusion]
            per_side[side.name] = [floor_cost(llm, side, prompt_len, n, passes_at(n, measured), block_length,
                                              nbytes, passes_at(n, {m: c * m for m, c in canvases.items()}) / n
                                              ).floor_seconds(device) for n in GRID]
        out[key] = {"device": device.name, "source": device.source, "n": GRID, "floor_seconds": per_side}
    return out


def crossovers(rows: list[dict], predictions: dict) -> dict:
    """Per diffusion side: the measured crossover with AR, and the predicted one per device."""
    result = {}
    ar = {r["n"]: r["seconds"] for r in rows if r["side"] == "ar"}
    for name in {r["side"] for r in rows if r["side"] != "ar"}:
        mine = {r["n"]: r["seconds"] for r in rows if r["side"] == name}
        ns = sorted(set(mine) & set(ar))
        entry = {"measured_n": interpolate_crossover(ns, [mine[n] / ar[n] for n in ns]) if ar else None,
                 "measured_lengths": ns, "measured_faster_at": [n for n in ns if mine[n] < ar[n]]}
        for key, p in predictions.items():
            floors = p["floor_seconds"]
            if "ar" in floors:
                ratios = [d / a for d, a in zip(floors[name], floors["ar"])]
                entry[f"predicted_n_{key}"] = interpolate_crossover(p["n"], ratios)
                entry[f"predicted_faster_at_{key}"] = [n for n, r in zip(p["n"], ratios) if r < 1]
        result[name] = entry
    return result
