"""The cost model of uniform diffusion (DiffusionGemma) for `kstep bench compare`: FLOPs and bytes of
its passes (bench/cost_model.py's PassCost, the same floor).

A decoding of N tokens in canvases of L: a prefill (T = P, causal), then `passes` in all (measured:
how many decoder passes a canvas takes is data-dependent), of which C - 1 are commits (T = L, causal,
no head) and the rest decoder passes (T = L, the head on all L, plus the self-conditioning signal:
softmax(logits) @ E and its MLP), each against [prefix; canvas]: full layers attend to the whole
prefix, sliding layers to at most W - 1 prefix tokens.

The MoE block reads the weights of the union of experts its tokens chose: with T tokens routed
independently and uniformly to k of E experts, E * (1 - (1 - k/E)^T) of them (an upper bound for a
real router's skewed choices; MoEConfig.expected_experts); its FLOPs are k experts per token. The dense weights (attention, the
dense MLP, the router) are read once per pass, the embedding once (head and soft embedding).
"""
from kstep.bench.cost_model import PassCost
from kstep.models.diffusion_gemma import DiffusionGemmaConfig
from kstep.models.diffusion_gemma_layers import SLIDING


def gemma_pass_cost(cfg: DiffusionGemmaConfig, tokens: int, prefix: float, is_decoder: bool, rows: int = 1,
                    dtype_bytes: int = 4) -> PassCost:
    """One pass of `rows` sequences of `tokens` tokens after `prefix` cached positions; a decoder pass
    has the head and the self-conditioning signal on every token."""
    D, V, F, moe = cfg.d_model, cfg.vocab_size, cfg.ffn_dim, cfg.moe
    bt = rows * tokens
    expert = 3 * D * moe.expert_dim
    union = moe.expected_experts(bt)  # per layer
    dense = attention = kv = 0.0
    for kind, hd, kv_heads in zip(cfg.layer_types, cfg.layer_head_dims, cfg.layer_kv_heads):
        dense += D * hd * (2 * cfg.n_heads + (2 if kind == SLIDING else 1) * kv_heads) + 3 * D * F + D * moe.num_experts
        seen = (min(prefix, cfg.sliding_window - 1) if kind == SLIDING else prefix) + tokens
        attention += 4 * seen * cfg.n_heads * hd * bt
        kv += (rows * seen + bt) * 2 * kv_heads * hd
    sc = 3 * D * F if is_decoder else 0  # the self-conditioning MLP's weights
    head_flops = 2 * D * V * bt * (2 if is_decoder else 0)  # the head and softmax(logits) @ E
    flops = 2 * (dense + sc) * bt + 2 * cfg.n_layers * bt * moe.top_k * expert + attention + head_flops
    weights = (dense + sc + cfg.n_layers * union * expert + D * V) * dtype_bytes
    activations = (8 * D + 3 * F + 3 * moe.top_k * moe.expert_dim) * cfg.n_layers * bt * dtype_bytes
    logits = bt * V * 4 if is_decoder else 0
    return PassCost(flops, weights + kv * dtype_bytes + activations + logits, attention, head_flops)


def uniform_diffusion_cost(cfg: DiffusionGemmaConfig, prompt_len: int, n: int, passes: float,
                           dtype_bytes: int = 4) -> PassCost:
    """A decoding of N tokens in `passes` forward passes (prefill, commits and decoder passes: the nfe)."""
    L = cfg.canvas_length
    canvases = max(1, -(-n // L))
    prefix = prompt_len + (canvases - 1) * L / 2  # the mean over canvases
    total = gemma_pass_cost(cfg, prompt_len, 0, False, dtype_bytes=dtype_bytes)
    commit = gemma_pass_cost(cfg, L, prefix, False, dtype_bytes=dtype_bytes)
    decode = gemma_pass_cost(cfg, L, prefix, True, dtype_bytes=dtype_bytes)
    decoder_passes = max(0.0, passes - canvases)
    for count, cost in ((canvases - 1, commit), (decoder_passes, decode)):
        total = total + PassCost(*(count * x for x in (cost.flops, cost.bytes, cost.attention_flops, cost.head_flops)))
    return total
