"""`kstep bench decode`: speed and memory of each diffusion decoding mode against the exact sampler,
measured in the same run, on the bundled model and on a ~100M-parameter random LLaDA-layout model.

Each cell runs in a fresh subprocess, one at a time. A fixed-schedule cell whose full run would
exceed `--max-cell-seconds` is extrapolated from a probe with two steps per block: a pass's cost
depends only on the shapes it runs (canvas, window, block), never on the tokens, so
time = (full passes' time) + (window passes' time) x (steps per block - 1), or for the exact
sampler (per full pass) x steps, from a probe with one step per block. Such cells are marked
`extrapolated`; the per-step work outside the passes (sampling, unmasking) is added at the probe's
rate. With `--no-extrapolate` every cell runs in full.

A block-diffusion model (Fast-dLLM v2, SDAR layouts) has its own modes, on its own block size: `exact`
(one token per pass and the references' commit pass per block), `threshold` (the checkpoint's default
decoding: its generation_config.json threshold and sub-block, else 0.9; fused commits) and
`threshold+commit-pass` (the same with the references' separate commit). Every cell
produces N tokens (`min_tokens` = N), so the modes' speeds compare the same work. Its passes are one
block each against an exact cache, cheap enough to run every cell in full.
"""
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kstep.bundled import resolve_model
from kstep.models import ModelConfig, Transformer
from kstep.weights import save_checkpoint


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    cache: str
    threshold: float | None = None
    early_stop: bool = False
    drafts: int = 0  # draft self: the exact sampler's tokens, this many steps drafted per pass


MODES = {"exact": Mode("exact", "none"), "exact+self": Mode("exact+self", "none", drafts=4),
         "prefix": Mode("prefix", "prefix"), "dual": Mode("dual", "dual"),
         "dual+threshold": Mode("dual+threshold", "dual", 0.9, early_stop=True)}
# Block diffusion: the settings each mode passes on top of max_tokens = min_tokens = N.
BLOCK_MODES = {"exact": {"exact": True}, "exact+self": {"draft": "self", "num_draft_tokens": 4}, "threshold": {},
               "threshold+commit-pass": {"fused_commit": False}}

LARGE_CONFIG = dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, ffn_dim=2048, vocab_size=16384)


def large_random_model(cache_dir: Path) -> Path:
    """A ~110M-parameter LLaDA-layout checkpoint of random weights, written once into cache_dir."""
    path = cache_dir / "bench-llada-110m"
    if (path / "model.safetensors").is_file():
        return path
    c = LARGE_CONFIG
    cfg = ModelConfig(family="llada", attention="bidirectional", vocab_size=c["vocab_size"], embedding_size=c["vocab_size"],
                      d_model=c["d_model"], n_layers=c["n_layers"], n_heads=c["n_heads"], n_kv_heads=c["n_kv_heads"],
                      head_dim=c["head_dim"], ffn_dim=c["ffn_dim"], norm_eps=1e-5, rope_theta=10000.0,
                      max_positions=4096, mask_token_id=c["vocab_size"] - 1, pad_token_id=0,
                      eos_token_ids=(c["vocab_size"] - 2,))
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, 0.0, 0.02) if p.dim() == 2 else torch.nn.init.ones_(p)
    save_checkpoint(model, path, dtype=torch.bfloat16)
    return path


def default_prompt_ids(model: Path) -> list[int]:
    """A held-out stdlib function's signature + docstring for a trained model; fixed ids otherwise."""
    import kstep
    llm = kstep.load(model)
    split = model / "data_split.json"
    if llm.tokenizer is not None and split.is_file():
        from kstep.train import data
        from kstep.train.corpus import function_examples
        held_out = set(json.loads(split.read_text())["held_out"])
        files = [f for f in data.corpus_files("stdlib") if f.rel in held_out]
        example = next(e for e in function_examples(files) if 80 < len(e.prompt) < 400)
        return llm.encode_prompt(example.prompt)
    return [(7 * i + 3) % (llm.cfg.vocab_size - 8) + 1 for i in range(32)]


