"""`kstep bench structured`'s flags (bench/structured.py; `--engines`: bench/grammar_engines.py; its
`--batch`: bench/grammar_step.py)."""
import argparse
import json
import sys
from pathlib import Path

from kstep.flags import add_command, add_device_flags, check_positive, set_threads

# (model, settings): every family's decoder and a setting that changes its path (random: the worst case)
DEFAULT_ROWS = (("default", {}), ("default", {"exact": True}), ("llada-coder", {}), ("llada-coder", {"exact": True}),
                ("default-ar", {}), ("random:dream", {}), ("random:sdar", {}), ("random:llada2_moe", {}),
                ("random:llada2_moe", {"editing_threshold": 0.5}), ("random:diffusion_gemma", {}),
                ("random:nemotron_labs_diffusion", {}), ("random:nemotron_labs_diffusion", {"mode": "linear_spec"}))


def add_structured(kinds) -> None:
    bench = add_command(kinds, "structured", "structured outputs on real-world JSON schemas (a JSONSchemaBench sample): "
                        "accepted, valid, complete, passes and time against the same request unconstrained")
    bench.add_argument("--model", action="append", default=None,
                       help="a checkpoint, bundled name or random:FAMILY, run with its defaults (repeat; default: "
                            "every family, with a second setting where it changes the decoder's path)")
    bench.add_argument("--schemas", type=int, default=None, help="how many of the sample's 108 schemas (default: all)")
    bench.add_argument("--max-tokens", type=int, default=256)
    bench.add_argument("--seeds", type=int, default=None, help="run each row under seeds 0..N-1 (a random-start "
                       "model's constrained and free runs take other paths under each: read their ratios over several)")
    bench.add_argument("--engines", action="store_true", help="instead: llguidance against xgrammar (if installed) on "
                       "the same schemas and token sequences, with no model")
    bench.add_argument("--tokenizer", default=None, help="--engines: the tokenizer.json to mask over (default: the "
                       "bundled default's; 'wide': a byte-level BPE of Qwen2.5's 151,936 tokens, trained once here)")
    bench.add_argument("--step-shape", default=None, help="--engines: time one AR decode step of this shape too "
                       "(e.g. qwen2.5-0.5b), for the masks' share of it")
    bench.add_argument("--batch", type=int, default=None, help="--engines: also the grammar's host time per AR step "
                       "of this many rows (per-row masks against one packed mask), against one AR step of that batch")
    add_device_flags(bench, threads=True)
    bench.add_argument("--quality", action="store_true", help="instead: kstep's extraction set (50 texts, the JSON "
                       "of each scored field by field) with the schema enforced and without, on --model (default: "
                       "smollm2)")
    bench.add_argument("--quantize", default=None, choices=["none", "int8", "int4"],
                       help="--quality: the model's weights (a quantized GGUF file's default: its nearest kstep type)")
    bench.add_argument("--out", default="out/bench")
    bench.set_defaults(run=run_structured)


def run_structured(args: argparse.Namespace) -> int:
    from kstep.bench import structured
    set_threads(args.threads)
    check_positive(args, "max_tokens", *(name for name in ("seeds", "batch") if getattr(args, name) is not None))
    sample = structured.load_sample(args.schemas)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"sample": {k: v for k, v in sample.items() if k != "schemas"}, "schemas": len(sample["schemas"])}
    if args.quality:
        from kstep.bench import extraction
        result = extraction.measure((args.model or ["smollm2"])[0], min(args.max_tokens, 96), args.device, args.dtype,
                                    args.quantize, args.schemas, lambda line: print(line, file=sys.stderr, flush=True))
        table, name = extraction.format_table(result), "bench_structured_quality"
    elif args.engines:  # the engines alone, no model
        table, result["engines"] = _engines(args, sample)
        name = "bench_structured_engines"
    else:
        rows = [(m, {}) for m in args.model] if args.model else DEFAULT_ROWS
        if args.seeds:
            rows = [(m, {**settings, "seed": seed}) for m, settings in rows for seed in range(args.seeds)]
        result["rows"] = [structured.measure(model, settings, sample, args.max_tokens, args.device, args.dtype,
                                             lambda line: print(line, file=sys.stderr, flush=True))
                          for model, settings in rows]
        table, name = structured.format_table(result["rows"]), "bench_structured"
    print(table)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(table + "\n")
    return 0


def _engines(args: argparse.Namespace, sample: dict) -> tuple[str, dict]:
    from kstep.bench import grammar_engines as engines
    from kstep.bundled import resolve_model
    tokenizer = engines.wide_tokenizer() if args.tokenizer == "wide" else Path(args.tokenizer) if args.tokenizer \
        else resolve_model("default") / "tokenizer.json"
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    schemas = [s["schema"] for s in sample["schemas"]]
    ours = engines.llguidance_rows(tokenizer, vocab, 0, schemas)
    theirs = engines.xgrammar_rows(tokenizer, vocab, 0, schemas, [r.get("tokens") for r in ours])
    summaries = [engines.summarize("llguidance", ours)] + ([engines.summarize("xgrammar", theirs)] if theirs else [])
    step = engines.ar_step_seconds(args.step_shape) if args.step_shape else None
    table = engines.format_table(summaries, None if step is None else step * 1e3, vocab)
    if theirs is None:
        table += "\n\n(xgrammar is not installed: `pip install --no-deps xgrammar apache-tvm-ffi` to compare)"
    if step is not None:
        table += f"\n\nOne AR decode step at {args.step_shape}'s shape (float32, this CPU): {step * 1e3:.1f} ms."
    result = {"tokenizer": str(tokenizer), "vocab_size": vocab, "summaries": summaries,
              "step_shape": args.step_shape, "step_ms": None if step is None else step * 1e3}
    if args.batch:
        batch_table, result["batch"] = _batch(args, tokenizer, vocab, schemas)
        table += "\n\n" + batch_table
    return table, result


def _batch(args: argparse.Namespace, tokenizer: Path, vocab: int, schemas: list[dict]) -> tuple[str, dict]:
    """The grammar's host time per AR step of --batch rows (bench/grammar_step.py)."""
    from kstep.bench import grammar_step
    from kstep.structured import StructuredSpec
    from kstep.structured.grammar import GrammarCompiler
    compiler, grammars = GrammarCompiler(tokenizer, vocab, [0]), []
    for schema in schemas:
        try:
            grammars.append(compiler.compile(StructuredSpec.json_schema(schema)))
        except ValueError:
            continue
    times = grammar_step.measure(grammars, vocab, 0, args.batch)
    step = grammar_step.ar_batch_step_seconds(args.step_shape, args.batch) if args.step_shape else None
    table = grammar_step.format_table(times, step, args.batch, vocab)
    if step is not None:
        table += (f"\n\nOne AR decode step of {args.batch} rows at {args.step_shape}'s shape (float32): "
                  f"{step * 1e3:.1f} ms.")
    return table, {"batch": args.batch, "grammars": len(grammars), "seconds": times, "step_seconds": step}
