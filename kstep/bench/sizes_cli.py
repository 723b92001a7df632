"""`kstep bench moe|load|passes|tp`: the benchmarks of what real model sizes cost (the MoE layer and
its floors, a checkpoint's loading memory, one pass at a published shape, one pass split over ranks). Each reports ratios
against a baseline measured in the same run."""
import argparse
import json
import sys
from pathlib import Path

from kstep.flags import add_command, add_device_flags, check_positive, positive_ints, set_threads


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def add_moe(kinds) -> None:
    moe = add_command(kinds, "moe", "the sparse MoE layer vs the same FLOPs done densely; MoE floors on accelerators")
    moe.add_argument("--shapes", default="llada2-2b:llada2_moe,lladamoe-7b:llada_moe,llada2-mini:llada2_moe",
                     help="SHAPE:FAMILY,... (kstep/shapes.py; `tiny` = the test models' sizes); one layer each")
    moe.add_argument("--tokens", default="1,8,32,256", help="tokens per pass")
    moe.add_argument("--dtypes", default="float32,bfloat16")
    moe.add_argument("--repeats", type=int, default=7)
    moe.add_argument("--gpus", default="a100-80gb,h100-sxm,h200", help="data-sheet accelerators for the floors")
    moe.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    moe.add_argument("--out", default="out/bench")
    moe.set_defaults(run=run_moe)


def run_moe(args: argparse.Namespace) -> int:
    import torch

    from kstep.bench.cost_model import ACCELERATORS
    from kstep.bench.moe import floor_table, format_report, run_layer_bench
    from kstep.llm import resolve_dtype
    from kstep.registry import FAMILIES
    from kstep.shapes import SHAPES
    shapes = [tuple(item.split(":")) for item in args.shapes.split(",") if item]
    for item in shapes:
        if len(item) != 2 or (item[0] not in SHAPES and item[0] != "tiny") or item[1] not in FAMILIES \
                or FAMILIES[item[1]].layout.__name__.split(".")[-1] not in ("llada2_moe", "llada_moe"):
            raise ValueError(f"--shapes: {':'.join(item)!r} is not SHAPE:FAMILY with a known shape and an MoE family")
    gpus = [g for g in args.gpus.split(",") if g]
    if any(g not in ACCELERATORS for g in gpus):
        raise ValueError(f"--gpus: choose from {', '.join(ACCELERATORS)}")
    check_positive(args, "repeats")
    set_threads(args.threads)
    dtypes = [resolve_dtype(d) for d in args.dtypes.split(",")]
    tokens = positive_ints("--tokens", args.tokens)
    layer_rows = run_layer_bench(shapes, tokens, dtypes, args.repeats, progress=_progress)
    floors = floor_table(gpus, [4, 8, 16, 32])
    report = format_report(layer_rows, floors)
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_moe.json").write_text(json.dumps({"threads": torch.get_num_threads(), "layers": layer_rows,
                                                   "floors": floors}, indent=2) + "\n")
    (out / "bench_moe.md").write_text(report + "\n")
    return 0


def add_load(kinds) -> None:
    load = add_command(kinds, "load", "peak memory and time of loading a checkpoint, against its weights")
    load.add_argument("--model", required=True, help="checkpoint directory, GGUF file or bundled name")
    load.add_argument("--against", default=None,
                      help="the same weights in another form (e.g. the safetensors of a GGUF file): both loaded "
                           "twice, each in a fresh process, alternating; the second loads' time ratio")
    add_device_flags(load)
    load.add_argument("--out", default=None, help="also write the figures as JSON here")
    load.set_defaults(run=run_load)


