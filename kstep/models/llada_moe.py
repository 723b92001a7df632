"""LLaDA-MoE (inclusionAI, LLaDA-MoE-7B-A1B; `LLaDAMoEModelLM`): a masked diffusion model (full
bidirectional attention, LLaDA's samplers) on an OLMoE-style MoE network.

Reference: the checkpoint's remote code, `modeling_lladamoe.py` / `configuration_lladamoe.py`
(InfiniTensor/InfiniLM; ZHZisZZ/dllm `dllm/pipelines/llada/models/`, which honours a padding mask).
Its config.json has `model_type: "llada"`, the same string as dense LLaDA-8B: the registry tells
them apart by `architectures`, else by the MoE fields (`num_experts`). Its layout:
- q/k/v/o projections (biases when `attention_bias`), per-head q/k RMSNorm (`qk_layernorm`)
  before rotary, rotary on the first head_dim * `partial_rotary_factor` dims;
- `moe_layer_freq[i]`: 0 = a dense SwiGLU of `dense_intermediate_size`, 1 = MoE: `num_experts`
  experts of `expert_intermediate_size`, a softmax router (matmul in the model dtype, softmax in
  float32) keeping the top `num_experts_per_tok` probabilities without renormalising them
  (`norm_topk_prob` is hard-coded off), an expert bias added to the probabilities when
  `moe_router_enable_expert_bias` (so into the weights too); a shared expert of
  `shared_expert_intermediate_size` under the layer (`shared_expert`), added after routing;
- no logit shift; the reference ignores attention masks (kstep honours padding, as dllm's copy).
"""
from kstep.models.config import ModelConfig, MoEConfig
from kstep.models.llada2_moe import expert_names
from kstep.models.llama import _ids, _rope


def parse_config(raw: dict, family: str, attention: str) -> ModelConfig:
    if raw.get("clip_qkv") is not None:
        raise ValueError("config.json: clip_qkv is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={raw['hidden_act']!r} is not supported (expected 'silu')")
    d_model, n_heads, n_layers = raw["hidden_size"], raw["num_attention_heads"], raw["num_hidden_layers"]
    head_dim = d_model // n_heads
    freq = raw.get("moe_layer_freq") or [1] * n_layers
    if len(freq) != n_layers:
        raise ValueError(f"config.json: moe_layer_freq has {len(freq)} entries for {n_layers} layers")
    shared = raw.get("shared_expert_intermediate_size")
    partial = raw.get("partial_rotary_factor", 1.0)
    theta, scaling = _rope(raw)
    moe = MoEConfig(num_experts=raw["num_experts"], top_k=raw["num_experts_per_tok"],
                    expert_dim=raw["expert_intermediate_size"], router="softmax", renormalize=False,
                    has_bias=bool(raw.get("moe_router_enable_expert_bias")), shared_dim=shared or 0,
                    dense_layers=tuple(i for i, f in enumerate(freq) if f == 0), logits_in_float32=False)
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        family=family, attention=attention, vocab_size=raw["vocab_size"], embedding_size=raw["vocab_size"],
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=head_dim, ffn_dim=raw.get("dense_intermediate_size") or 4 * d_model,
        norm_eps=raw.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
        max_positions=raw.get("max_position_embeddings", 4096), qkv_bias=bias, out_bias=bias,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)), qk_norm=bool(raw.get("qk_layernorm")),
        rotary_dim=None if partial in (None, 1, 1.0) else int(head_dim * partial), moe=moe,
        mask_token_id=raw.get("mask_token_id"), bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"), eos_token_ids=tuple(_ids(raw.get("eos_token_id"))),
    )


def checkpoint_names(cfg: ModelConfig) -> dict:
    """kstep parameter name -> checkpoint tensor name, or the parts it is assembled from."""
    names: dict = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        p, ours = f"model.layers.{i}.", f"layers.{i}."
        names[ours + "attn_norm.weight"] = p + "input_layernorm.weight"
        names[ours + "mlp_norm.weight"] = p + "post_attention_layernorm.weight"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[ours + f"attn.{proj}.weight"] = p + f"self_attn.{proj}.weight"
            if cfg.qkv_bias:
                names[ours + f"attn.{proj}.bias"] = p + f"self_attn.{proj}.bias"
        if cfg.qk_norm:
            names[ours + "attn.q_norm.weight"] = p + "self_attn.q_norm.weight"
            names[ours + "attn.k_norm.weight"] = p + "self_attn.k_norm.weight"
        if not cfg.moe.is_sparse(i):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[ours + f"mlp.{proj}.weight"] = p + f"mlp.{proj}.weight"
            continue
        names.update(expert_names(cfg, ours + "mlp.", p + "mlp."))
        names[ours + "mlp.router.weight"] = p + "mlp.gate.weight"
        if cfg.moe.has_bias:
            names[ours + "mlp.router.bias"] = p + "mlp.expert_bias"
        if cfg.moe.shared_dim:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[ours + f"mlp.shared.{proj}.weight"] = p + f"shared_expert.{proj}.weight"
    return names


def to_raw_config(cfg: ModelConfig) -> dict:
    """config.json in the layout LLaDA-MoE checkpoints ship (for checkpoints kstep writes)."""
    moe = cfg.moe
    return {
        "architectures": ["LLaDAMoEModelLM"], "model_type": "llada",
        "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig",
                     "AutoModel": "modeling_lladamoe.LLaDAMoEModel",
                     "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"},
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "dense_intermediate_size": cfg.ffn_dim,
        "expert_intermediate_size": moe.expert_dim, "shared_expert_intermediate_size": moe.shared_dim or None,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "partial_rotary_factor": cfg.rotary_width / cfg.head_dim, "attention_bias": cfg.qkv_bias, "clip_qkv": None,
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "norm_topk_prob": False,
        "qk_layernorm": cfg.qk_norm, "moe_layer_freq": [0 if i in moe.dense_layers else 1 for i in range(cfg.n_layers)],
        "moe_router_enable_expert_bias": moe.has_bias, "moe_router_score_function": "softmax",
        "routed_scaling_factor": 1, "router_num_group": None, "router_topk_group": None,
        "tie_word_embeddings": cfg.tie_embeddings, "pad_token_id": cfg.pad_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None, "mask_token_id": cfg.mask_token_id,
    }
