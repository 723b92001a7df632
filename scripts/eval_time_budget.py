"""Time budgets, one request at a time (no load): for each shipped held-out prompt, the default
decoding's own time t at N tokens (every completion N, `min_tokens`; the median of --base-runs
runs), then budgets of 100/75/50/25% of t: the share finished within budget, the 95th percentile
of seconds/budget, tokens produced, passes (run and planned), parse rate of the function part.
Diffusion coarsens (fewer passes), AR truncates (fewer tokens). Run alone, on an idle machine:

    .venv/bin/python scripts/eval_time_budget.py --models default,default-ar --out docs/serving/time_budget.json

`--tiny DIR`: tiny random checkpoints written into DIR (once) instead: llada2_moe (blocks of 32,
threshold 0.95) without and with token editing (editing_threshold 0.5, so edits happen), SDAR
(blocks of 4) and DiffusionGemma (canvases of 8); prompts cut to their last --max-prompt-tokens ids.
Their output is noise (no parse rate); what they measure is the planner's promise where a pass
takes milliseconds:

    .venv/bin/python scripts/eval_time_budget.py --tiny runs/budget --max-tokens 64,128 \\
        --out docs/serving/budget/tiny_time_budget.json

`--checkpoint LABEL PATH [KNOB=VALUE ...]` (repeatable) measures any checkpoint with extra knobs.
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

import kstep
from kstep.eval.prompts import prompt_rows
from kstep.eval.metrics import function_part, parses

FRACTIONS = (1.0, 0.75, 0.5, 0.25)
ROOT = Path(__file__).resolve().parents[1]
# label: (family, knobs) of the tiny checkpoints (--tiny)
TINY = {"llada2_moe": ("llada2_moe", {}), "llada2_moe editing": ("llada2_moe", {"editing_threshold": 0.5}),
        "sdar": ("sdar", {}), "diffusion_gemma": ("diffusion_gemma", {})}


def write_tiny(root: Path) -> dict[str, Path]:
    """The tiny checkpoints' directories by family, written unless already there."""
    from kstep.random_checkpoint import write_random_checkpoint
    paths = {}
    for family in dict.fromkeys(f for f, _ in TINY.values()):
        path = root / family
        if not (path / "config.json").is_file():
            if family == "diffusion_gemma":  # transformers writes it (tests/gemma_reference.py)
                sys.path.insert(0, str(ROOT / "tests"))
                from gemma_reference import write_gemma_checkpoint
                write_gemma_checkpoint(path)
            else:
                write_random_checkpoint(path, family=family, seed=0)
        paths[family] = path
    return paths