def run_load(args: argparse.Namespace) -> int:
    from kstep.bench.memory import load_footprint
    if args.against:
        rows = [_load_in_a_process(model, args) for _ in range(2) for model in (args.against, args.model)]
        for row in rows:
            _print_load(row)
        ratio = rows[3]["load_s"] / rows[2]["load_s"]
        print(f"load time {rows[3]['load_s']:.2f} s against {rows[2]['load_s']:.2f} s: {ratio:.2f}x")
        result = {"rows": rows, "load_time_ratio": ratio}
    else:
        result = load_footprint(args.model, args.device, args.dtype)
        _print_load(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _load_in_a_process(model: str, args: argparse.Namespace) -> dict:
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        subprocess.run([sys.executable, "-m", "kstep", "bench", "load", "--model", model, "--device", args.device,
                        "--dtype", args.dtype, "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def _print_load(row: dict) -> None:
    gib = 1024 ** 3
    print(f"{row['model']}: {row['params'] / 1e9:.2f} B parameters, weights {row['weights_bytes'] / gib:.2f} GiB "
          f"({row['dtype']}; checkpoint files {row['checkpoint_bytes'] / gib:.2f} GiB), loaded in "
          f"{row['load_s']:.2f} s, peak while loading {row['peak_bytes'] / gib:.2f} GiB = "
          f"{row['peak_over_weights']:.2f}x the weights", flush=True)


PASS_SHAPES = ("llama:bundled-3m,llama:dense-60m,qwen2:qwen2.5-0.5b,qwen2:qwen2.5-1.5b,llada:llada-1b,"
               "sdar:qwen3-1.7b")


def add_passes(kinds) -> None:
    passes = add_command(kinds, "passes", "one pass at real model sizes: the AR step vs block and window passes, "
                         "against floors measured in the same run")
    passes.add_argument("--shapes", default=PASS_SHAPES,
                        help="FAMILY:SHAPE,... (kstep/shapes.py, or bundled-3m / dense-60m)")
    passes.add_argument("--dtypes", default="float32,bfloat16")
    passes.add_argument("--context", type=int, default=512, help="cached positions the passes attend to")
    passes.add_argument("--repeats", type=int, default=3)
    passes.add_argument("--pages", default="run", help="the cache's pages: run (a view), scattered (read through "
                        "page tables, gathered), or both: run,scattered")
    passes.add_argument("--threads", type=int, default=None)
    passes.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the passes and the calibration run")
    passes.add_argument("--out", default="out/bench")
    passes.set_defaults(run=run_passes)


def run_passes(args: argparse.Namespace) -> int:
    import torch

    from kstep.bench.cost_model import calibrate
    from kstep.bench.passes import BUNDLED_SIZES, format_table, measure_shape, plot_ratio
    from kstep.llm import resolve_dtype
    from kstep.registry import FAMILIES
    from kstep.shapes import SHAPES
    shapes = [tuple(item.split(":")) for item in args.shapes.split(",") if item]
    for item in shapes:
        if len(item) != 2 or item[0] not in FAMILIES or (item[1] not in SHAPES and item[1] not in BUNDLED_SIZES):
            raise ValueError(f"--shapes: {':'.join(item)!r} is not FAMILY:SHAPE (shapes: "
                             f"{', '.join([*BUNDLED_SIZES, *SHAPES])})")
    check_positive(args, "repeats", "context")
    layouts = args.pages.split(",")
    if not layouts or set(layouts) - {"run", "scattered"}:
        raise ValueError(f"--pages: {args.pages!r} is not run, scattered or run,scattered")
    set_threads(args.threads)
    rows = []
    for dtype in [resolve_dtype(d) for d in args.dtypes.split(",")]:
        measured = calibrate(args.device, dtype, seconds=2.0)  # once per dtype, in this run: every row's floor
        _progress(f"{dtype}: {measured.bandwidth_gb_s:.1f} GB/s, {measured.matmul_tflops * 1e3:.0f} GFLOP/s matmul")
        for family, shape in shapes:
            for pages in layouts:
                rows += measure_shape(family, shape, dtype, args.context, args.repeats, measured, args.device,
                                      progress=_progress, pages=pages)
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_passes.json").write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
    (out / "bench_passes.md").write_text(format_table(rows) + "\n")
    plot_ratio(rows, out / "pass_over_step.png")
    return 0


def add_tp(kinds) -> None:
    tp = add_command(kinds, "tp", "tensor / expert parallel at published shapes: N ranks against one, on the same "
                     "cores (pass time, time in collectives, memory per rank)")
    tp.add_argument("--shapes", default="qwen2:qwen2.5-1.5b:float32,llada2_moe:llada2-2b:bfloat16",
                    help="FAMILY:SHAPE:DTYPE,... (kstep/shapes.py)")
    tp.add_argument("-tp", "--tensor-parallel-size", type=int, default=2, metavar="N", help="the ranks to compare")
    tp.add_argument("--context", type=int, default=512, help="cached positions the passes attend to")
    tp.add_argument("--repeats", type=int, default=7)
    tp.add_argument("--checkpoints", default="runs/bench-tp", help="where the random checkpoints are written")
    tp.add_argument("--out", default="out/bench")
    tp.set_defaults(run=run_tp)


def run_tp(args: argparse.Namespace) -> int:
    from kstep.bench.tp import checkpoint, format_table, measure_alone
    from kstep.llm import resolve_dtype
    from kstep.registry import FAMILIES
    from kstep.shapes import SHAPES
    shapes = [tuple(item.split(":")) for item in args.shapes.split(",") if item]
    for item in shapes:
        if len(item) != 3 or item[0] not in FAMILIES or item[1] not in SHAPES:
            raise ValueError(f"--shapes: {':'.join(item)!r} is not FAMILY:SHAPE:DTYPE with a known shape")
    check_positive(args, "repeats", "context", "tensor_parallel_size")
    rows = []
    for family, shape, dtype_name in shapes:
        dtype = resolve_dtype(dtype_name)
        path = checkpoint(Path(args.checkpoints), family, shape, dtype)
        for size, threads in ((1, 0), (1, 1), (args.tensor_parallel_size, 1)):
            _progress(f"{shape} {dtype_name}: {size} rank(s)")
            rows.append({"model": f"{shape} ({family}, {dtype_name})",
                         **measure_alone(path, dtype, size, args.context, args.repeats, threads)})
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_tp.json").write_text(json.dumps({"context": args.context, "rows": rows}, indent=2) + "\n")
    (out / "bench_tp.md").write_text(format_table(rows) + "\n")
    return 0


def add_self_spec(kinds) -> None:
    spec = add_command(kinds, "self-spec", "lossless self-speculation (draft self) against the exact sampler it "
                       "reproduces: identical tokens, sequential passes, positions, time")
    spec.add_argument("--model", action="append", default=None,
                      help="a diffusion checkpoint or bundled name (repeat; default: llada-coder and default)")
    spec.add_argument("--lengths", default="64,128,256")
    spec.add_argument("--drafts", default="2,4,8", help="num_draft_tokens values, one row each")
    spec.add_argument("--num-prompts", type=int, default=8, help="the first held-out code prompts")
    spec.add_argument("--cache", choices=["none", "prefix", "dual"], default="none",
                      help="none: against exact; prefix/dual (canvas models): against the fixed schedule with that cache")
    add_device_flags(spec, threads=True)
    spec.add_argument("--out", default="out/bench")
    spec.set_defaults(run=run_self_spec)


def run_self_spec(args: argparse.Namespace) -> int:
    from kstep.eval.prompts import prompt_rows
    from kstep.bench.self_spec import format_table, measure
    set_threads(args.threads)
    check_positive(args, "num_prompts")
    prompts = [row["prompt"] for row in prompt_rows(None, args.num_prompts)]
    rows = []
    for model in args.model or ["llada-coder", "default"]:
        rows += measure(model, prompts, positive_ints("--lengths", args.lengths),
                        positive_ints("--drafts", args.drafts), args.device, args.dtype, _progress, args.cache)
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_self_spec.json").write_text(json.dumps({"prompts": len(prompts), "rows": rows}, indent=2) + "\n")
    (out / "bench_self_spec.md").write_text(format_table(rows) + "\n")
    return 0
