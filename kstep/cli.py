"""The `kstep` command. Bad input: one line naming the value and the rule, exit code 2."""
import argparse
import json
import os
import sys

from kstep.decoding.unmask import UNMASK_RULES
from kstep.llm import DTYPES, load
from kstep.params import CACHE_MODES, GenerationParams


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r} is not a comma-separated list of integers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kstep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts (diffusion or AR, by checkpoint)")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (several run as one batch)")
    gen.add_argument("--model", default="default",
                     help="checkpoint directory, or a bundled model: default (diffusion), default-ar, default-draft")
    gen.add_argument("--prompt-ids", type=_ids, action="append", default=[], metavar="1,2,3",
                     help="a prompt as token ids (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each text prompt in the checkpoint's chat template")
    gen.add_argument("--max-tokens", type=int, default=None, help="completion length (default 128)")
    gen.add_argument("--steps", type=int, default=None, help="diffusion forward passes (default: max tokens)")
    gen.add_argument("--block-length", type=int, default=None, help="diffusion block (default: 32 or max tokens)")
    gen.add_argument("--remasking", default=None, choices=list(UNMASK_RULES),
                     help="unmask rule (default low_confidence)")
    gen.add_argument("--temperature", type=float, default=None, help="0 (default) is greedy")
    gen.add_argument("--cfg-scale", type=float, default=None)
    gen.add_argument("--cache", default=None, choices=list(CACHE_MODES),
                     help="diffusion KV cache: none, prefix, dual (Fast-dLLM; the default)")
    gen.add_argument("--threshold", type=float, default=None,
                     help="unmask every mask with confidence >= T per pass, at least one "
                          "(default 0.9 unless --steps or --factor is given)")
    gen.add_argument("--exact", action="store_const", const=True, default=None,
                     help="LLaDA's reference sampler: no cache, one token per pass (or --steps passes)")
    gen.add_argument("--factor", type=float, default=None, help="Fast-dLLM's factor unmask rule")
    gen.add_argument("--no-early-stop", dest="early_stop", action="store_const", const=False, default=None,
                     help="keep refining after an end-of-sequence token is final")
    gen.add_argument("--min-tokens", type=int, default=None,
                     help="no end-of-sequence or stop token among the first N tokens (vLLM's min_tokens)")
    gen.add_argument("--draft", default=None,
                     help="speculative decoding for an AR model: a draft model (e.g. default-draft) or 'ngram' "
                          "(lookup in the prompt and output, no model)")
    gen.add_argument("--num-draft-tokens", type=int, default=None,
                     help="draft tokens per target pass (default 4 with --draft)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    gen.add_argument("--dtype", default="float32", choices=list(DTYPES))
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    gen.add_argument("--quantize", default=None, choices=["int8", "int4"],
                     help="weight-only quantization of the linear layers at load time")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("--model", default="default", help="checkpoint directory or bundled model name")
    serve.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("KSTEP_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $KSTEP_API_KEY, else none)")
    serve.add_argument("--max-batch-size", type=int, default=16, help="requests per forward pass")
    serve.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    serve.add_argument("--default-max-tokens", type=int, default=256, help="chat max_tokens when not given")
    serve.add_argument("--prefix-cache-mib", type=int, default=256,
                       help="AR prefix cache budget in MiB (0 turns it off; diffusion models never use it)")
    serve.add_argument("--graceful-timeout", type=float, default=30.0,
                       help="seconds SIGTERM waits for in-flight requests before exiting")
    serve.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    serve.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    serve.add_argument("--dtype", default="float32", choices=list(DTYPES))
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--quantize", default=None, choices=["int8", "int4"],
                       help="weight-only quantization of the linear layers at load time")
    serve.add_argument("--draft", default=None,
                       help="speculative decoding for an AR --model: a draft model or 'ngram' (no model)")
    serve.add_argument("--num-draft-tokens", type=int, default=None,
                       help="default draft tokens per target pass (default 4 with --draft)")
    defaults = serve.add_argument_group("decoding defaults for this model (a request's fields override them)")
    defaults.add_argument("--block-length", type=int, default=None)
    defaults.add_argument("--remasking", default=None, choices=list(UNMASK_RULES))
    defaults.add_argument("--cache", default=None, choices=list(CACHE_MODES))
    defaults.add_argument("--threshold", type=float, default=None)
    defaults.add_argument("--exact", action="store_const", const=True, default=None,
                          help="LLaDA's reference sampler instead of dual cache + threshold 0.9")
    defaults.add_argument("--factor", type=float, default=None)
    defaults.add_argument("--cfg-scale", type=float, default=None)
    ev = sub.add_parser("eval", help="quality at each decoding setting (K sweep, thresholds, AR) on a prompt set")
    ev.add_argument("--model", default="default", help="the diffusion model")
    ev.add_argument("--ar-model", default="default-ar", help="the AR model at the same N")
    ev.add_argument("--judge", default=None, help="AR model scoring completions (default: --ar-model)")
    ev.add_argument("--prompts", default=None,
                    help="JSONL of {prompt[, body]} or HumanEval {task_id, prompt, test, entry_point} "
                         "(default: the shipped held-out stdlib functions)")
    ev.add_argument("--num-prompts", type=int, default=None, help="first K prompts (default: all; --quick: 16)")
    ev.add_argument("--max-tokens", type=int, default=None, help="N (default 128; --quick: 64)")
    ev.add_argument("--block-length", type=int, default=32)
    ev.add_argument("--thresholds", default="0.5,0.7,0.9")
    ev.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    ev.add_argument("--quick", action="store_true", help="16 prompts at N = 64: a few minutes on 2 CPU cores")
    ev.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ev.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ev.add_argument("--out", default="out/eval")
    train = sub.add_parser("train", help="train a diffusion (llada) or AR (llama) model on a code corpus")
    from kstep.train.trainer import TrainConfig
    for f in TrainConfig.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("objective", "out"):
            train.add_argument(flag, required=True, choices=["diffusion", "ar"] if f.name == "objective" else None)
        elif f.type is bool:
            train.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {int | None: int, str | None: str}.get(f.type, f.type)
            train.add_argument(flag, type=kind, default=f.default)
    train.add_argument("--resume", action="store_true", help="continue from OUT/train_state if present")
    report = sub.add_parser("train-report", help="curves, held-out metrics and samples for trained models")
    report.add_argument("--model", action="append", required=True, metavar="LABEL=DIR",
                        help="a trained model directory with a label (repeat; the first sets the held-out windows)")
    report.add_argument("--out", required=True, help="where training_curves.png and training_report.json go")
    report.add_argument("--mc-samples", type=int, default=16, help="Monte-Carlo samples for the diffusion bound")
    report.add_argument("--windows", type=int, default=64, help="held-out windows to score")
    report.add_argument("--write-cards", action="store_true", help="also write a README.md model card per model")
    bench = sub.add_parser("bench", help="benchmarks (ratios against a baseline measured in the same run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    decode = bench_sub.add_parser("decode", help="diffusion decoding modes vs the exact sampler")
    decode.add_argument("--model", action="append", default=None,
                        help="a diffusion checkpoint or bundled name (repeat; default: the bundled `default`)")
    decode.add_argument("--lengths", default="64,256,1024", help="canvas lengths N, comma-separated")
    decode.add_argument("--block-length", type=int, default=32)
    decode.add_argument("--modes", default="exact,prefix,dual,dual+threshold")
    decode.add_argument("--no-large", dest="large", action="store_false",
                        help="skip the ~110M random LLaDA-layout model")
    decode.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    decode.add_argument("--dtype", default="float32", choices=list(DTYPES))
    decode.add_argument("--threads", type=int, default=None)
    decode.add_argument("--max-cell-seconds", type=float, default=60.0,
                        help="extrapolate fixed-schedule cells whose full run would take longer")
    decode.add_argument("--no-extrapolate", dest="extrapolate", action="store_false")
    decode.add_argument("--quality-prompts", type=int, default=8,
                        help="held-out prompts for the quality check of the bundled pair (0: skip)")
    decode.add_argument("--quality-length", type=int, default=128)
    decode.add_argument("--out", default="out/bench")
    cmp = bench_sub.add_parser("compare", help="diffusion vs AR latency against the cost model's floors")
    cmp.add_argument("--diffusion-model", default="default")
    cmp.add_argument("--ar-model", default="default-ar")
    cmp.add_argument("--prompts", default=None, help="JSONL, one {\"prompt\": ...} per line (default: shipped code prompts)")
    cmp.add_argument("--num-prompts", type=int, default=None, help="prompts used (default 4; --quick: 2)")
    cmp.add_argument("--lengths", default=None, help="output lengths N (default 16,64,256,1024; --quick: 16,64,256)")
    cmp.add_argument("--sides", default=None, help="comma-separated, from: " + ", ".join(
        ["diffusion exact", "diffusion dual+threshold", "diffusion dual K=N/4", "ar"]))
    cmp.add_argument("--repeats", type=int, default=1)
    cmp.add_argument("--block-length", type=int, default=32)
    cmp.add_argument("--bandwidth-gbs", type=float, default=None, help="skip calibration: this memory bandwidth")
    cmp.add_argument("--matmul-tflops", type=float, default=None, help="skip calibration: this matmul peak")
    cmp.add_argument("--quick", action="store_true", help="2 prompts, N up to 256: a few minutes on 2 CPU cores")
    cmp.add_argument("--threads", type=int, default=None)
    cmp.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    cmp.add_argument("--dtype", default="float32", choices=list(DTYPES))
    cmp.add_argument("--out", default="out/compare")
    bquant = bench_sub.add_parser("quant", help="weight-only int8/int4: memory, time per pass, held-out NLL")
    bquant.add_argument("--models", default="default-ar,default", help="comma-separated checkpoints or bundled names")
    bquant.add_argument("--modes", default="none,int8,int4")
    bquant.add_argument("--windows", type=int, default=16, help="held-out windows scored")
    bquant.add_argument("--seq-len", type=int, default=512)
    bquant.add_argument("--mc-samples", type=int, default=8, help="Monte-Carlo draws of the diffusion bound")
    bquant.add_argument("--max-tokens", type=int, default=64, help="generation timed per pass")
    bquant.add_argument("--repeats", type=int, default=3)
    bquant.add_argument("--threads", type=int, default=None)
    bquant.add_argument("--out", default="out/bench")
    bar = bench_sub.add_parser("ar", help="the AR path: plain, speculative, int8 vs transformers' generate()")
    bar.add_argument("--model", default="default-ar")
    bar.add_argument("--draft", default="default-draft,ngram",
                     help="comma-separated drafts, one speculative column each: draft models and/or 'ngram'")
    bar.add_argument("--num-draft-tokens", type=int, default=4)
    bar.add_argument("--lengths", default="64,256,1024")
    bar.add_argument("--batches", default="1,8")
    bar.add_argument("--repeats", type=int, default=3, help="timed runs per cell, interleaved across sides (median)")
    bar.add_argument("--threads", type=int, default=None)
    bar.add_argument("--out", default="out/bench")
    bserve = bench_sub.add_parser("serve", help="concurrent clients against kstep serve, batched vs max batch 1")
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
    bserve.add_argument("--out", default="out/bench")
    rand = sub.add_parser("random-checkpoint", help="write a small random-weight checkpoint (tests, demos)")
    rand.add_argument("--family", default="llada", choices=["llada", "llama"])
    rand.add_argument("--out", required=True)
    rand.add_argument("--seed", type=int, default=0)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    # Only the flags given: every default lives in GenerationParams.
    if args.draft is not None and args.num_draft_tokens is None:
        args.num_draft_tokens = 4
    given = {name: getattr(args, name, None) for name in GenerationParams.__dataclass_fields__}
    params = GenerationParams(**{name: value for name, value in given.items() if value is not None})
    if not args.prompts and not args.prompt_ids:
        raise ValueError("no prompt given: pass PROMPT text or --prompt-ids")
    if any(p == "" for p in args.prompts) or any(not ids for ids in args.prompt_ids):
        raise ValueError("prompt is empty: give at least one token")
    llm = load(args.model, device=args.device, dtype=args.dtype, draft=args.draft, quantize=args.quantize)
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) if args.chat else p for p in args.prompts]
    results = llm.generate(prompts + args.prompt_ids, params)
    for result in results:
        if args.json:
            print(json.dumps(result.to_dict()))
        else:
            body = result.text if result.text is not None else " ".join(map(str, result.token_ids))
            print(body)
            spec = ""
            if "acceptance_rate" in result.timings:
                spec = f", draft acceptance {result.timings['acceptance_rate']:.0%}"
            print(f"-- {result.completion_tokens} tokens, finish_reason={result.finish_reason}, nfe={result.nfe}, "
                  f"{result.seconds:.2f} s, {result.tokens_per_forward:.2f} tokens/forward{spec}", file=sys.stderr)
    return 0