def run_worker(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "kstep.bench.decode_worker", json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench cell failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def is_block_model(model: Path) -> bool:
    from kstep.registry import BLOCK_DIFFUSION, FAMILIES
    from kstep.weights import read_model_config
    return FAMILIES[read_model_config(model).family].kind == BLOCK_DIFFUSION


def measure_block(model: Path, label: str, n: int, mode: str, prompt_ids: list[int], device: str, dtype: str,
                  threads: int | None) -> dict:
    settings = dict(max_tokens=n, min_tokens=n, **BLOCK_MODES[mode])
    result = run_worker(dict(model=str(model), device=device, dtype=dtype, prompt_ids=prompt_ids, settings=settings,
                             threads=threads, warmup=dict(settings, max_tokens=8, min_tokens=0)))
    return dict(model=label, n=n, block_length=None, mode=mode, cache="block", threshold=result["threshold"],
                early_stop=True, extrapolated=False, seconds=result["seconds"], nfe=result["nfe"],
                peak_bytes=result["peak_bytes"], model_bytes=result["model_bytes"], tokens_per_s=n / result["seconds"],
                completion_tokens=result["completion_tokens"])


def measure(model: Path, label: str, n: int, block: int, mode: Mode, prompt_ids: list[int], device: str,
            dtype: str, max_cell_seconds: float, extrapolate: bool, threads: int | None) -> dict:
    steps = n  # the fixed schedule at one token per pass: what the issue's targets are measured against
    settings = dict(max_tokens=n, block_length=block, steps=steps, cache=mode.cache, threshold=mode.threshold,
                    early_stop=mode.early_stop, **({"draft": "self", "num_draft_tokens": mode.drafts} if mode.drafts
                                                   else {}))
    warmup = dict(max_tokens=block, block_length=block, steps=block, cache=mode.cache)
    spec = dict(model=str(model), device=device, dtype=dtype, prompt_ids=prompt_ids, settings=settings,
                threads=threads, warmup=warmup)
    row = dict(model=label, n=n, block_length=block, mode=mode.name, cache=mode.cache, threshold=mode.threshold,
               early_stop=mode.early_stop, extrapolated=False)
    if extrapolate and mode.threshold is None and not mode.drafts:
        # Without a cache every pass is the same full pass: one per block measures it.
        probe_steps = (1 if mode.cache == "none" else 2) * (n // block)
        probe = run_worker({**spec, "settings": {**settings, "steps": probe_steps}})
        t = probe["timings"]
        per_block = block  # steps per block in the real run
        pass_seconds = t["full_pass_seconds"] + t["window_pass_seconds"]
        per_step_rest = (probe["seconds"] - pass_seconds) / probe["nfe"]  # sampling, unmasking, syncs
        if mode.cache == "none":
            estimate = t["full_pass_seconds"] / t["num_full_passes"] * steps
        else:
            estimate = t["full_pass_seconds"] + t["window_pass_seconds"] * (per_block - 1)
        estimate += per_step_rest * steps
        if estimate > max_cell_seconds:
            return {**row, "seconds": estimate, "nfe": steps, "peak_bytes": probe["peak_bytes"],
                    "model_bytes": probe["model_bytes"], "extrapolated": True, "tokens_per_s": n / estimate}
    result = run_worker(spec)
    return {**row, "seconds": result["seconds"], "nfe": result["nfe"], "peak_bytes": result["peak_bytes"],
            "model_bytes": result["model_bytes"],
            "tokens_per_s": n / result["seconds"], "completion_tokens": result["completion_tokens"],
            "full_pass_seconds": result["timings"].get("full_pass_seconds"),
            "positions_computed": result["timings"].get("positions_computed"),
            "window_pass_seconds": result["timings"].get("window_pass_seconds")}


def run_bench(models: list[str], lengths: list[int], block: int, modes: list[str], device: str, dtype: str,
              out: Path, max_cell_seconds: float, extrapolate: bool, threads: int | None,
              include_large: bool) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    targets = [(name, resolve_model(name)) for name in models]
    if include_large:
        targets.append(("random-110M", large_random_model(Path(".kstep-cache"))))
    cells = [(label, path, n, m) for label, path in targets for n in lengths for m in modes]
    rows, prompts = [], {}
    for label, path, n, mode in tqdm(cells, desc="bench decode", unit="cell"):
        if label not in prompts:
            prompts[label] = default_prompt_ids(path)
        if is_block_model(path):
            if mode in BLOCK_MODES:
                rows.append(measure_block(path, label, n, mode, prompts[label], device, dtype, threads))
        # draft self needs real confidences to draft from: not on the random-weight model
        elif mode in MODES and not (MODES[mode].drafts and label == "random-110M"):
            rows.append(measure(path, label, n, block, MODES[mode], prompts[label], device, dtype, max_cell_seconds,
                                extrapolate, threads))
    for row in rows:
        exact = next(r for r in rows if r["model"] == row["model"] and r["n"] == row["n"] and r["mode"] == "exact")
        smallest = min((r for r in rows if r["model"] == row["model"] and r["mode"] == row["mode"]),
                       key=lambda r: r["n"])
        row["speedup_vs_exact"] = exact["seconds"] / row["seconds"]
        # Peak as an allocator reports it: the weights plus what the generation added at its peak.
        row["peak_total_bytes"] = row["model_bytes"] + row["peak_bytes"]
        row["peak_vs_smallest_n"] = row["peak_total_bytes"] / (smallest["model_bytes"] + smallest["peak_bytes"])
    (out / "bench_decode.json").write_text(json.dumps({"device": device, "dtype": dtype, "block_length": block,
                                                       "threads": threads or torch.get_num_threads(),
                                                       "rows": rows}, indent=2) + "\n")
    return rows


def held_out_prompts(model: Path, count: int) -> list[str]:
    """Signature + docstring prompts of held-out stdlib functions (the model's recorded split)."""
    from kstep.train import data
    from kstep.train.corpus import function_examples
    held_out = set(json.loads((model / "data_split.json").read_text())["held_out"])
    files = [f for f in data.corpus_files("stdlib") if f.rel in held_out]
    return [e.prompt for e in function_examples(files) if len(e.prompt) < 600][:count]


def run_quality(model: str, judge: str, n: int, block: int, num_prompts: int, out: Path) -> list[dict]:
    """Quality of the fast mode against the exact sampler on held-out prompts, judged by an AR model."""
    import kstep
    from kstep.bench.quality import decode_quality
    llm, judge_llm = kstep.load(model), kstep.load(judge)
    if is_block_model(resolve_model(model)):
        modes = {m: dict(max_tokens=n, **settings) for m, settings in BLOCK_MODES.items()}
    else:
        modes = {"exact": dict(max_tokens=n, block_length=block, steps=n, early_stop=False),
                 "dual+threshold": dict(max_tokens=n, block_length=block, steps=n, cache="dual", threshold=0.9)}
    rows = decode_quality(llm, judge_llm, held_out_prompts(resolve_model(model), num_prompts), modes)
    (out / "bench_decode_quality.json").write_text(json.dumps({"model": model, "judge": judge, "n": n,
                                                               "rows": rows}, indent=2) + "\n")
    return rows


def format_quality(rows: list[dict]) -> str:
    lines = ["| mode | prompts | parse rate | judge NLL (nats/token) | distinct ratio | mean nfe | mean s "
             "| agreement with exact |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        nll = "-" if r["judge_nll"] is None else f"{r['judge_nll']:.3f}"
        lines.append(f"| {r['mode']} | {r['prompts']} | {r['parse_rate']:.2f} | {nll} | {r['distinct_ratio']:.2f} | "
                     f"{r['mean_nfe']:.1f} | {r['mean_seconds']:.2f} | {r['agreement_with_first']:.2f} |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = ["| model | N | mode | nfe | seconds | tokens/s | speedup vs exact | peak MiB (weights + generation) "
             "| peak vs smallest N |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mark = " (extrapolated)" if r["extrapolated"] else ""
        lines.append(f"| {r['model']} | {r['n']} | {r['mode']} | {r['nfe']} | {r['seconds']:.2f}{mark} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup_vs_exact']:.2f}x | {r['model_bytes'] / 2**20:.0f} + "
                     f"{r['peak_bytes'] / 2**20:.1f} | "
                     f"{r['peak_vs_smallest_n']:.2f}x |")
    return "\n".join(lines)
