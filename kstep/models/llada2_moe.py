"""LLaDA2.0 / LLaDA2.1 (inclusionAI; `LLaDA2MoeModelLM`, model_type `llada2_moe`): a Ling-2.0 MoE
network trained as a block-diffusion model (bidirectional inside blocks of 32, causal across).

Reference: the checkpoint's remote code, `modeling_llada2_moe.py` / `configuration_llada2_moe.py`
(vendored in ZHZisZZ/dllm `dllm/pipelines/llada2/models/`, and `llada21/` for 2.1, the same
network). Its layout:
- a fused `attention.query_key_value` ([H + 2 Hkv] heads of head_dim rows: q, then k, then v),
  per-head q/k RMSNorm (`query_layernorm`, `key_layernorm`) before rotary, `attention.dense` out;
- partial rotary: the first head_dim * partial_rotary_factor (0.5) dims of a head rotate,
  half-split within them;
- the first `first_k_dense_replace` layers have a dense SwiGLU of `intermediate_size`; the rest are
  MoE: `num_experts` experts of `moe_intermediate_size`, a sigmoid router with an expert bias
  (`gate.expert_bias`, for selection only), group-limited top-k, renormalised, scaled by
  `routed_scaling_factor`, plus `num_shared_experts` shared experts as one SwiGLU;
- no logit shift: the output at j predicts the token at j.
The released config.json names neither the mask nor the end id: the loader finds the mask token in
the tokenizer (`<|mask|>`), the end id in the tokenizer's `eos_token` / `<|endoftext|>`. Config
class defaults apply to absent keys (`use_bias` true, `use_qk_norm` true, `partial_rotary_factor` 0.5).
"""
from kstep.models.config import ModelConfig, MoEConfig
from kstep.models.llama import _ids, _rope
from kstep.models.parts import Part

DEFAULT_BLOCK_SIZE = 32  # the reference generate()'s block_length (not in config.json)


def parse_config(raw: dict, family: str, attention: str) -> ModelConfig:
    for key in ("use_sliding_window", "norm_head"):
        if raw.get(key):
            raise ValueError(f"config.json: {key}=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={raw['hidden_act']!r} is not supported (expected 'silu')")
    d_model, n_heads = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or d_model // n_heads
    theta, scaling = _rope(raw)
    num_experts = raw.get("num_experts")
    moe = None
    if num_experts:
        shared = raw.get("num_shared_experts") or 0
        moe = MoEConfig(num_experts=num_experts, top_k=raw.get("num_experts_per_tok", 2),
                        expert_dim=raw["moe_intermediate_size"], router="sigmoid_grouped",
                        n_group=raw.get("n_group", 8), topk_group=raw.get("topk_group", 4),
                        scaling=raw.get("routed_scaling_factor", 2.5), has_bias=True,
                        shared_dim=raw["moe_intermediate_size"] * shared,
                        dense_layers=tuple(range(raw.get("first_k_dense_replace", 0))))
    return ModelConfig(
        family=family, attention=attention, vocab_size=raw["vocab_size"], embedding_size=raw["vocab_size"],
        d_model=d_model, n_layers=raw["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        ffn_dim=raw.get("intermediate_size") or 4 * d_model, norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=theta, rope_scaling=scaling, max_positions=raw.get("max_position_embeddings", 16384),
        qkv_bias=bool(raw.get("use_qkv_bias", False)), out_bias=bool(raw.get("use_bias", True)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)), qk_norm=bool(raw.get("use_qk_norm", True)),
        rotary_dim=int(head_dim * raw.get("partial_rotary_factor", 0.5)), moe=moe,
        block_size=int(raw.get("block_size", DEFAULT_BLOCK_SIZE)), mask_token_id=raw.get("mask_token_id"),
        bos_token_id=raw.get("bos_token_id"), pad_token_id=raw.get("pad_token_id"),
        eos_token_ids=tuple(_ids(raw.get("eos_token_id"))),
    )