def run_serve(args) -> int:
    import torch
    import uvicorn

    from kstep.engine.async_engine import torch_thread
    from kstep.server.app import ServeConfig, build_app
    if args.prefix_cache_mib < 0:
        raise ValueError(f"--prefix-cache-mib {args.prefix_cache_mib} must be >= 0")
    for name in ("port", "max_batch_size", "max_queue", "max_body_bytes", "default_max_tokens"):
        if getattr(args, name) <= 0 or (name == "port" and args.port > 65535):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} is out of range")
    names = ("block_length", "remasking", "cache", "threshold", "factor", "cfg_scale", "exact")
    defaults = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    GenerationParams(**defaults)  # a bad default fails now, naming the flag's value

    def load_model():
        if args.threads is not None:  # OpenMP's thread count is per thread: set it where torch runs
            torch.set_num_threads(args.threads)
        return load(args.model, device=args.device, dtype=args.dtype, draft=args.draft, quantize=args.quantize)
    executor = torch_thread()
    llm = executor.submit(load_model).result()
    if not llm.is_diffusion:
        defaults = {k: v for k, v in defaults.items() if k not in names}
    if args.draft is not None:
        defaults["num_draft_tokens"] = 4 if args.num_draft_tokens is None else args.num_draft_tokens
        GenerationParams(**defaults)
    config = ServeConfig(model_name=args.served_model_name or args.model, api_key=args.api_key,
                         max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                         max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                         prefix_cache_bytes=args.prefix_cache_mib << 20, defaults=defaults)
    kind = "diffusion" if llm.is_diffusion else "autoregressive"
    print(f"kstep serve: {config.model_name} ({kind}, {llm.path}) on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.run(build_app(llm, config, executor), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.graceful_timeout)
    return 0


def _positive_ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated integers") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} {text!r} must be positive integers")
    return values


