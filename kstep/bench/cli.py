"""`kstep bench decode|compare|quant|ar|serve` (and moe|load|passes|tp|self-spec: sizes_cli.py; structured:
structured_cli.py; stall: stall.py; long-prompt: long_prompt.py; burst: burst.py): the
benchmarks' flags and their checks. Every
benchmark reports ratios against a baseline measured in the same run."""
import argparse
import json
import sys
from pathlib import Path

from kstep.flags import add_command, add_device_flags, check_positive, positive_ints, set_threads


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def add_bench(sub) -> None:
    bench = add_command(sub, "bench", "benchmarks (ratios against a baseline measured in the same run)", "KIND")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="KIND", prog=bench.prog)
    from kstep.bench.llamacpp.cli import add_llamacpp
    from kstep.bench.sizes_cli import add_load, add_moe, add_passes, add_self_spec, add_tp
    from kstep.bench.sampler import add_sampler
    from kstep.bench.burst import add_burst
    from kstep.bench.long_prompt import add_long_prompt
    from kstep.bench.stall import add_stall
    from kstep.bench.structured_cli import add_structured
    for add in (_add_decode, _add_compare, _add_quant, _add_ar, _add_serve, add_moe, add_load, add_passes, add_tp,
                add_self_spec, add_structured, add_stall, add_long_prompt, add_burst, add_sampler,
                add_llamacpp):
        add(kinds)


def _add_decode(kinds) -> None:
    decode = add_command(kinds, "decode", "diffusion decoding modes vs the exact sampler")
    decode.add_argument("--model", action="append", default=None,
                        help="a diffusion checkpoint or bundled name (repeat; default: the bundled `default`)")
    decode.add_argument("--lengths", default="64,256,1024", help="canvas lengths N, comma-separated")
    decode.add_argument("--block-length", type=int, default=32)
    decode.add_argument("--modes", default="exact,exact+self,prefix,dual,dual+threshold,threshold,threshold+commit-pass",
                        help="each model runs those of its kind: LLaDA/Dream exact, exact+self (draft self, 4 "
                             "drafts a pass; not on the random model), prefix, dual, dual+threshold; "
                             "block diffusion exact, exact+self, threshold, threshold+commit-pass")
    decode.add_argument("--no-large", dest="large", action="store_false",
                        help="skip the ~110M random LLaDA-layout model")
    add_device_flags(decode, threads=True)
    decode.add_argument("--max-cell-seconds", type=float, default=60.0,
                        help="extrapolate fixed-schedule cells whose full run would take longer")
    decode.add_argument("--no-extrapolate", dest="extrapolate", action="store_false")
    decode.add_argument("--quality-prompts", type=int, default=8,
                        help="held-out prompts for the quality check of a bundled diffusion model (0: skip)")
    decode.add_argument("--quality-length", type=int, default=128)
    decode.add_argument("--out", default="out/bench")
    decode.set_defaults(run=run_decode)


def run_decode(args: argparse.Namespace) -> int:
    from kstep.bench.decode import BLOCK_MODES, MODES, format_quality, format_table, run_bench, run_quality
    lengths = positive_ints("--lengths", args.lengths)
    modes = args.modes.split(",")
    known = list(MODES) + [m for m in BLOCK_MODES if m not in MODES]
    bad = [m for m in modes if m not in known]
    if bad:
        raise ValueError(f"--modes: {bad[0]!r} is not a mode (choose from {', '.join(known)}; "
                         "a block-diffusion model runs exact, threshold, threshold+commit-pass)")
    if "exact" not in modes:
        raise ValueError("--modes must include exact: every speedup is measured against it")
    models = args.model or ["default"]
    rows = run_bench(models, lengths, args.block_length, modes, args.device, args.dtype, Path(args.out),
                     args.max_cell_seconds, args.extrapolate, args.threads, args.large)
    print(format_table(rows))
    # the quality check needs held-out prompts (a model trained here) and the AR twin as judge
    judged = next((m for m in models if m in ("default", "llada-coder")), None)
    if args.quality_prompts > 0 and judged is not None:
        quality = run_quality(judged, "default-ar", args.quality_length, args.block_length, args.quality_prompts,
                              Path(args.out))
        print(f"\nquality of {judged} at N={args.quality_length}, judged by default-ar:\n" + format_quality(quality))
    return 0


