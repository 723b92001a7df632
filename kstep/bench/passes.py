"""`kstep bench passes`: what one forward pass costs at a model's real size, the premise of the cost
model measured where it should hold.

For each shape (kstep/shapes.py, random weights built in memory in the family's layout) and dtype,
batch 1, one after another in one process: the AR step (one token against a KV cache of
`context` positions), block passes of T = 4, 8, 16, 32 tokens against the same exact cache (block
diffusion), and window passes of T tokens attending to a whole canvas of `context` (LLaDA's dual
cache). Each as the median time, as a ratio to the AR step, as a fraction of its floor (the
weights and cache bytes over the copy bandwidth measured in the same run, the FLOPs over the
matmul throughput measured in the same run: cost_model.calibrate), and next to what the time-budget
planner predicts for it from its own calibration of the same model (budget.PassCosts). From the ratio r(T), a
diffusion model that fills tau tokens per pass of T ties AR at tau = r(T) and doubles it at 2 r(T).
"""
import statistics
import time

import torch

from kstep.bench.cost_model import pass_cost
from kstep.budget.planner import PassCosts
from kstep.layers.linear import pack_fused_weights
from kstep.random_checkpoint import random_config, random_parameters
from kstep.runner.model_runner import ModelRunner
from kstep.shapes import shape_sizes
from kstep.weights import build_model

BLOCKS = (4, 8, 16, 32)
BUNDLED_SIZES = {  # the bundled pair's sizes (3.3M) and a 60M dense shape, below the published ones
    "bundled-3m": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=6, ffn_dim=512, vocab_size=4096),
    "dense-60m": dict(d_model=512, n_layers=12, n_heads=8, n_kv_heads=8, ffn_dim=1536, vocab_size=16384),
}


def sizes_of(shape: str) -> dict:
    return dict(BUNDLED_SIZES[shape]) if shape in BUNDLED_SIZES else shape_sizes(shape)