def parse_knob(text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    return name, json.loads(value) if value not in ("", None) else True


def specs(args) -> list[tuple[str, str, dict, bool]]:
    """(label, model, knobs, measures quality) for every model to run."""
    out = []
    if args.models:
        out += [(name, name, {}, True) for name in args.models.split(",")]
    if args.tiny:
        paths = write_tiny(Path(args.tiny))
        out += [(label, str(paths[family]), knobs, False) for label, (family, knobs) in TINY.items()]
    for label, path, *knobs in args.checkpoint or []:
        out.append((label, path, dict(map(parse_knob, knobs)), False))
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def measure(label: str, model: str, knobs: dict, quality: bool, n: int, rows: list[dict], args) -> list[dict]:
    llm = kstep.load(model)
    prompts = [row["prompt"] for row in rows]  # text (token healing as a user's), or its last ids
    if args.max_prompt_tokens:
        prompts = [llm.encode_prompt(text)[-args.max_prompt_tokens:] for text in prompts]
    kw = {"max_tokens": n, "min_tokens": n, **knobs}
    for ids in prompts[:4]:  # warm-up, and the planner's table sees this model's real steps
        llm.generate(ids, time_budget=600.0, **kw)
    stats = {f: {"ratios": [], "predicted": [], "seconds": [], "tokens": 0, "passes": 0, "planned": 0, "parsed": 0,
                 "refused": 0} for f in (None, *FRACTIONS)}
    for row, ids in zip(rows, prompts, strict=True):
        base = [llm.generate(ids, **kw)[0] for _ in range(args.base_runs)]
        t = statistics.median(b.seconds for b in base)
        for f in (None, *FRACTIONS):
            s = stats[f]
            if f is None:
                out, budget = base[0], t
            else:
                budget = f * t
                try:
                    [out] = llm.generate(ids, time_budget=budget, **kw)
                except ValueError:
                    s["refused"] += 1
                    continue
                s["planned"] += out.timings["planned_passes"]
                s["predicted"].append(out.seconds / out.timings["predicted_seconds"])
            s["ratios"].append(out.seconds / budget)
            s["seconds"].append(out.seconds)
            s["tokens"] += len(out.token_ids)
            s["passes"] += out.nfe
            if quality:
                s["parsed"] += parses(row["prompt"], function_part(row["prompt"], out.text or ""))
    result = []
    for f, s in stats.items():
        ran = max(len(s["ratios"]), 1)
        result.append({"model": label, "max_tokens": n, "knobs": knobs,
                       "budget": "none" if f is None else f"{f:.0%} of its default time", "refused": s["refused"],
                       "within_budget": None if f is None else round(sum(r <= 1 for r in s["ratios"]) / ran, 3),
                       "p95_seconds_over_budget": None if f is None else round(percentile(s["ratios"], 0.95), 3),
                       "median_seconds_over_predicted": round(statistics.median(s["predicted"]), 3)
                       if s["predicted"] else None,
                       "mean_seconds": round(statistics.fmean(s["seconds"]), 4) if s["seconds"] else None,
                       "mean_tokens": round(s["tokens"] / ran, 1), "mean_passes": round(s["passes"] / ran, 1),
                       "mean_planned_passes": None if f is None else round(s["planned"] / ran, 1),
                       "parse_rate": round(s["parsed"] / ran, 3) if quality else None,
                       "table_refits": llm.pass_costs.refits})
        print(json.dumps(result[-1]), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None, help="bundled models or paths (default: default,default-ar)")
    ap.add_argument("--tiny", default=None, help="write tiny random checkpoints here and measure them")
    ap.add_argument("--checkpoint", nargs="+", action="append", metavar="LABEL PATH [KNOB=VALUE]",
                    help="a checkpoint to measure, with knobs (repeatable)")
    ap.add_argument("--max-tokens", default="128", help="N, or several: 64,128")
    ap.add_argument("--prompts", type=int, default=None, help="only the first K held-out prompts")
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="cut prompts to their last K ids "
                                                                      "(--tiny: 64)")
    ap.add_argument("--base-runs", type=int, default=1, help="runs of the default decoding per prompt (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot-from", default=None, help="only redraw the plot of a saved JSON (beside it, .png)")
    args = ap.parse_args()
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text()), Path(args.plot_from).with_suffix(".png"))
        return
    if not (args.models or args.tiny or args.checkpoint):
        args.models = "default,default-ar"
    if args.tiny and args.max_prompt_tokens is None:
        args.max_prompt_tokens = 64
    torch.set_num_threads(args.threads)
    rows = prompt_rows(None, None)[:args.prompts]
    lengths = [int(n) for n in args.max_tokens.split(",")]
    result = []
    for label, model, knobs, quality in specs(args):
        for n in lengths:
            result += measure(label, model, knobs, quality, n, rows, args)
    print("| model | N | budget | refused | within budget | p95 seconds / budget | tokens | passes (planned) | "
          "parse rate |\n|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in result:
        within = "-" if r["within_budget"] is None else f"{r['within_budget']:.0%}"
        p95 = "-" if r["p95_seconds_over_budget"] is None else f"{r['p95_seconds_over_budget']:.2f}"
        planned = "" if r["mean_planned_passes"] is None else f" ({r['mean_planned_passes']})"
        parse = "-" if r["parse_rate"] is None else f"{r['parse_rate']:.2f}"
        print(f"| `{r['model']}` | {r['max_tokens']} | {r['budget']} | {r['refused']} | {within} | {p95} | "
              f"{r['mean_tokens']} | {r['mean_passes']}{planned} | {parse} |")
    print_pivot(result)
    if args.out:
        saved = {"max_tokens": lengths[0] if len(lengths) == 1 else lengths, "prompts": len(rows),
                 "max_prompt_tokens": args.max_prompt_tokens, "base_runs": args.base_runs, "threads": args.threads,
                 "rows": result}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(saved, indent=2) + "\n")
        if any(r["parse_rate"] is not None for r in result):
            plot(saved, Path(args.out).with_suffix(".png"))


def print_pivot(result: list[dict]) -> None:
    """One row per model and N: its default decoding, then per budget the share within it (passes, refusals)."""
    print("\n| model | N | default: ms, passes | " + " | ".join(f"{f:.0%}" for f in FRACTIONS) + " |")
    print("|---|---:|---:|" + "---:|" * len(FRACTIONS))
    for key in dict.fromkeys((r["model"], r["max_tokens"]) for r in result):
        rows = {r["budget"]: r for r in result if (r["model"], r["max_tokens"]) == key}
        free = rows["none"]
        cells = []
        for f in FRACTIONS:
            r = rows[f"{f:.0%} of its default time"]
            refused = f", {r['refused']} refused" if r["refused"] else ""
            within = "-" if r["mean_seconds"] is None else f"{r['within_budget']:.0%}"
            cells.append(f"{within} ({r['mean_passes']}{refused})")
        default = f"{free['mean_seconds'] * 1e3:.0f}, {free['mean_passes']}"
        print(f"| `{key[0]}` | {key[1]} | {default} | " + " | ".join(cells) + " |")


def plot(saved: dict, path: Path) -> None:
    """Parse rate and tokens against the budget, one line per model (models with a parse rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (quality, tokens) = plt.subplots(1, 2, figsize=(10, 4))
    n = saved["max_tokens"]
    for model in dict.fromkeys(r["model"] for r in saved["rows"] if r.get("parse_rate") is not None):
        rows = [r for r in saved["rows"] if r["model"] == model and r["budget"] != "none"]
        free = next(r for r in saved["rows"] if r["model"] == model and r["budget"] == "none")
        x = [float(r["budget"].split("%")[0]) for r in rows]
        label = f"{model} ({'diffusion: fewer passes' if model != 'default-ar' else 'AR: fewer tokens'})"
        for ax, key in ((quality, "parse_rate"), (tokens, "mean_tokens")):
            line, = ax.plot(x, [r[key] for r in rows], "o-", label=label)
            ax.plot([105], [free[key]], "*", markersize=12, color=line.get_color(), label=f"{model}, no budget")
    quality.set_xlabel("time budget, % of the default decoding's own time (star: no budget)")
    quality.set_ylabel("parse rate (function part)")
    tokens.set_xlabel("time budget, % of the default decoding's own time")
    tokens.set_ylabel(f"tokens returned (of {n})")
    for ax in (quality, tokens):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Quality vs time budget, {saved['prompts']} held-out prompts, one request at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
