"""The cost model behind `kstep bench compare`: bytes moved and FLOPs of each forward pass, and the
floor they put under its time on a device with a given memory bandwidth and matmul throughput.

A pass of b rows, T new tokens each, attending to S positions, with the LM head on R positions:
  FLOPs = 2 * (body weights a token uses) * bT  +  4 * S * (heads * head_dim) * layers * bT  +  2 * d * V * bR
  bytes = (body weights read + head) + (K and V read: 2 * S * kv_dim * layers * b, written: ... * bT)
          + activations (each layer's inputs/outputs: (6d + 3 ffn) * layers * bT) + logits (bR * V * 4)
  floor = max(bytes / bandwidth, FLOPs / matmul peak)
An AR generation of N tokens is a prefill (T = P) and N - 1 passes of T = 1; a diffusion
generation is K passes: the exact sampler's are full passes over prompt + N; with the dual cache,
one full pass per block and window passes of T = block_length against the cache. A block-diffusion
generation is a prompt prefill and K passes of one block against the exact cache of what precedes it.

An MoE model changes the bytes, not the FLOPs per token: a token runs its top_k experts, but a pass
reads every expert some token of it chose. An AR step reads k per sparse layer; a block pass reads
their union, most of the experts at 32 tokens, so a diffusion pass on an MoE model costs several AR
steps where on a dense model it costs about one.
"""
import time
from dataclasses import dataclass

import torch

from kstep.layers.linear import linear
from kstep.models import ModelConfig


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    bandwidth_gb_s: float            # memory bandwidth, GB/s
    matmul_tflops: float             # dense matmul throughput at the dtype used, TFLOP/s
    source: str                      # "measured" (calibration here) or "data sheet"


# Data-sheet figures (dense bf16 tensor throughput, HBM bandwidth): predictions, not measurements.
ACCELERATORS = {
    "a100-80gb": Device("A100 80GB SXM", 2039, 312, "data sheet"),
    "h100-sxm": Device("H100 SXM", 3350, 989, "data sheet"),
    "h200": Device("H200", 4800, 989, "data sheet"),
    "l40s": Device("L40S", 864, 362, "data sheet"),
}


@dataclass(frozen=True, slots=True)
class PassCost:
    flops: float
    bytes: float
    attention_flops: float = 0.0
    head_flops: float = 0.0

    def __add__(self, other: "PassCost") -> "PassCost":
        return PassCost(self.flops + other.flops, self.bytes + other.bytes,
                        self.attention_flops + other.attention_flops, self.head_flops + other.head_flops)

    def floor_seconds(self, device: Device) -> float:
        return max(self.bytes / (device.bandwidth_gb_s * 1e9), self.flops / (device.matmul_tflops * 1e12))


def body_params(cfg: ModelConfig) -> int:
    """Weights one token goes through (attention + MLP, an MoE layer's router, top_k experts and
    shared experts + norms), not the embedding or the head."""
    return cfg.body_params(active=True)


def expected_experts(cfg: ModelConfig, tokens: float) -> float:
    """Distinct experts one sparse layer of `cfg` reads for a pass of `tokens` (MoEConfig.expected_experts)."""
    return cfg.moe.expected_experts(tokens)


def body_bytes_read(cfg: ModelConfig, tokens: float, experts_read: float | None = None) -> float:
    """Weights a pass of `tokens` tokens reads from memory: all of a dense model's body; an MoE
    model's dense parts plus, per sparse layer, the union of the experts its tokens chose
    (`experts_read`: measured, else `expected_experts`)."""
    if cfg.moe is None:
        return cfg.body_params()
    union = expected_experts(cfg, tokens) if experts_read is None else experts_read
    sparse = sum(cfg.moe.is_sparse(i) for i in range(cfg.n_layers))
    per_expert = 3 * cfg.d_model * cfg.moe.expert_dim
    return cfg.body_params(active=True) + sparse * (union - cfg.moe.top_k) * per_expert


def pass_cost(cfg: ModelConfig, tokens: int, attended: int, logit_rows: int, rows: int = 1,
              dtype_bytes: int = 4, experts_read: float | None = None) -> PassCost:
    """One forward pass: `rows` sequences of `tokens` new tokens attending to `attended` positions,
    the LM head on `logit_rows` positions each (an MoE model reads the experts its tokens chose)."""
    bt, br = rows * tokens, rows * logit_rows
    body, head = body_params(cfg), cfg.d_model * cfg.vocab_size
    kv_width = 2 * cfg.n_kv_heads * cfg.head_dim * cfg.n_layers  # K and V, every layer, one position
    attention = 4 * attended * cfg.n_heads * cfg.head_dim * cfg.n_layers * bt
    head_flops = 2 * head * br
    flops = 2 * body * bt + attention + head_flops
    weights = (body_bytes_read(cfg, bt, experts_read) + head) * dtype_bytes
    kv = (rows * attended + bt) * kv_width * dtype_bytes
    activations = (6 * cfg.d_model + 3 * cfg.ffn_dim) * cfg.n_layers * bt * dtype_bytes
    logits = br * cfg.vocab_size * 4
    return PassCost(flops, weights + kv + activations + logits, attention, head_flops)


