"""`kstep bench self-spec`: what lossless self-speculation (`draft="self"`) buys over the exact
sampler it reproduces, in one run: per model, length N and drafts per pass K, on held-out prompts,
one request at a time: whether every prompt's tokens equal `exact`'s, the sequential passes of
each, the positions each computed, the drafts kept, and the speed vs exact (`speed_vs_exact`:
exact's wall time over this run's, the median over prompts, measured back to back on the same
prompt; above 1 is faster than exact, 0.25 four times slower). With `--cache prefix|dual` (a canvas
model's), "exact" is the same fixed schedule run with that cache, which draft self then
reproduces. A pass of K canvases costs about one on a bandwidth-bound accelerator and about K on
this CPU: the pass ratio is what the former sees, the speed what the latter does."""
import statistics
import time

import kstep
from kstep.llm import LLM


def timed(llm: LLM, prompt: str, n: int, **settings) -> tuple[list[int], dict]:
    start = time.perf_counter()
    [out] = llm.generate(prompt, max_tokens=n, **settings)
    seconds = time.perf_counter() - start
    return out.token_ids, {"seconds": seconds, "passes": out.timings["batch_passes"],
                           "positions": out.timings.get("positions_computed"),
                           "drafted": out.timings.get("drafted_tokens", 0), "kept": out.timings.get("accepted_tokens", 0),
                           "on_position": out.timings.get("broke_on_position", 0),
                           "on_token": out.timings.get("broke_on_token", 0)}


def measure(model: str, prompts: list[str], lengths: list[int], drafts: list[int], device: str, dtype: str,
            progress=None, cache: str = "none") -> list[dict]:
    llm = kstep.load(model, device=device, dtype=dtype)
    llm.generate(prompts[0], max_tokens=8, exact=True)  # warm-up: first-call costs
    rows = []
    for n in lengths:
        # with a cache, what draft self reproduces is the same fixed schedule (one token a pass) run with it
        cached = {} if cache == "none" else {"cache": cache, "steps": n}
        exact = [timed(llm, p, n, **(cached or {"exact": True})) for p in prompts]
        for k in drafts:
            runs = [timed(llm, p, n, draft="self", num_draft_tokens=k, **cached) for p in prompts]
            same = sum(tokens == e_tokens for (tokens, _), (e_tokens, _) in zip(runs, exact))
            passes, exact_passes = (sum(r[1]["passes"] for r in rs) for rs in (runs, exact))
            drafted = sum(r[1]["drafted"] for r in runs)
            rows.append({"model": model, "cache": cache, "n": n, "drafts": k, "prompts": len(prompts),
                         "identical": same,
                         "exact_passes": exact_passes / len(prompts), "passes": passes / len(prompts),
                         "pass_ratio": exact_passes / passes,
                         "positions_vs_exact": sum(r[1]["positions"] for r in runs) / sum(e[1]["positions"] for e in exact),
                         "acceptance": sum(r[1]["kept"] for r in runs) / drafted if drafted else 0.0,
                         "broke_on_position": sum(r[1]["on_position"] for r in runs),
                         "broke_on_token": sum(r[1]["on_token"] for r in runs),
                         "speed_vs_exact": statistics.median(e[1]["seconds"] / r[1]["seconds"]
                                                             for r, e in zip(runs, exact))})
            if progress:
                progress(format_row(rows[-1]))
    return rows


def format_row(r: dict) -> str:
    return (f"| {r['model']} | {r.get('cache', 'none')} | {r['n']} | {r['drafts']} | {r['identical']}/{r['prompts']} | "
            f"{r['exact_passes']:.1f} | {r['passes']:.1f} | **{r['pass_ratio']:.2f}x** | {r['acceptance']:.0%} | {breaks(r)} | "
            f"{r['positions_vs_exact']:.2f}x | {r['speed_vs_exact']:.2f}x |")


def breaks(r: dict) -> str:
    """Where the drafts broke: the share of rounds whose exact step filled another position."""
    total = r["broke_on_position"] + r["broke_on_token"]
    return f"{r['broke_on_position'] / total:.0%}" if total else "-"


def format_table(rows: list[dict]) -> str:
    head = ("| model | cache | N | K | identical to exact | exact passes | passes | fewer passes | drafts kept | "
            "breaks on a position (else a token) | positions vs exact | "
            "speed vs exact (exact's time / this time, this CPU) |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    return "\n".join([head] + [format_row(r) for r in rows])
