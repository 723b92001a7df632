"""`kstep eval`: what K costs in quality. For each decoding setting (diffusion with K = N/8, N/4,
N/2, N passes; K = N's tokens in fewer passes by self-speculation; diffusion with the dual cache and
a confidence threshold; AR at the same N), greedy
completions of a prompt set and their quality: parse rate, an AR judge's NLL of the completion
(generative perplexity), distinct-token ratio, exact match / edit distance to the held-out body,
and pass@1 when the prompts carry HumanEval tests (run in a sandboxed subprocess, never here)."""
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kstep.eval.execution import humaneval_program, passes_tests
from kstep.eval.metrics import (
    distinct_ratio,
    function_part,
    judge_nll,
    normalized_edit_distance,
    parses,
)
from kstep.llm import LLM, load


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    family: str          # "diffusion K", "diffusion threshold", "ar": one curve each in the plot
    is_diffusion: bool
    settings: dict


def default_settings(n: int, block_length: int, thresholds=(0.5, 0.7, 0.9)) -> list[Setting]:
    block = min(block_length, n)
    blocks = n // block
    out = []
    for divisor in (8, 4, 2, 1):
        steps = max(blocks, (n // divisor) // blocks * blocks)
        out.append(Setting(f"diffusion K={steps}", "diffusion K", True,
                           {"steps": steps, "block_length": block, "cache": "none"}))
    # K = N's tokens by construction (lossless self-speculation), in fewer passes
    out.append(Setting(f"diffusion K={n} + draft self", "diffusion self-speculation", True,
                       {"steps": n, "block_length": block, "draft": "self", "num_draft_tokens": 4}))
    for tau in thresholds:
        out.append(Setting(f"diffusion dual threshold={tau}", "diffusion threshold", True,
                           {"block_length": block, "cache": "dual", "threshold": tau}))
    out.append(Setting("ar", "ar", False, {}))
    return out


def block_settings(thresholds=(0.5, 0.7, 0.9), block_lengths: list[int] | None = None,
                   include_ar: bool = True, sub_block_lengths: list[int] | None = None) -> list[Setting]:
    """For a block-diffusion model: one token per pass (the exact schedule), each threshold, at the
    model's own block size (or each of `block_lengths`, decoding with blocks other than those it was
    trained on) and its default sub-block (or each of `sub_block_lengths`: one curve each), and AR."""
    out = []
    for block in block_lengths or [None]:
        knobs, tag = ({}, "") if block is None else ({"block_length": block}, f" block={block}")
        out.append(Setting(f"block exact{tag}", "block diffusion K", True, {"exact": True, **knobs}))
        for sub in sub_block_lengths or [None]:
            sub_knobs, sub_tag = ({}, "") if sub is None else ({"sub_block_length": sub}, f" sub={sub}")
            out += [Setting(f"block threshold={tau}{tag}{sub_tag}", f"block diffusion threshold{sub_tag}", True,
                            {"threshold": tau, **knobs, **sub_knobs}) for tau in thresholds]
    return out + ([Setting("ar", "ar", False, {})] if include_ar else [])


def uniform_settings(include_ar: bool = True, steps=(4, 8, 16, 32)) -> list[Setting]:
    """For a uniform-diffusion model (DiffusionGemma): its stopping rule (the checkpoint's settings), and
    fixed passes per canvas (never stopping early: confidence_threshold 0), and AR."""
    out = [Setting("uniform adaptive", "uniform adaptive", True, {})]
    out += [Setting(f"uniform K={k}", "uniform K per canvas", True,
                    {"max_denoising_steps": k, "confidence_threshold": 0.0}) for k in steps]
    return out + ([Setting("ar", "ar", False, {})] if include_ar else [])


def score(row: dict, text: str, token_ids: list[int], judge: LLM) -> dict:
    """Quality of one completion of one prompt row."""
    prompt = row["prompt"]
    body = function_part(prompt, text)
    scores = {"parses": parses(prompt, body), "distinct_ratio": distinct_ratio(token_ids)}
    completion_ids = judge.tokenizer.encode(body, add_special_tokens=False) if judge.tokenizer else token_ids
    scores["judge_nll"] = judge_nll(judge, judge.encode_prompt(prompt), completion_ids)
    if "body" in row:
        scores["exact_match"] = body.strip() == row["body"].strip()
        scores["edit_distance"] = normalized_edit_distance(body.strip(), row["body"].strip())
    if {"test", "entry_point"} <= row.keys():
        scores["passed"] = passes_tests(humaneval_program(prompt, body, row["test"], row["entry_point"]))
    return scores


def mean_of(values: list) -> float | None:
    values = [float(v) for v in values if v is not None]
    return statistics.mean(values) if values else None


def run_eval(diffusion_model: str, ar_model: str, judge_model: str, rows: list[dict], n: int,
             settings: list[Setting], batch_size: int, out: Path, device: str = "cpu",
             dtype: str = "float32", min_tokens: int = 0) -> dict:
    models = {True: load(diffusion_model, device, dtype), False: load(ar_model, device, dtype)}
    judge = models[False] if judge_model == ar_model else load(judge_model, device, dtype)
    results = []
    for setting in tqdm(settings, desc="kstep eval", unit="setting"):
        llm = models[setting.is_diffusion]
        per_prompt = []
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            outs = llm.generate([r["prompt"] for r in batch], max_tokens=n, min_tokens=min_tokens, temperature=0.0,
                                **setting.settings)
            for row, o in zip(batch, outs, strict=True):
                per_prompt.append({"nfe": o.nfe, "seconds": o.seconds / len(batch), "tokens": len(o.token_ids),
                                   "text": o.text, **score(row, o.text or "", o.token_ids, judge)})
        summary = {"setting": setting.name, "family": setting.family, "settings": setting.settings,
                   "prompts": len(per_prompt), "mean_nfe": mean_of([p["nfe"] for p in per_prompt]),
                   "tokens_per_pass": sum(p["tokens"] for p in per_prompt) / max(1, sum(p["nfe"] for p in per_prompt)),
                   "parse_rate": mean_of([p["parses"] for p in per_prompt]),
                   "judge_nll": mean_of([p["judge_nll"] for p in per_prompt]),
                   "distinct_ratio": mean_of([p["distinct_ratio"] for p in per_prompt]),
                   "exact_match": mean_of([p.get("exact_match") for p in per_prompt]),
                   "edit_distance": mean_of([p.get("edit_distance") for p in per_prompt]),
                   "pass_at_1": mean_of([p.get("passed") for p in per_prompt]),
                   "mean_seconds_per_prompt": mean_of([p["seconds"] for p in per_prompt]),
                   "samples": [p["text"] for p in per_prompt[:3]]}
        results.append(summary)
        tqdm.write(format_row(summary))
    result = {"diffusion_model": diffusion_model, "ar_model": ar_model, "judge_model": judge_model,
              "max_tokens": n, "min_tokens": min_tokens, "prompts": len(rows), "results": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "quality_vs_nfe.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metrics = [("parse_rate", "parse rate"), ("judge_nll", "AR judge NLL (nats/token, lower is better)"),
               ("edit_distance", "edit distance to the real body (lower is better)")]
    if any(r["pass_at_1"] is not None for r in result["results"]):
        metrics.append(("pass_at_1", "pass@1"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 4))
    families = {}
    for r in result["results"]:
        families.setdefault(r["family"], []).append(r)
    for ax, (key, label) in zip(axes, metrics):
        for family, points in families.items():
            points = [p for p in points if p[key] is not None]
            points.sort(key=lambda p: p["mean_nfe"])
            ax.plot([p["mean_nfe"] for p in points], [p[key] for p in points], "o-", label=family)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("forward passes (mean per prompt)")
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Quality vs forward passes, N = {result['max_tokens']} tokens, {result['prompts']} prompts",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_row(r: dict) -> str:
    return (f"| {r['setting']} | {_fmt(r['mean_nfe'], '.1f')} | {_fmt(r.get('tokens_per_pass'), '.2f')} | "
            f"{_fmt(r['parse_rate'], '.2f')} | "
            f"{_fmt(r['judge_nll'], '.3f')} | {_fmt(r['distinct_ratio'], '.2f')} | {_fmt(r['exact_match'], '.2f')} | "
            f"{_fmt(r['edit_distance'], '.2f')} | {_fmt(r['pass_at_1'], '.2f')} |")


def format_table(result: dict) -> str:
    lines = ["| setting | passes | tokens/pass | parse rate | judge NLL | distinct | exact match | edit distance | "
             "pass@1 |", "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [format_row(r) for r in result["results"]])