def _prompt_rows(path: str | None, count: int | None) -> list[dict]:
    from kstep.bench.prompts import CODE_PROMPTS, read_prompt_file
    if count is not None and count <= 0:
        raise ValueError(f"--num-prompts must be positive, got {count}")
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"--prompts {path!r}: no such file")
    rows = read_prompt_file(path or CODE_PROMPTS)
    return rows[:count] if count else rows


def run_bench_compare(args) -> int:
    from pathlib import Path

    import torch

    from kstep.bench.compare import SIDES, format_table, run_compare
    from kstep.bench.cost_model import Device
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lengths = _positive_ints("--lengths", args.lengths or ("16,64,256" if args.quick else "16,64,256,1024"))
    sides = [s.strip() for s in (args.sides or ",".join(SIDES)).split(",")]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        raise ValueError(f"--sides: {bad[0]!r} is not a side (choose from {', '.join(SIDES)})")
    if args.repeats <= 0:
        raise ValueError(f"--repeats must be positive, got {args.repeats}")
    calibration = None
    if (args.bandwidth_gbs is None) != (args.matmul_tflops is None):
        raise ValueError("--bandwidth-gbs and --matmul-tflops go together (or neither: calibrate)")
    if args.bandwidth_gbs is not None:
        if args.bandwidth_gbs <= 0 or args.matmul_tflops <= 0:
            raise ValueError("--bandwidth-gbs and --matmul-tflops must be positive")
        calibration = Device("given", args.bandwidth_gbs, args.matmul_tflops, "given")
    rows = _prompt_rows(args.prompts, args.num_prompts or (2 if args.quick else 4))
    result = run_compare(args.diffusion_model, args.ar_model, [r["prompt"] for r in rows], lengths, sides,
                         args.repeats, args.block_length, args.device, args.dtype, Path(args.out), calibration)
    print(format_table(result))
    return 0