def checkpoint_names(cfg: ModelConfig) -> dict:
    """kstep parameter name -> checkpoint tensor name, or the parts it is assembled from."""
    names: dict = {"embed.weight": "model.word_embeddings.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    spans = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    for i in range(cfg.n_layers):
        p, ours = f"model.layers.{i}.", f"layers.{i}."
        names[ours + "attn_norm.weight"] = p + "input_layernorm.weight"
        names[ours + "mlp_norm.weight"] = p + "post_attention_layernorm.weight"
        for proj, rows in spans.items():
            names[ours + f"attn.{proj}.weight"] = [Part(p + "attention.query_key_value.weight", rows=rows)]
            if cfg.qkv_bias:
                names[ours + f"attn.{proj}.bias"] = [Part(p + "attention.query_key_value.bias", rows=rows)]
        names[ours + "attn.o_proj.weight"] = p + "attention.dense.weight"
        if cfg.out_bias:
            names[ours + "attn.o_proj.bias"] = p + "attention.dense.bias"
        if cfg.qk_norm:
            names[ours + "attn.q_norm.weight"] = p + "attention.query_layernorm.weight"
            names[ours + "attn.k_norm.weight"] = p + "attention.key_layernorm.weight"
        if cfg.moe is None or not cfg.moe.is_sparse(i):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[ours + f"mlp.{proj}.weight"] = p + f"mlp.{proj}.weight"
            continue
        names.update(expert_names(cfg, ours + "mlp.", p + "mlp."))
        names[ours + "mlp.router.weight"] = p + "mlp.gate.weight"
        names[ours + "mlp.router.bias"] = p + "mlp.gate.expert_bias"
        if cfg.moe.shared_dim:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[ours + f"mlp.shared.{proj}.weight"] = p + f"mlp.shared_experts.{proj}.weight"
    return names


def expert_names(cfg: ModelConfig, ours: str, theirs: str) -> dict:
    """Stacked experts from per-expert tensors `{theirs}experts.{e}.{gate,up,down}_proj.weight`
    ([I, D], [I, D], [D, I]), as Hugging Face MoE checkpoints ship them."""
    I = cfg.moe.expert_dim
    gate_up, down = [], []
    for e in range(cfg.moe.num_experts):
        expert = f"{theirs}experts.{e}."
        gate_up += [Part(expert + "gate_proj.weight", index=(e, slice(None), slice(0, I)), transpose=True),
                    Part(expert + "up_proj.weight", index=(e, slice(None), slice(I, 2 * I)), transpose=True)]
        down.append(Part(expert + "down_proj.weight", index=(e,), transpose=True))
    return {ours + "experts.gate_up": gate_up, ours + "experts.down": down}


def to_raw_config(cfg: ModelConfig) -> dict:
    """config.json in the layout the LLaDA2 checkpoints ship (for checkpoints kstep writes)."""
    moe = cfg.moe
    raw = {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "use_qkv_bias": cfg.qkv_bias, "use_bias": cfg.out_bias, "use_qk_norm": cfg.qk_norm,
        "rms_norm_eps": cfg.norm_eps, "norm_head": False, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_positions, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "partial_rotary_factor": cfg.rotary_width / cfg.head_dim, "use_sliding_window": False,
        "pad_token_id": cfg.pad_token_id, "output_router_logits": False,
        "num_experts": moe.num_experts if moe else None,
    }
    if moe:
        raw.update({"num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_dim,
                    "num_shared_experts": moe.shared_dim // moe.expert_dim, "n_group": moe.n_group,
                    "topk_group": moe.topk_group, "routed_scaling_factor": moe.scaling,
                    "first_k_dense_replace": len(moe.dense_layers), "score_function": "sigmoid",
                    "moe_router_enable_expert_bias": True, "router_dtype": "fp32", "norm_topk_prob": True})
    return raw