def random_model(family: str, shape: str, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """A model of `shape` in `family`'s layout with random weights, built in place (no checkpoint)."""
    sizes = sizes_of(shape)
    cfg = random_config(family, sizes.pop("vocab_size"), **sizes)
    cfg.max_positions = max(cfg.max_positions, 4096)
    model = build_model(cfg, device, dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in random_parameters(cfg, seed):
            params[name].copy_(value)
    model.fuse_projections()
    pack_fused_weights(model)  # as kstep.load does (kstep/loading.py)
    return model


def median_seconds(runner: ModelRunner, make_pass, repeats: int) -> float:
    runner.execute([make_pass()])  # warm-up
    runs = []
    for _ in range(repeats):
        p = make_pass()
        start = time.perf_counter()
        runner.execute([p])
        runner.synchronize()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def pass_makers(runner: ModelRunner, context: int, kv) -> dict:
    """kind -> T -> a function building that pass (fresh tensors, same cache)."""
    device, vocab = runner.device, runner.cfg.vocab_size
    real = torch.ones(1, context + 64, dtype=torch.bool, device=device)

    def ar():
        ids = torch.randint(0, vocab, (1, 1), device=device)
        return runner.causal_pass(ids, torch.tensor([[context]], device=device), None, context, kv)

    def block(t):
        def make():
            ids = torch.randint(0, vocab, (1, t), device=device)
            positions = context + torch.arange(t, device=device)[None]
            return runner.ragged_causal_pass(ids, positions, torch.tensor([context], device=device), real, kv,
                                             is_causal=False, kind="block", block_size=t)
        return make

    def window(t):
        def make():
            ids = torch.randint(0, vocab, (1, context), device=device)
            start = context - 2 * t
            return runner.window_pass(ids, None, start, start + t, context, t, kv)
        return make

    return {"ar": {1: ar}, "block": {t: block(t) for t in BLOCKS}, "window": {t: window(t) for t in BLOCKS}}


def scattered_cache(runner: ModelRunner, length: int):
    """A one-row cache of `length` slots on every other page of the pool (page tables that are no
    run: attention gathers what it reads, kstep/layers/paged_kv.py), as a fragmented pool gives."""
    pool = runner.kv_pool or runner.make_kv_pool()
    singles = [runner.allocate_kv(1, pool.page_tokens) for _ in range(pool.pages.num_free)]
    del singles[::2]  # the rest stay held as long as the cache lives
    kv = runner.allocate_kv(1, length)
    assert not kv.is_view, "the pool gave a run"
    kv.fillers = singles
    return kv


@torch.inference_mode()
def measure_shape(family: str, shape: str, dtype: torch.dtype, context: int, repeats: int, measured,
                  device: str = "cpu", progress=print, pages: str = "run") -> list[dict]:
    """Every pass kind of one shape on `device`; `measured`: that device's calibration in this run
    (cost_model.calibrate), every row's floor. `pages`: the cache's pages one run (read as a view) or
    scattered (gathered)."""
    model = random_model(family, shape, dtype, device)
    runner = ModelRunner(model)
    cfg = model.cfg
    kv = scattered_cache(runner, context + 64) if pages == "scattered" else runner.allocate_kv(1, context + 64)
    rows, ar_seconds = [], None
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    planner = PassCosts(experts=cfg.moe.expected_experts if cfg.moe else None)
    planner.calibrate(model, runner.device, cfg.max_positions)  # the time-budget planner's own table
    for kind, makers in pass_makers(runner, context, kv).items():
        for t, make in makers.items():
            seconds = median_seconds(runner, make, repeats)
            if kind == "ar":
                ar_seconds = seconds
            attended = context + (t if kind == "block" else 0)
            cost = pass_cost(cfg, t, attended, t, dtype_bytes=dtype_bytes)
            floor = cost.floor_seconds(measured)
            bound = "memory" if cost.bytes / (measured.bandwidth_gb_s * 1e9) >= cost.flops / (measured.matmul_tflops * 1e12) \
                else "compute"
            row = {"family": family, "shape": shape, "params": cfg.num_params, "dtype": str(dtype).removeprefix("torch."),
                   "pages": pages,
                   "kind": kind, "tokens": t, "context": context, "ms": seconds * 1e3,
                   "over_ar": seconds / ar_seconds, "floor_ms": floor * 1e3, "of_floor": floor / seconds,
                   "bound": bound, "bytes": cost.bytes, "flops": cost.flops,
                   "bandwidth_gb_s": measured.bandwidth_gb_s, "matmul_tflops": measured.matmul_tflops,
                   "planned_ms": planner.predict(t, attended) * 1e3}
            row["planned_error"] = row["planned_ms"] / row["ms"] - 1
            rows.append(row)
            progress(format_row(row))
    return rows


def format_row(r: dict) -> str:
    pages = " (pages scattered)" if r.get("pages") == "scattered" else ""
    return (f"| {r['family']} {r['shape']} ({r['params'] / 1e6:.0f}M){pages} | {r['dtype']} | {r['kind']} | {r['tokens']} | "
            f"{r['ms']:.2f} | {r['over_ar']:.2f}x | {r['floor_ms']:.2f} ({r['bound']}) | {r['of_floor']:.0%} | "
            f"{r['planned_ms']:.2f} ({r['planned_error']:+.0%}) |")


def format_table(rows: list[dict]) -> str:
    lines = ["| shape | dtype | pass | tokens | ms | / AR step | floor ms | of floor | time-budget planner's ms |",
             "|---|---|---|---|---|---|---|---|---|",
             *map(format_row, rows), "", "| shape | dtype | tokens per pass to tie AR (block T = 4 / 8 / 16 / 32) "
             "| to double AR |", "|---|---|---|---|"]
    for family, shape, dtype in dict.fromkeys((r["family"], r["shape"], r["dtype"]) for r in rows):
        blocks = [r for r in rows if (r["family"], r["shape"], r["dtype"]) == (family, shape, dtype)
                  and r["kind"] == "block" and r.get("pages", "run") == "run"]
        tie = " / ".join(f"{r['over_ar']:.2f}" for r in blocks)
        double = " / ".join(f"{2 * r['over_ar']:.2f}" for r in blocks)
        lines.append(f"| {family} {shape} | {dtype} | {tie} | {double} |")
    return "\n".join(lines)


def plot_ratio(rows: list[dict], path) -> None:
    """The block pass of 8 and of 32 over the AR step, against parameters, per dtype."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for t, style in ((8, "o-"), (32, "s--")):
            points = sorted((r["params"], r["over_ar"]) for r in rows
                            if r["dtype"] == dtype and r["kind"] == "block" and r["tokens"] == t)
            if points:
                ax.plot(*zip(*points), style, label=f"block pass of {t} / AR step, {dtype}")
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("pass time / AR step time")
    ax.set_title("Where a refinement pass becomes about as cheap as an AR step (this CPU, batch 1)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
