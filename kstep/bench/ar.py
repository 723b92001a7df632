"""`kstep bench ar`: the AR baseline's tokens/s at batch 1 and 8 for several N: kstep plain,
+ speculative decoding (each draft: a draft model, n-gram lookup), + int8 weights, against Hugging Face transformers'
`generate()` on the same weights, all in one process, their repeats interleaved. Every generation makes
exactly N tokens, greedy: end-of-sequence is suppressed until N (kstep's min_tokens = transformers'
min_new_tokens), so both sides produce the same tokens, and a fine-tuned model does not fill the
rest with end-of-sequence tokens (which would flatter speculative decoding)."""
import json
import statistics
import time
from pathlib import Path

import torch

from kstep.eval.prompts import held_out_code_prompts
from kstep.bundled import resolve_model
from kstep.llm import load


def _timed_interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, the repeats interleaved (a, b, c, a, b, c, ...) so that a
    slow spell of the machine hits every side alike rather than whichever ran then."""
    for fn in fns.values():
        fn()  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - start)
    return {name: statistics.median(r) for name, r in runs.items()}


def transformers_runner(model: str, prompts: list[list[int]], pad_id: int):
    """A generate() call on the same checkpoint, left-padded like kstep's batches."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model(model)), torch_dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(n: int):
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=pad_id, use_cache=True)
    return run


def run_ar_bench(model: str, drafts: list[str], lengths: list[int], batches: list[int], num_draft_tokens: int,
                 repeats: int, out: Path, progress=print) -> list[dict]:
    """Each draft (a draft model's name/path, or "ngram") is one speculative column."""
    plain = load(model)
    variants = [("plain", plain, {})]
    variants += [(f"speculative {d}", load(model, draft=d), {"num_draft_tokens": num_draft_tokens}) for d in drafts]
    variants.append(("int8", load(model, quantize="int8"), {}))
    texts = held_out_code_prompts(max(batches))
    encoded = [plain.encode_prompt(t) for t in texts]
    rows = []
    for batch in batches:
        prompts = encoded[:batch]
        hf = transformers_runner(model, prompts, plain.pad_id)
        for n in lengths:
            results: dict[str, list] = {}

            def run(llm, extra, name):
                results[name] = llm.generate(prompts, max_tokens=n, min_tokens=n, **extra)
            fns = {"transformers": lambda: hf(n)}
            fns.update({name: (lambda llm=llm, extra=extra, name=name: run(llm, extra, name))
                        for name, llm, extra in variants})
            seconds = _timed_interleaved(fns, repeats)
            row = {"batch": batch, "n": n, "transformers_tokens_per_s": batch * n / seconds["transformers"]}
            for name, _, _ in variants:
                row[f"{name}_tokens_per_s"] = batch * n / seconds[name]
                row[f"{name}_vs_transformers"] = row[f"{name}_tokens_per_s"] / row["transformers_tokens_per_s"]
                if name.startswith("speculative"):
                    timings = results[name][0].timings
                    row[f"{name}_acceptance_rate"] = timings["acceptance_rate"]
                    row[f"{name}_tokens_per_target_pass"] = timings["tokens_per_target_pass"]
                    row[f"{name}_vs_plain"] = row[f"{name}_tokens_per_s"] / row["plain_tokens_per_s"]
            rows.append(row)
            progress(format_row(row, drafts))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_ar.json").write_text(json.dumps({"model": model, "drafts": drafts, "num_draft_tokens":
                                                   num_draft_tokens, "repeats": repeats, "rows": rows}, indent=2))
    return rows


def format_row(r: dict, drafts: list[str]) -> str:
    cells = [str(r["batch"]), str(r["n"]), f"{r['transformers_tokens_per_s']:.1f}",
             f"{r['plain_tokens_per_s']:.1f} ({r['plain_vs_transformers']:.2f}x)"]
    for d in drafts:
        name = f"speculative {d}"
        cells.append(f"{r[name + '_tokens_per_s']:.1f} ({r[name + '_vs_plain']:.2f}x plain; accept "
                     f"{r[name + '_acceptance_rate']:.0%}, {r[name + '_tokens_per_target_pass']:.2f} tok/pass)")
    cells.append(f"{r['int8_tokens_per_s']:.1f} ({r['int8_vs_transformers']:.2f}x)")
    return "| " + " | ".join(cells) + " |"


def format_table(rows: list[dict], drafts: list[str]) -> str:
    columns = ["batch", "N", "transformers tok/s", "kstep plain tok/s (vs transformers)",
               *(f"+ speculative, draft {d} (vs plain)" for d in drafts), "+ int8 tok/s (vs transformers)"]
    head = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(head + [format_row(r, drafts) for r in rows])
