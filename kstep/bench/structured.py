"""`kstep bench structured`: structured outputs on real-world JSON schemas (kstep's sample of
JSONSchemaBench, bench/data/jsonschemabench_sample.json; scripts/sample_jsonschemabench.py says how it
was drawn), per model and setting, one request at a time, each beside the same request unconstrained:

- accepted: the grammar engine compiles the schema (else refused: which feature), and a completion
  of it fits max_tokens (else refused at admission: its shortest completion found is longer, or
  kstep's completion search found none);
- valid: the output parses and `jsonschema` validates it against the schema; complete: "stop";
- passes and wall time against the unconstrained request at the same settings, tokens per pass of
  both (the forced text costs no pass: the grammar's forced tokens are counted);
- the grammar's own time: compile (per schema), each mask (per position), the completion searches,
  and all of it per pass against the unconstrained request's time per pass.

Random-weight models (`random:FAMILY`) are the worst case for the grammar (they prefer nothing it
wants), the bundled ones what small trained models do."""
import json
import shutil
import statistics
import tempfile
import weakref
from decimal import Decimal
import time
from pathlib import Path

import jsonschema

import kstep
from kstep.random_checkpoint import write_random_checkpoint
from kstep.structured import StructuredSpec

SAMPLE = Path(__file__).parent / "data" / "jsonschemabench_sample.json"


