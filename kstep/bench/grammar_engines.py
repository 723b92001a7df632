"""`kstep bench structured --engines`: the two grammar engines kstep could use, on the same schemas and
the same token sequences, with no model: llguidance (kstep's) and xgrammar (when importable: it is
not a kstep dependency; `pip install --no-deps xgrammar apache-tvm-ffi` adds it beside torch and
transformers). Per engine: the share of schemas it compiles, compile time, and the time of one
token mask at each position along a valid instance of each schema (the instance: kstep's completion
search from the grammar's start, tokenized by the tokenizer given). With `--step-shape`, one AR decode
step of a random model of that shape (kstep/shapes.py) is timed in the same run, so a mask's cost is
read as a share of the step it runs beside (the target: at most 10% at Qwen2.5-0.5B's shape)."""
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kstep.structured import StructuredSpec
from kstep.structured.grammar import JSON_LAYOUT, GrammarCompiler
from kstep.structured.matcher import closing_bytes


WIDE_VOCAB = 151936  # Qwen2.5's vocabulary size


def wide_tokenizer(vocab_size: int = WIDE_VOCAB) -> Path:
    """A byte-level BPE tokenizer of `vocab_size` tokens (a mask's cost grows with the vocabulary),
    trained once on the Python sources installed beside kstep (the first 150 MB, sorted: the same
    files on the same install) and cached under ~/.cache/kstep. Not Qwen's tokens; its size."""
    import sys
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = Path.home() / ".cache" / "kstep" / "tokenizers" / f"wide-{vocab_size}" / "tokenizer.json"
    if path.is_file():
        return path
    files, total = [], 0
    for file in sorted(Path(sys.prefix).rglob("*.py")) + sorted(Path(sys.base_prefix, "lib").rglob("*.py")):
        files.append(str(file))
        total += file.stat().st_size
        if total > 150e6:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer.train(files, trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def llguidance_rows(tokenizer_json: Path, vocab_size: int, stop_id: int, schemas: list[dict]) -> list[dict]:
    """Per schema: compiled?, compile seconds, its instance's tokens, and each position's mask seconds."""
    rows = []
    for schema in schemas:
        compiler = GrammarCompiler(tokenizer_json, vocab_size, [stop_id])  # no cache: every compile timed
        try:
            grammar = compiler.compile(StructuredSpec.json_schema(schema))
        except ValueError as e:
            rows.append({"accepted": False, "error": str(e)[:200]})
            continue
        found = closing_bytes(grammar.matcher(grammar.bytes))
        tokens = list(grammar.tokens.tokenize_bytes(found)) if found else []
        matcher, masks = grammar.matcher(grammar.tokens), []
        for token in tokens:
            start = time.perf_counter()
            np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            masks.append(time.perf_counter() - start)
            if not matcher.consume_token(token):
                break
        rows.append({"accepted": True, "compile_seconds": grammar.compile_seconds, "tokens": tokens, "masks": masks})
    return rows


def xgrammar_rows(tokenizer_json: Path, vocab_size: int, stop_id: int, schemas: list[dict],
                  instances: list[list[int] | None]) -> list[dict] | None:
    """xgrammar on the same schemas and token sequences (None when it is not installed)."""
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json)),
                                              vocab_size=vocab_size, stop_token_ids=[stop_id])
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    rows = []
    for schema, tokens in zip(schemas, instances, strict=True):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        start = time.perf_counter()
        try:
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                    separators=(JSON_LAYOUT["item_separator"],
                                                                JSON_LAYOUT["key_separator"]))
        except Exception as e:  # xgrammar raises its own errors for schemas it refuses
            rows.append({"accepted": False, "error": str(e)[:200]})
            continue
        seconds, matcher, masks = time.perf_counter() - start, xgr.GrammarMatcher(compiled), []
        for token in tokens or []:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - start)
            if not matcher.accept_token(token):
                break
        rows.append({"accepted": True, "compile_seconds": seconds, "masks": masks})
    return rows


def summarize(engine: str, rows: list[dict]) -> dict:
    accepted = [r for r in rows if r["accepted"]]
    compiles = sorted(r["compile_seconds"] for r in accepted)
    masks = sorted(m for r in accepted for m in r["masks"])

    def quantile(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
    return {"engine": engine, "schemas": len(rows), "accepted": len(accepted),
            "compile_ms_median": 1e3 * statistics.median(compiles) if compiles else None,
            "compile_ms_p95": 1e3 * quantile(compiles, 0.95), "compile_ms_max": 1e3 * max(compiles, default=0),
            "masks": len(masks), "mask_us_median": 1e6 * statistics.median(masks) if masks else None,
            "mask_us_p95": 1e6 * quantile(masks, 0.95), "mask_us_max": 1e6 * max(masks, default=0)}


def ar_step_seconds(shape: str, family: str = "qwen2", context: int = 256, repeats: int = 10) -> float:
    """One AR decode step of a random `family` model of `shape` (bench/passes.py's), float32 on the CPU."""
    from kstep.bench.passes import median_seconds, pass_makers, random_model
    from kstep.runner.model_runner import ModelRunner
    runner = ModelRunner(random_model(family, shape, torch.float32))
    kv = runner.allocate_kv(1, context + 64)
    with torch.inference_mode():
        return median_seconds(runner, pass_makers(runner, context, kv)["ar"][1], repeats)


def format_table(rows: list[dict], step_ms: float | None, vocab_size: int) -> str:
    head = ("| engine | schemas compiled | compile ms (median / p95 / max) | masks timed | mask us (median / p95 / max) |"
            + (" mask / AR step (median / p95 / max) |" if step_ms else "") + "\n|---|---:|---:|---:|---:|"
            + ("---:|" if step_ms else ""))
    lines = [head]
    for r in rows:
        if r["mask_us_median"] is None:
            continue
        line = (f"| {r['engine']} (vocab {vocab_size}) | {r['accepted']}/{r['schemas']} | {r['compile_ms_median']:.2f} / "
                f"{r['compile_ms_p95']:.2f} / {r['compile_ms_max']:.1f} | {r['masks']} | {r['mask_us_median']:.0f} / "
                f"{r['mask_us_p95']:.0f} / {r['mask_us_max']:.0f} |")
        if step_ms:
            line += " " + " / ".join(f"{r[k] / 1e3 / step_ms:.2%}" for k in ("mask_us_median", "mask_us_p95",
                                                                              "mask_us_max")) + " |"
        lines.append(line)
    return "\n".join(lines)
