"""`kstep bench ar`: the AR baseline's tokens/s at batch 1 and 8 for several N: kstep plain,
+ speculative decoding (with the draft), + int8 weights, against Hugging Face transformers'
`generate()` on the same weights, all in one process, one after another. Every generation makes
exactly N tokens (no stop), greedy."""
import json
import statistics
import time
from pathlib import Path

import torch

from kstep.bench.prompts import held_out_code_prompts
from kstep.bundled import resolve_model
from kstep.llm import load


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


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


def run_ar_bench(model: str, draft: str, lengths: list[int], batches: list[int], num_draft_tokens: int,
                 repeats: int, out: Path, progress=print) -> list[dict]:
    plain, spec, int8 = load(model), load(model, draft=draft), load(model, quantize="int8")
    texts = held_out_code_prompts(max(batches))
    encoded = [plain.encode_prompt(t) for t in texts]
    rows = []
    for batch in batches:
        prompts = encoded[:batch]
        hf = transformers_runner(model, prompts, plain.pad_id)
        for n in lengths:
            base = _timed(lambda: hf(n), repeats)
            row = {"batch": batch, "n": n, "transformers_tokens_per_s": batch * n / base}
            for name, llm, extra in (("plain", plain, {}), ("speculative", spec, {"num_draft_tokens": num_draft_tokens}),
                                     ("int8", int8, {})):
                result = {}

                def go(llm=llm, extra=extra, result=result):
                    result["out"] = llm.generate(prompts, max_tokens=n, ignore_eos=True, **extra)
                seconds = _timed(go, repeats)
                row[f"{name}_tokens_per_s"] = batch * n / seconds
                row[f"{name}_vs_transformers"] = row[f"{name}_tokens_per_s"] / row["transformers_tokens_per_s"]
                if name == "speculative":
                    timings = result["out"][0].timings
                    row["acceptance_rate"] = timings["acceptance_rate"]
                    row["tokens_per_target_pass"] = timings["tokens_per_target_pass"]
            row["speculative_vs_plain"] = row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
            rows.append(row)
            progress(format_row(row))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_ar.json").write_text(json.dumps({"model": model, "draft": draft, "num_draft_tokens":
                                                   num_draft_tokens, "repeats": repeats, "rows": rows}, indent=2))
    return rows


def format_row(r: dict) -> str:
    return (f"| {r['batch']} | {r['n']} | {r['transformers_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} "
            f"({r['plain_vs_transformers']:.2f}x) | {r['speculative_tokens_per_s']:.1f} "
            f"({r['speculative_vs_plain']:.2f}x plain; accept {r['acceptance_rate']:.0%}, "
            f"{r['tokens_per_target_pass']:.2f} tok/pass) | {r['int8_tokens_per_s']:.1f} "
            f"({r['int8_vs_transformers']:.2f}x) |")


def format_table(rows: list[dict]) -> str:
    head = ["| batch | N | transformers tok/s | kstep plain tok/s (vs transformers) | + speculative tok/s "
            "(vs plain) | + int8 tok/s (vs transformers) |", "|---|---|---|---|---|---|"]
    return "\n".join(head + [format_row(r) for r in rows])