def _add_compare(kinds) -> None:
    from kstep.bench.compare_sides import SIDES
    cmp = add_command(kinds, "compare", "diffusion vs AR latency against the cost model's floors")
    cmp.add_argument("--diffusion-model", default="default")
    cmp.add_argument("--ar-model", default="default-ar")
    cmp.add_argument("--prompts", default=None, help="JSONL, one {\"prompt\": ...} per line (default: shipped code prompts)")
    cmp.add_argument("--num-prompts", type=int, default=None, help="prompts used (default 4; --quick: 2)")
    cmp.add_argument("--lengths", default=None, help="output lengths N (default 16,64,256,1024; --quick: 16,64,256)")
    cmp.add_argument("--sides", default=None, help="comma-separated, from: " + ", ".join(SIDES))
    cmp.add_argument("--repeats", type=int, default=1)
    cmp.add_argument("--block-length", type=int, default=32)
    cmp.add_argument("--bandwidth-gbs", type=float, default=None, help="skip calibration: this memory bandwidth")
    cmp.add_argument("--matmul-tflops", type=float, default=None, help="skip calibration: this matmul peak")
    cmp.add_argument("--quick", action="store_true", help="2 prompts, N up to 256: a few minutes on 2 CPU cores")
    add_device_flags(cmp, threads=True)
    cmp.add_argument("--out", default="out/compare")
    cmp.set_defaults(run=run_compare_command)


def run_compare_command(args: argparse.Namespace) -> int:
    from kstep.bench.compare import default_sides, run_compare
    from kstep.bench.compare_report import format_table
    from kstep.bench.cost_model import Device
    from kstep.eval.prompts import prompt_rows
    from kstep.bundled import resolve_model
    from kstep.registry import FAMILIES
    from kstep.weights import read_model_config
    set_threads(args.threads)
    lengths = positive_ints("--lengths", args.lengths or ("16,64,256" if args.quick else "16,64,256,1024"))
    kind = FAMILIES[read_model_config(resolve_model(args.diffusion_model)).family].kind
    allowed = default_sides(kind)
    sides = [s.strip() for s in args.sides.split(",")] if args.sides else allowed
    bad = [s for s in sides if s not in allowed]
    if bad:
        raise ValueError(f"--sides: {bad[0]!r} is not a side for a {kind} model (choose from {', '.join(allowed)})")
    check_positive(args, "repeats")
    calibration = None
    if (args.bandwidth_gbs is None) != (args.matmul_tflops is None):
        raise ValueError("--bandwidth-gbs and --matmul-tflops go together (or neither: calibrate)")
    if args.bandwidth_gbs is not None:
        check_positive(args, "bandwidth_gbs", "matmul_tflops")
        calibration = Device("given", args.bandwidth_gbs, args.matmul_tflops, "given")
    rows = prompt_rows(args.prompts, args.num_prompts or (2 if args.quick else 4))
    result = run_compare(args.diffusion_model, args.ar_model, [r["prompt"] for r in rows], lengths, sides,
                         args.repeats, args.block_length, args.device, args.dtype, Path(args.out), calibration)
    print(format_table(result))
    return 0


def _add_quant(kinds) -> None:
    bquant = add_command(kinds, "quant", "weight-only int8/int4: memory, time per pass, held-out NLL")
    bquant.add_argument("--models", default="default-ar,llada-coder", help="comma-separated checkpoints or bundled names")
    bquant.add_argument("--modes", default="none,int8,int4")
    bquant.add_argument("--windows", type=int, default=16, help="held-out windows scored")
    bquant.add_argument("--seq-len", type=int, default=512)
    bquant.add_argument("--mc-samples", type=int, default=8, help="Monte-Carlo draws of the diffusion bound")
    bquant.add_argument("--max-tokens", type=int, default=64, help="generation timed per pass")
    bquant.add_argument("--repeats", type=int, default=3)
    bquant.add_argument("--threads", type=int, default=None)
    bquant.add_argument("--out", default="out/bench")
    bquant.set_defaults(run=run_quant_command)


def run_quant_command(args: argparse.Namespace) -> int:
    from kstep.bench.quant import format_table, run_quant
    set_threads(args.threads)
    check_positive(args, "repeats")
    modes = [m.strip() for m in args.modes.split(",")]
    bad = [m for m in modes if m not in ("none", "int8", "int4")]
    if bad or not modes:
        raise ValueError(f"--modes: {bad[0] if bad else args.modes!r} is not none, int8 or int4")
    if modes[0] != "none":
        modes.insert(0, "none")  # the baseline every ratio is measured against
    rows = run_quant([m.strip() for m in args.models.split(",")], [None if m == "none" else m for m in modes],
                     args.windows, args.seq_len, args.mc_samples, args.max_tokens, args.repeats, Path(args.out),
                     _progress)
    print(format_table(rows))
    return 0


def _add_ar(kinds) -> None:
    from kstep.params import DEFAULT_NUM_DRAFT_TOKENS
    bar = add_command(kinds, "ar", "the AR path: plain, speculative, int8 vs transformers' generate()")
    bar.add_argument("--model", default="default-ar")
    bar.add_argument("--draft", default="default-draft,ngram",
                     help="comma-separated drafts, one speculative column each: draft models and/or 'ngram'")
    bar.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS)
    bar.add_argument("--lengths", default="64,256,1024")
    bar.add_argument("--batches", default="1,8")
    bar.add_argument("--repeats", type=int, default=3, help="timed runs per cell, interleaved across sides (median)")
    bar.add_argument("--threads", type=int, default=None)
    bar.add_argument("--out", default="out/bench")
    bar.set_defaults(run=run_ar_command)