def load_sample(limit: int | None = None) -> dict:
    sample = json.loads(SAMPLE.read_text())
    if limit is not None:  # the same share of every dataset: every k-th schema
        step = max(1, len(sample["schemas"]) // limit)
        sample["schemas"] = sample["schemas"][::step][:limit]
    return sample


def load_model(name: str, device: str, dtype: str) -> kstep.LLM:
    if name.startswith("random:"):
        family = name.split(":", 1)[1]
        directory = tempfile.mkdtemp(prefix=f"kstep-{family}-")
        llm = kstep.load(write_random_checkpoint(directory, family=family, seed=5), device=device, dtype=dtype)
        weakref.finalize(llm, shutil.rmtree, directory, ignore_errors=True)  # with the model, or at exit
        return llm
    return kstep.load(name, device=device, dtype=dtype)


def prompt_for(schema: dict) -> str:
    """A short request in words (the tiny models' context cannot hold the schemas themselves)."""
    about = schema.get("title") or schema.get("description") or "the record"
    return f"# {str(about)[:120]}\n# as JSON:\n"


def is_valid(text: str, schema: dict) -> bool:
    """`jsonschema`'s verdict, with every JSON number read as a decimal, as JSON Schema reads them
    (with floats, -1.11 is "not a multiple of 0.01": 110.99999999999999 hundredths)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        jsonschema.validate(json.loads(text, parse_float=Decimal), json.loads(json.dumps(schema), parse_float=Decimal))
        return True
    except ArithmeticError:  # a number past what decimals hold (1e999999999): floats decide
        pass
    except (jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    try:
        jsonschema.validate(value, schema)
    except (jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


def run_one(llm: kstep.LLM, schema: dict, max_tokens: int, settings: dict) -> dict:
    """One schema: the constrained request and, when it ran, the same request unconstrained."""
    spec, prompt = StructuredSpec.json_schema(schema, "response_format"), prompt_for(schema)
    try:
        llm.resolve(kstep.GenerationParams(max_tokens=max_tokens, structured=spec, **settings))
    except ValueError as e:
        why = "room" if "completion found takes" in str(e) else "search" if "no completion was found" in str(e) \
            else "engine"
        return {"accepted": False, "refused": why, "error": str(e)[:200]}
    start = time.perf_counter()
    [out] = llm.generate(prompt, max_tokens=max_tokens, structured=spec, **settings)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    [free] = llm.generate(prompt, max_tokens=max_tokens, **settings)
    free_seconds = time.perf_counter() - start
    t = out.timings
    return {"accepted": True, "text": out.text, "valid": is_valid(out.text, schema),
            "complete": out.finish_reason == "stop",
            "tokens": len(out.token_ids) + (out.finish_reason == "stop"), "passes": t["batch_passes"],
            "seconds": seconds, "free_tokens": len(free.token_ids), "free_passes": free.timings["batch_passes"],
            "free_seconds": free_seconds, "forced": t.get("grammar_forced_tokens", 0),
            "masks": t.get("grammar_masks", 0), "mask_seconds": t.get("grammar_mask_seconds", 0.0),
            "grammar_seconds": t.get("grammar_mask_seconds", 0.0) + t.get("grammar_search_seconds", 0.0),
            "compile_seconds": t.get("grammar_compile_seconds")}


def measure(model: str, settings: dict, sample: dict, max_tokens: int, device: str, dtype: str,
            progress=None) -> dict:
    llm = load_model(model, device, dtype)
    llm.generate("x", max_tokens=8, **settings)  # warm-up: first-call costs
    runs = [run_one(llm, s["schema"], max_tokens, settings) for s in sample["schemas"]]
    row = summarize(model, settings, runs, max_tokens)
    row["runs"] = [{"dataset": s["dataset"], "path": s["path"], **r} for s, r in zip(sample["schemas"], runs)]
    if progress:
        progress(format_row(row))
    return row


def summarize(model: str, settings: dict, runs: list[dict], max_tokens: int) -> dict:
    ran = [r for r in runs if r["accepted"]]
    refused = [r for r in runs if not r["accepted"]]

    def total(key: str) -> float:
        return sum(r[key] for r in ran)
    compiles = [r["compile_seconds"] for r in ran if r.get("compile_seconds") is not None]
    return {"model": model, "settings": settings, "max_tokens": max_tokens, "schemas": len(runs),
            "accepted": len(ran), "refused_by_engine": sum(r["refused"] == "engine" for r in refused),
            "refused_for_room": sum(r["refused"] == "room" for r in refused),
            "refused_no_completion": sum(r["refused"] == "search" for r in refused),
            "valid": sum(r["valid"] for r in ran), "complete": sum(r["complete"] for r in ran),
            "passes": total("passes"), "free_passes": total("free_passes"),
            "tokens_per_pass": total("tokens") / max(1, total("passes")),
            "free_tokens_per_pass": total("free_tokens") / max(1, total("free_passes")),
            "forced_share": total("forced") / max(1, total("tokens")),
            "seconds": total("seconds"), "free_seconds": total("free_seconds"),
            "mask_us": 1e6 * total("mask_seconds") / max(1, total("masks")),
            "grammar_share_of_pass": (total("grammar_seconds") / max(1, total("passes")))
            / (total("free_seconds") / max(1, total("free_passes"))) if ran else 0.0,
            "compile_ms_median": 1e3 * statistics.median(compiles) if compiles else None,
            "compile_ms_max": 1e3 * max(compiles) if compiles else None}


def _settings_text(settings: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings.items()) or "defaults"


def format_row(r: dict) -> str:
    accepted = f"{r['accepted']}/{r['schemas']}"
    refused = f"{r['refused_by_engine']} engine, {r['refused_for_room']} room, {r['refused_no_completion']} no completion"
    ran = max(1, r["accepted"])
    compile_ms = "-" if r["compile_ms_median"] is None else f"{r['compile_ms_median']:.1f} / {r['compile_ms_max']:.0f}"
    return (f"| {r['model']} | {_settings_text(r['settings'])} | {accepted} ({refused}) | "
            f"{r['valid'] / ran:.0%} | {r['complete'] / ran:.0%} | {r['passes'] / max(1, r['free_passes']):.2f}x | "
            f"{r['tokens_per_pass']:.2f} / {r['free_tokens_per_pass']:.2f} | {r['forced_share']:.0%} | "
            f"{r['seconds'] / max(1e-9, r['free_seconds']):.2f}x | {r['mask_us']:.0f} | "
            f"{r['grammar_share_of_pass']:.0%} | {compile_ms} |")


def format_table(rows: list[dict]) -> str:
    head = ("| model | settings | schemas accepted (refused) | valid | complete (stop) | passes vs free | "
            "tokens / pass (constrained / free) | forced tokens | time vs free | mask us / position | "
            "grammar time / free pass time | compile ms (median / max) |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    return "\n".join([head] + [format_row(r) for r in rows])