def ar_cost(cfg: ModelConfig, prompt_len: int, n: int, dtype_bytes: int = 4) -> PassCost:
    """Prefill, then N - 1 single-token passes (the N-th token needs no pass after it)."""
    total = pass_cost(cfg, prompt_len, prompt_len, 1, dtype_bytes=dtype_bytes)
    for i in range(1, n):
        total = total + pass_cost(cfg, 1, prompt_len + i, 1, dtype_bytes=dtype_bytes)
    return total


def diffusion_cost(cfg: ModelConfig, prompt_len: int, n: int, passes: float, block_length: int, cache: str,
                   dtype_bytes: int = 4, canvases_per_pass: float = 1.0) -> PassCost:
    """`passes` forward passes (K, may be a measured mean) decoding N tokens in blocks.
    cache none: every pass is full, of `canvases_per_pass` canvases (self-speculation verifies
    several: the weights are read once for all of them); prefix: one full pass per block, the rest
    run [block, end); dual: one full pass per block, the rest run the block alone."""
    length, blocks = prompt_len + n, max(1, n // block_length)
    full = pass_cost(cfg, length, length, block_length, canvases_per_pass, dtype_bytes=dtype_bytes)
    if cache == "none":
        return PassCost(*(passes * x for x in (full.flops, full.bytes, full.attention_flops, full.head_flops)))
    num_full = min(passes, blocks)
    total = PassCost(*(num_full * x for x in (full.flops, full.bytes, full.attention_flops, full.head_flops)))
    num_window = max(0.0, passes - num_full)
    if cache == "dual":
        window = pass_cost(cfg, block_length, length, block_length, dtype_bytes=dtype_bytes)
    else:  # prefix: on average the window is half the canvas after the prompt
        window = pass_cost(cfg, n // 2 + block_length // 2, length, block_length, dtype_bytes=dtype_bytes)
    return total + PassCost(*(num_window * x for x in (window.flops, window.bytes, window.attention_flops,
                                                       window.head_flops)))


def block_diffusion_cost(cfg: ModelConfig, prompt_len: int, n: int, passes: float, block_length: int,
                         dtype_bytes: int = 4, blocks_per_pass: float = 1.0) -> PassCost:
    """A prompt prefill, then `passes` passes of one block (T = block_length) attending to the prompt,
    the finished blocks and itself: P + start + block positions, P + (N + block) / 2 on average. A
    fused commit's pass also runs the finished block; counted as one block here, so this stays a floor.
    `blocks_per_pass`: self-speculation's passes run several drafted blocks, each on its own cache row."""
    prefill = pass_cost(cfg, prompt_len, prompt_len, 1, dtype_bytes=dtype_bytes)
    window = pass_cost(cfg, block_length, prompt_len + (n + block_length) / 2, block_length, blocks_per_pass,
                       dtype_bytes=dtype_bytes)
    return prefill + PassCost(*(passes * x for x in (window.flops, window.bytes, window.attention_flops,
                                                     window.head_flops)))


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seconds: float = 0.5) -> Device:
    """Measure this device: memory bandwidth (a large copy, STREAM's counting, or a read-only sum,
    the better) and matmul throughput (a square matmul through kstep's own projection kernel,
    kstep/layers/linear.py: what a pass can reach here, in this dtype), each the best of repeated
    runs for `seconds`."""
    device = torch.device(device)

    def best_of(fn) -> float:
        fn()
        best, deadline = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return best

    def bandwidth(nbytes: int) -> float:  # its arrays are freed before the matmul's are made
        """The best of STREAM's copy (bytes read + written) and a read-only sum (a pass's weights are
        only read, and a copy's write-allocate traffic is not counted): GB/s."""
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        return max(2 * nbytes / best_of(lambda: dst.copy_(src)), nbytes / best_of(src.sum)) / 1e9

    gb_s = bandwidth(256 * 1024 * 1024)  # 256 MiB, far beyond the caches
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)  # (out, in), through the kernel kstep's projections use
    with torch.inference_mode():
        mm_s = best_of(lambda: linear(a, b))
    name = "this CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    return Device(name, gb_s, 2 * n ** 3 / mm_s / 1e12, "measured")
