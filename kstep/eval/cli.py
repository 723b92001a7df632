"""`kstep eval`: quality at each decoding setting on a prompt set (eval/run.py)."""
import argparse
from pathlib import Path

from kstep.flags import add_command, add_device_flags, positive_ints, set_threads


def add_eval(sub) -> None:
    ev = add_command(sub, "eval", "quality at each decoding setting (K sweep, thresholds, AR) on a prompt set")
    ev.add_argument("--model", default="default", help="the diffusion model")
    ev.add_argument("--ar-model", default="default-ar", help="the AR model at the same N")
    ev.add_argument("--judge", default=None, help="AR model scoring completions (default: --ar-model)")
    ev.add_argument("--prompts", default=None,
                    help="JSONL of {prompt[, body]} or HumanEval {task_id, prompt, test, entry_point} "
                         "(default: the shipped held-out stdlib functions)")
    ev.add_argument("--num-prompts", type=int, default=None, help="first K prompts (default: all; --quick: 16)")
    ev.add_argument("--max-tokens", type=int, default=None, help="N (default 128; --quick: 64)")
    ev.add_argument("--min-tokens", type=int, default=0,
                    help="no end-of-sequence before this many tokens (N: every completion N tokens, as the "
                         "speed targets count them)")
    ev.add_argument("--block-length", default=None,
                    help="LLaDA/Dream: the semi-autoregressive block (default 32); block diffusion: block "
                         "lengths to decode with, comma-separated (default: the model's own)")
    ev.add_argument("--sub-block-length", default=None,
                    help="block diffusion: sub-block lengths to decode with, comma-separated, one curve each "
                         "(default: the model's own)")
    ev.add_argument("--no-ar", dest="ar", action="store_false", help="skip the AR model's row")
    ev.add_argument("--thresholds", default="0.5,0.7,0.9")
    ev.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    ev.add_argument("--quick", action="store_true", help="16 prompts at N = 64: a few minutes on 2 CPU cores")
    add_device_flags(ev, threads=True)
    ev.add_argument("--out", default="out/eval")
    ev.set_defaults(run=run_eval_command)


def run_eval_command(args: argparse.Namespace) -> int:
    from kstep.eval.prompts import prompt_rows
    from kstep.bundled import resolve_model
    from kstep.eval.run import block_settings, default_settings, format_table, run_eval, uniform_settings
    from kstep.registry import BLOCK_DIFFUSION, FAMILIES, UNIFORM_DIFFUSION
    from kstep.weights import read_model_config
    set_threads(args.threads)
    n = args.max_tokens or (64 if args.quick else 128)
    if n <= 0 or args.batch_size <= 0:
        raise ValueError("--max-tokens and --batch-size must be positive")
    blocks = positive_ints("--block-length", args.block_length) if args.block_length else None
    subs = positive_ints("--sub-block-length", args.sub_block_length) if args.sub_block_length else None
    if not 0 <= args.min_tokens <= n:
        raise ValueError(f"--min-tokens {args.min_tokens} must be in [0, max tokens = {n}]")
    try:
        thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--thresholds {args.thresholds!r} must be comma-separated numbers") from None
    if any(not 0 < t <= 1 for t in thresholds):
        raise ValueError(f"--thresholds {args.thresholds!r}: each must be in (0, 1]")
    rows = prompt_rows(args.prompts, args.num_prompts or (16 if args.quick else None))
    kind = FAMILIES[read_model_config(resolve_model(args.model)).family].kind
    if kind == UNIFORM_DIFFUSION:
        if blocks is not None or subs is not None:
            raise ValueError("--block-length / --sub-block-length: a uniform-diffusion model's canvas is its own")
        settings = uniform_settings(args.ar)
    elif kind == BLOCK_DIFFUSION:
        settings = block_settings(thresholds, blocks, args.ar, subs)
    else:
        if subs is not None:
            raise ValueError("--sub-block-length applies to block-diffusion models only")
        if blocks is not None and len(blocks) > 1:
            raise ValueError(f"--block-length {args.block_length!r}: one block length for a LLaDA/Dream model")
        settings = default_settings(n, blocks[0] if blocks else 32, thresholds)
        settings = settings if args.ar else [s for s in settings if s.is_diffusion]
    result = run_eval(args.model, args.ar_model, args.judge or args.ar_model, rows, n, settings, args.batch_size,
                      Path(args.out), args.device, args.dtype, args.min_tokens)
    print(format_table(result))
    return 0
