"""Time budgets, one request at a time (no load): for each shipped held-out prompt, the default
decoding's own time t at N tokens (every completion N, `min_tokens`), then budgets of 100/75/50/25%
of t: the share finished within budget, tokens produced, passes, parse rate of the function part.
Diffusion coarsens (fewer passes), AR truncates (fewer tokens). Run alone:

    .venv/bin/python scripts/eval_time_budget.py --models default,default-ar --out docs/serving/time_budget.json
"""
import argparse
import json
from pathlib import Path

import torch

import kstep
from kstep.bench.prompts import prompt_rows
from kstep.eval.metrics import function_part, parses

FRACTIONS = (1.0, 0.75, 0.5, 0.25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="default,default-ar")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot-from", default=None, help="only redraw the plot of a saved JSON (beside it, .png)")
    args = ap.parse_args()
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text()), Path(args.plot_from).with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    n, rows, result = args.max_tokens, prompt_rows(None, None), []
    for name in args.models.split(","):
        llm = kstep.load(name)
        for row in rows[:4]:  # warm-up, and the planner's table sees this model's real passes
            llm.generate(row["prompt"], max_tokens=n, min_tokens=n, time_budget=600.0)
        stats = {f: {"within": 0, "tokens": 0, "passes": 0, "parsed": 0, "refused": 0} for f in (None, *FRACTIONS)}
        for row in rows:
            [base] = llm.generate(row["prompt"], max_tokens=n, min_tokens=n)
            for f in (None, *FRACTIONS):
                s = stats[f]
                if f is None:
                    out, budget = base, float("inf")
                else:
                    budget = f * base.seconds
                    try:
                        [out] = llm.generate(row["prompt"], max_tokens=n, min_tokens=n, time_budget=budget)
                    except ValueError:
                        s["refused"] += 1
                        continue
                s["within"] += out.seconds <= budget
                s["tokens"] += len(out.token_ids)
                s["passes"] += out.nfe
                s["parsed"] += parses(row["prompt"], function_part(row["prompt"], out.text or ""))
        for f, s in stats.items():
            ran = len(rows) - s["refused"]
            result.append({"model": name, "budget": "none" if f is None else f"{f:.0%} of its default time",
                           "refused": s["refused"], "within_budget": round(s["within"] / max(ran, 1), 3),
                           "mean_tokens": round(s["tokens"] / max(ran, 1), 1),
                           "mean_passes": round(s["passes"] / max(ran, 1), 1),
                           "parse_rate": round(s["parsed"] / max(ran, 1), 3)})
            print(json.dumps(result[-1]), flush=True)
    print("| model | budget | refused | within budget | tokens | passes | parse rate |\n|---|---|---:|---:|---:|---:|---:|")
    for r in result:
        print(f"| `{r['model']}` | {r['budget']} | {r['refused']} | {r['within_budget']:.0%} | {r['mean_tokens']} | "
              f"{r['mean_passes']} | {r['parse_rate']:.2f} |")
    if args.out:
        saved = {"max_tokens": n, "prompts": len(rows), "rows": result}
        Path(args.out).write_text(json.dumps(saved, indent=2) + "\n")
        plot(saved, Path(args.out).with_suffix(".png"))


def plot(saved: dict, path: Path) -> None:
    """Parse rate and tokens against the budget, one line per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (quality, tokens) = plt.subplots(1, 2, figsize=(10, 4))
    for model in dict.fromkeys(r["model"] for r in saved["rows"]):
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
    tokens.set_ylabel(f"tokens returned (of {saved['max_tokens']})")
    for ax in (quality, tokens):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Quality vs time budget, {saved['prompts']} held-out prompts, one request at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