def run_eval_command(args) -> int:
    from pathlib import Path

    from kstep.eval.run import default_settings, format_table, run_eval
    n = args.max_tokens or (64 if args.quick else 128)
    if n <= 0 or args.block_length <= 0 or args.batch_size <= 0:
        raise ValueError("--max-tokens, --block-length and --batch-size must be positive")
    try:
        thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--thresholds {args.thresholds!r} must be comma-separated numbers") from None
    if any(not 0 < t <= 1 for t in thresholds):
        raise ValueError(f"--thresholds {args.thresholds!r}: each must be in (0, 1]")
    rows = _prompt_rows(args.prompts, args.num_prompts or (16 if args.quick else None))
    settings = default_settings(n, args.block_length, thresholds)
    result = run_eval(args.model, args.ar_model, args.judge or args.ar_model, rows, n, settings, args.batch_size,
                      Path(args.out), args.device, args.dtype)
    print(format_table(result))
    return 0


def run_bench_quant_or_ar(args) -> int:
    from pathlib import Path

    import torch
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.repeats <= 0:
        raise ValueError(f"--repeats must be positive, got {args.repeats}")
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.bench == "quant":
        from kstep.bench.quant import format_table, run_quant
        modes = [m.strip() for m in args.modes.split(",")]
        bad = [m for m in modes if m not in ("none", "int8", "int4")]
        if bad or not modes:
            raise ValueError(f"--modes: {bad[0] if bad else args.modes!r} is not none, int8 or int4")
        if modes[0] != "none":
            modes.insert(0, "none")  # the baseline every ratio is measured against
        rows = run_quant([m.strip() for m in args.models.split(",")], [None if m == "none" else m for m in modes],
                         args.windows, args.seq_len, args.mc_samples, args.max_tokens, args.repeats, Path(args.out),
                         progress)
    else:
        from kstep.bench.ar import format_table, run_ar_bench
        drafts = [d.strip() for d in args.draft.split(",") if d.strip()]
        rows = run_ar_bench(args.model, drafts, _positive_ints("--lengths", args.lengths),
                            _positive_ints("--batches", args.batches), args.num_draft_tokens, args.repeats,
                            Path(args.out), progress)
        print(format_table(rows, drafts))
        return 0
    print(format_table(rows))
    return 0


