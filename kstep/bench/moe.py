"""`kstep bench moe`: what a sparse MoE layer costs per pass, and what that does to diffusion.

1. The layer (kstep/layers/moe.py) at a model's shape, for passes of T tokens: its time against the
   same FLOPs done densely (one SwiGLU as wide as top_k experts plus the shared ones, on the same T
   tokens), and the distinct experts the pass read (the router's real choices; random weights, so
   close to uniform), next to the cost model's uniform expectation E (1 - (1 - k/E)^T). Both sides
   run in the same process, one after the other, median of repeats.
2. The floors (cost model, data-sheet accelerators, bf16) for the published shapes: an AR step
   against a block pass of T tokens, so the tokens per pass a diffusion model needs to tie AR on an
   MoE model, next to a dense model of the same active size.
"""
import statistics
import time

import torch

from kstep.bench.cost_model import ACCELERATORS, expected_experts, pass_cost
from kstep.layers.mlp import SwiGLU
from kstep.layers.moe import RouterSpec, SparseMoE
from kstep.random_checkpoint import random_config
from kstep.shapes import shape_sizes

FLOOR_SHAPES = (("llada2-mini", "llada2_moe"), ("lladamoe-7b", "llada_moe"), ("qwen2.5-1.5b", "llama"))


def shape_config(name: str, family: str):
    """A published shape's config in `family`'s layout; `tiny`: the test checkpoints' sizes."""
    sizes = {"vocab_size": 500} if name == "tiny" else shape_sizes(name)
    return random_config(family, sizes.pop("vocab_size"), **sizes)


def layer_pair(cfg, dtype: torch.dtype, seed: int = 0) -> tuple[SparseMoE, SwiGLU]:
    """One sparse layer of `cfg` and the dense SwiGLU with its per-token FLOPs, random weights."""
    moe = cfg.moe
    spec = RouterSpec(moe.router, moe.top_k, moe.renormalize, moe.n_group, moe.topk_group, moe.scaling, moe.has_bias)
    torch.manual_seed(seed)
    sparse = SparseMoE(cfg.d_model, moe.num_experts, moe.expert_dim, spec, moe.shared_dim, moe.logits_in_float32)
    dense = SwiGLU(cfg.d_model, moe.top_k * moe.expert_dim + moe.shared_dim, bias=False)
    for module in (sparse, dense):
        for name, p in module.named_parameters():
            with torch.no_grad():
                p.normal_(0, cfg.d_model ** -0.5) if p.dim() > 1 else p.uniform_(-0.05, 0.05)
    sparse, dense = sparse.to(dtype).eval(), dense.to(dtype).eval()
    if sparse.router.bias is not None:
        sparse.router.bias.data = sparse.router.bias.data.float()
    sparse.fuse()
    dense.fuse()
    return sparse, dense


def seconds_of(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


@torch.inference_mode()
def run_layer_bench(shapes: list[tuple[str, str]], tokens: list[int], dtypes: list[torch.dtype], repeats: int,
                    progress=print) -> list[dict]:
    rows = []
    for name, family in shapes:
        cfg = shape_config(name, family)
        for dtype in dtypes:
            sparse, dense = layer_pair(cfg, dtype)
            for t in tokens:
                x = torch.randn(t, cfg.d_model, dtype=dtype)
                sparse.keep_routing = True
                sparse(x)
                distinct = int(sparse.last_routing.expert_ids.unique().numel())
                sparse.keep_routing = False
                moe_s, dense_s = seconds_of(lambda: sparse(x), repeats), seconds_of(lambda: dense(x), repeats)
                row = {"shape": name, "dtype": str(dtype).removeprefix("torch."), "tokens": t,
                       "moe_ms": moe_s * 1e3, "dense_flops_ms": dense_s * 1e3, "ratio": moe_s / dense_s,
                       "experts_read": distinct, "experts_expected": expected_experts(cfg, t),
                       "num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k}
                rows.append(row)
                progress(format_layer_row(row))
    return rows


def floor_table(gpus: list[str], tokens: list[int], context: int = 768) -> list[dict]:
    """bf16 floors of an AR step and of a block pass of T tokens (both attending to `context`
    positions) for the published shapes, per accelerator."""
    rows = []
    for name, family in FLOOR_SHAPES:
        cfg = shape_config(name, family)
        for gpu in gpus:
            device = ACCELERATORS[gpu]
            ar = pass_cost(cfg, 1, context, 1, dtype_bytes=2).floor_seconds(device)
            for t in tokens:
                block = pass_cost(cfg, t, context, t, dtype_bytes=2).floor_seconds(device)
                rows.append({"shape": name, "params_b": cfg.num_params / 1e9, "active_b": cfg.num_active_params / 1e9,
                             "gpu": device.name, "tokens": t, "ar_step_ms": ar * 1e3, "block_pass_ms": block * 1e3,
                             "pass_over_step": block / ar,
                             "experts_read": expected_experts(cfg, t) if cfg.moe else None})
    return rows


def format_layer_row(r: dict) -> str:
    return (f"| {r['shape']} | {r['dtype']} | {r['tokens']} | {r['moe_ms']:.2f} | {r['dense_flops_ms']:.2f} | "
            f"{r['ratio']:.2f} | {r['experts_read']} / {r['num_experts']} (uniform: {r['experts_expected']:.0f}) |")


def format_report(layer_rows: list[dict], floors: list[dict]) -> str:
    lines = ["| shape | dtype | tokens | MoE layer ms | same FLOPs dense ms | MoE / dense | experts read |",
             "|---|---|---|---|---|---|---|", *map(format_layer_row, layer_rows), "",
             "| shape | total / active params | GPU | tokens per pass | AR step ms | block pass ms | pass / step "
             "| experts read per layer |", "|---|---|---|---|---|---|---|---|"]
    for r in floors:
        experts = "dense" if r["experts_read"] is None else f"{r['experts_read']:.0f}"
        lines.append(f"| {r['shape']} | {r['params_b']:.1f}B / {r['active_b']:.2f}B | {r['gpu']} | {r['tokens']} | "
                     f"{r['ar_step_ms']:.3f} | {r['block_pass_ms']:.3f} | {r['pass_over_step']:.2f} | {experts} |")
    return "\n".join(lines)