def run_ar_command(args: argparse.Namespace) -> int:
    from kstep.bench.ar import format_table, run_ar_bench
    set_threads(args.threads)
    check_positive(args, "repeats")
    drafts = [d.strip() for d in args.draft.split(",") if d.strip()]
    rows = run_ar_bench(args.model, drafts, positive_ints("--lengths", args.lengths),
                        positive_ints("--batches", args.batches), args.num_draft_tokens, args.repeats,
                        Path(args.out), _progress)
    print(format_table(rows, drafts))
    return 0


def _add_serve(kinds) -> None:
    bserve = add_command(kinds, "serve", "concurrent clients against kstep serve, batched vs max batch 1")
    bserve.add_argument("--model", default="default", help="checkpoint or bundled model to serve")
    bserve.add_argument("--url", default=None, help="bench this running server instead (one run, no ratio)")
    bserve.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    bserve.add_argument("--duration", type=float, default=60.0, help="seconds of load per server")
    bserve.add_argument("--max-tokens", type=int, default=64)
    bserve.add_argument("--num-prompts", type=int, default=32, help="held-out code prompts, sent round robin")
    bserve.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                        help="extra request field, e.g. cache=dual or threshold=0.9 (repeatable)")
    bserve.add_argument("--threads", type=int, default=None, help="the server's torch threads")
    bserve.add_argument("--shared-prefix-tokens", type=int, default=0,
                        help="put the same N-token text before every prompt and compare prefix cache on / off")
    bserve.add_argument("--time-budgets", default=None, metavar="1,0.75,0.5,0.25",
                        help="time budgets as fractions of the default decoding's median latency at this load: "
                             "the share answered within budget, refusals, tokens and passes")
    bserve.add_argument("--replicas", type=int, default=None,
                        help="compare 1 Ray Serve replica with this many (each --threads CPUs, default 1)")
    bserve.add_argument("--sweep", default=None, metavar="1,4,16,64,256",
                        help="one server loaded at each of these concurrencies in turn: throughput, TTFT, inter-token "
                             "time, peak RSS and preemptions per concurrency")
    bserve.add_argument("--serve-arg", action="append", default=[],
                        help="a `kstep serve` flag for the sweep's server, e.g. --serve-arg=--kv-cache-memory=256MiB")
    bserve.add_argument("--out", default="out/bench")
    bserve.set_defaults(run=run_serve_bench)


def run_serve_bench(args: argparse.Namespace) -> int:
    from kstep.eval.prompts import held_out_code_prompts
    from kstep.bench.serve import format_table, run_bench
    check_positive(args, "concurrency", "duration", "max_tokens", "num_prompts")
    settings = {}
    for item in args.setting:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--setting {item!r} must be KEY=VALUE")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    if args.shared_prefix_tokens < 0:
        raise ValueError(f"--shared-prefix-tokens must be >= 0, got {args.shared_prefix_tokens}")
    if args.replicas is not None and (args.replicas < 2 or args.shared_prefix_tokens or args.url):
        raise ValueError(f"--replicas {args.replicas}: give 2 or more, without --shared-prefix-tokens or --url")
    prompts = held_out_code_prompts(args.num_prompts)
    if args.sweep:
        from kstep.bench.sweep import format_table as sweep_table, run_sweep
        rows = run_sweep(args.model, positive_ints("--sweep", args.sweep), args.duration, args.max_tokens, prompts,
                         settings, [*(["--threads", str(args.threads)] if args.threads else []), *args.serve_arg],
                         Path(args.out), progress=_progress)
        print(sweep_table(rows))
        return 0
    if args.time_budgets:
        from kstep.bench.serve import format_budget_table, run_budget_bench
        try:
            fractions = [float(f) for f in args.time_budgets.split(",") if f.strip()]
        except ValueError:
            raise ValueError(f"--time-budgets {args.time_budgets!r} must be comma-separated numbers") from None
        if not fractions or any(f <= 0 for f in fractions):
            raise ValueError(f"--time-budgets {args.time_budgets!r}: each fraction must be positive")
        result = run_budget_bench(args.model, args.concurrency, args.duration, args.max_tokens, prompts, settings,
                                  args.threads, fractions, Path(args.out), progress=_progress)
        print(format_budget_table(result))
        return 0
    result = run_bench(args.model, args.concurrency, args.duration, args.max_tokens, prompts, settings, args.threads,
                       args.url, Path(args.out), progress=_progress, shared_prefix_tokens=args.shared_prefix_tokens,
                       replicas=args.replicas)
    print(format_table(result))
    return 0