def run_bench_serve(args) -> int:
    from pathlib import Path

    from kstep.bench.prompts import held_out_code_prompts
    from kstep.bench.serve import format_table, run_bench
    for name in ("concurrency", "duration", "max_tokens", "num_prompts"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    settings = {}
    for item in args.setting:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--setting {item!r} must be KEY=VALUE")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    prompts = held_out_code_prompts(args.num_prompts)
    if args.shared_prefix_tokens < 0:
        raise ValueError(f"--shared-prefix-tokens must be >= 0, got {args.shared_prefix_tokens}")
    result = run_bench(args.model, args.concurrency, args.duration, args.max_tokens, prompts, settings, args.threads,
                       args.url, Path(args.out), progress=lambda line: print(line, file=sys.stderr, flush=True),
                       shared_prefix_tokens=args.shared_prefix_tokens)
    print(format_table(result))
    return 0


def kstep_is_diffusion(path) -> bool:
    from kstep.weights import read_model_config
    return not read_model_config(path).is_causal


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "train":
            from kstep.train.trainer import TrainConfig, Trainer
            fields = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
            print(Trainer(TrainConfig(**fields)).train(resume=args.resume))
            return 0
        if args.command == "bench" and args.bench == "decode":
            from pathlib import Path

            from kstep.bench.decode import MODES, format_table, run_bench
            lengths = [int(n) for n in args.lengths.split(",")]
            modes = args.modes.split(",")
            bad = [m for m in modes if m not in MODES]
            if bad:
                raise ValueError(f"--modes: {bad[0]!r} is not a mode (choose from {', '.join(MODES)})")
            if "exact" not in modes:
                raise ValueError("--modes must include exact: every speedup is measured against it")
            rows = run_bench(args.model or ["default"], lengths, args.block_length, modes, args.device, args.dtype,
                             Path(args.out), args.max_cell_seconds, args.extrapolate, args.threads, args.large)
            print(format_table(rows))
            if args.quality_prompts > 0 and (args.model or ["default"]) == ["default"]:
                from kstep.bench.decode import format_quality, run_quality
                quality = run_quality("default", "default-ar", args.quality_length, args.block_length,
                                      args.quality_prompts, Path(args.out))
                print(f"\nquality at N={args.quality_length}, judged by default-ar:\n" + format_quality(quality))
            return 0
        if args.command == "bench" and args.bench == "compare":
            return run_bench_compare(args)
        if args.command == "eval":
            return run_eval_command(args)
        if args.command == "bench" and args.bench in ("quant", "ar"):
            return run_bench_quant_or_ar(args)
        if args.command == "bench" and args.bench == "serve":
            return run_bench_serve(args)
        if args.command == "train-report":
            from pathlib import Path

            from kstep.train.report import write_report
            runs = {}
            for item in args.model:
                label, sep, path = item.partition("=")
                if not sep or not Path(path).is_dir():
                    raise ValueError(f"--model {item!r} must be LABEL=DIR with an existing directory")
                runs[label] = Path(path)
            result = write_report(runs, Path(args.out), args.mc_samples, args.windows)
            metrics = result["held_out_nll_per_token"]
            if args.write_cards:
                from kstep.train.report import write_model_card
                for label, path in runs.items():
                    name = "NLL bound (ELBO)" if kstep_is_diffusion(path) else "NLL"
                    write_model_card(path, f"kstep bundled model: {label} ({path.name})",
                                     {f"{name}, {lab}" if lab != label else name: v for lab, v in metrics.items()
                                      if lab == label})
            print(json.dumps(metrics))
            return 0
        if args.command == "random-checkpoint":
            from kstep.random_checkpoint import write_random_checkpoint
            print(write_random_checkpoint(args.out, family=args.family, seed=args.seed))
            return 0
    except (ValueError, FileNotFoundError) as e:
        print(f"kstep: error: {e}", file=sys.stderr)
        return 2
    return 0
