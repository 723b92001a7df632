"""`kstep bench llamacpp`: the flags, and the prompt both engines get (ar.py runs the comparison)."""
import argparse
import json
import sys
from pathlib import Path

from kstep.flags import add_command, check_positive

DEFAULT_ROOT = ".kstep-cache/llamacpp"


def add_llamacpp(kinds) -> None:
    bench = add_command(kinds, "llamacpp", "kstep's AR engine against llama.cpp on the same weights, prompt and "
                        "length (float32/F32, bfloat16/BF16, int8/Q8_0): tokens/s, ratios, identical ids "
                        "(needs scripts/build_llamacpp.sh)")
    bench.add_argument("--kind", choices=["ar", "diffusion"], default="ar",
                       help="ar: the AR engines; diffusion: kstep's masked-diffusion sampler against "
                            "llama-diffusion-cli (LLaDA, Dream, LLaDA-MoE)")
    bench.add_argument("--model", action="append", default=None,
                       help="a checkpoint (AR; LLaDA, Dream or LLaDA-MoE for --kind diffusion), a directory or bundled "
                            "name, or a GGUF file (both engines read that file; repeat)")
    bench.add_argument("--shape", action="append", default=None,
                       help="a published shape (kstep/shapes.py): a random qwen2 (ar) checkpoint, or for diffusion one "
                            "of the shape's first family of llada, dream, llada_moe (qwen2.5-0.5b: dream; lladamoe-1b: "
                            "llada_moe), written once under --work (repeat; default qwen2.5-0.5b / llada-1b when no "
                            "--model)")
    bench.add_argument("--steps", type=int, default=32, help="diffusion: passes of both engines (default 32)")
    bench.add_argument("--weights", default="float32,bfloat16,int8",
                       help="kstep weights, each against its GGUF type: float32 (F32), bfloat16 (BF16), int8 (Q8_0); "
                            "int4 on a GGUF file only")
    bench.add_argument("--prompt-tokens", type=int, default=64)
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--threads", type=int, default=2, help="threads of each engine (default 2)")
    bench.add_argument("--repeats", type=int, default=3, help="interleaved rounds per row")
    bench.add_argument("--llamacpp", default=DEFAULT_ROOT, help="where scripts/build_llamacpp.sh built llama.cpp")
    bench.add_argument("--work", default=f"{DEFAULT_ROOT}/models", help="converted GGUFs and random checkpoints")
    bench.add_argument("--out", default="out/bench")
    bench.set_defaults(run=run_llamacpp_bench)


# What llama.cpp's converter and llama-diffusion-cli both take (LLaDA, Dream, LLaDA-MoE)
DIFFUSION_FAMILIES = ("llada", "dream", "llada_moe")


def prompt_ids(checkpoint: Path, count: int) -> list[int]:
    """The held-out code prompts in the checkpoint's tokenizer, cycled to `count` ids."""
    from tokenizers import Tokenizer

    from kstep.eval.prompts import held_out_code_prompts
    ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode("\n".join(held_out_code_prompts())).ids
    return [ids[i % len(ids)] for i in range(count)]


def checkpoints(args: argparse.Namespace) -> list[Path]:
    from kstep.bundled import resolve_model
    from kstep.random_checkpoint import write_random_checkpoint
    from kstep.shapes import SHAPES
    # AR: Qwen2's layout; diffusion: each shape's first family llama.cpp's diffusion CLI runs
    families, default = (("qwen2",), "qwen2.5-0.5b") if args.kind == "ar" else (DIFFUSION_FAMILIES, "llada-1b")
    paths = [Path(resolve_model(m)) for m in args.model or []]
    for shape in args.shape or ([] if args.model else [default]):
        family = next((f for f in SHAPES[shape].families if f in families), None) if shape in SHAPES else None
        if family is None:
            raise ValueError(f"--shape {shape!r}: not a {' or '.join(families)} shape of kstep/shapes.py")
        path = Path(args.work) / f"random-{family}-{shape}"
        if not (path / "config.json").exists():
            write_random_checkpoint(path, family=family, seed=0, shape=shape)
        paths.append(path)
    return paths


def run_llamacpp_bench(args: argparse.Namespace) -> int:
    from kstep.bench.llamacpp.ar import OUTTYPES, compare, format_row, format_table, llamacpp_paths
    check_positive(args, "prompt_tokens", "max_tokens", "threads", "repeats", "steps")
    weights = [w for w in args.weights.split(",") if w]
    for w in weights:
        if w not in OUTTYPES:
            raise ValueError(f"--weights {w!r}: not one of {', '.join(OUTTYPES)}")
    if "int4" in weights and args.kind == "ar":
        from kstep.bundled import resolve_model
        from kstep.gguf.view import gguf_source
        others = [m for m in args.model or [] if gguf_source(Path(resolve_model(m))) is None]
        others += [f"--shape {s}" for s in args.shape or ([] if args.model else ["qwen2.5-0.5b (the default)"])]
        if others:
            raise ValueError(f"--weights int4 runs on GGUF files only (llama.cpp's converter writes no 4-bit type), "
                             f"not {', '.join(others)}")
    paths = llamacpp_paths(Path(args.llamacpp))
    if args.kind == "diffusion":
        return run_diffusion(args, paths)
    rows = []
    for checkpoint in checkpoints(args):
        prompt = prompt_ids(checkpoint, args.prompt_tokens)
        for w in weights:
            rows.append(compare(checkpoint, w, prompt, args.max_tokens, args.threads, args.repeats, paths,
                                Path(args.work)))
            print(format_row(rows[-1]), file=sys.stderr, flush=True)
    return report(Path(args.out), "bench_llamacpp", rows, format_table(rows))


def report(out: Path, name: str, rows: list[dict], table: str) -> int:
    """Print the table; write it and the rows under `out` as NAME.md and NAME.json."""
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    (out / f"{name}.md").write_text(table + "\n")
    return 0


def run_diffusion(args: argparse.Namespace, paths: dict) -> int:
    from kstep.bench.llamacpp.diffusion import compare_diffusion, format_table
    from kstep.eval.prompts import held_out_code_prompts
    rows = []
    for checkpoint in checkpoints(args):
        rows += compare_diffusion(checkpoint, held_out_code_prompts(1)[0], args.prompt_tokens, args.max_tokens,
                                  args.steps, args.threads, args.repeats, paths, Path(args.work))
        print(format_table(rows), file=sys.stderr, flush=True)
    return report(Path(args.out), "bench_llamacpp_diffusion", rows, format_table(rows))
