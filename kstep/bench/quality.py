"""The quality side of `kstep bench decode`: what a decoding mode costs in quality on held-out
prompts, against the exact sampler on the same prompts (same run, same model)."""
import statistics

from kstep.eval.metrics import distinct_ratio, judge_nll, parses
from kstep.llm import LLM


def decode_quality(llm: LLM, judge: LLM, prompts: list[str], modes: dict[str, dict]) -> list[dict]:
    """For each mode (name -> generate settings): parse rate, judge NLL, distinct ratio, mean nfe,
    and token agreement with the first mode's completions."""
    rows, reference = [], None
    for name, settings in modes.items():
        results = [llm.generate(p, **settings)[0] for p in prompts]
        nlls = [judge_nll(judge, llm.encode_prompt(p), r.token_ids) for p, r in zip(prompts, results)]
        nlls = [x for x in nlls if x is not None]
        if reference is None:
            reference = results
        same = [sum(a == b for a, b in zip(r.token_ids, ref.token_ids)) / max(1, len(ref.token_ids))
                for r, ref in zip(results, reference)]
        rows.append({"mode": name, "prompts": len(prompts),
                     "parse_rate": sum(parses(p, r.text or "") for p, r in zip(prompts, results)) / len(prompts),
                     "judge_nll": statistics.mean(nlls) if nlls else None,
                     "distinct_ratio": statistics.mean(distinct_ratio(r.token_ids) for r in results),
                     "mean_nfe": statistics.mean(r.nfe for r in results),
                     "mean_seconds": statistics.mean(r.seconds for r in results),
                     "agreement_with_first": statistics.mean(same)})
    return rows
