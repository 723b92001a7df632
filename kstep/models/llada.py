"""LLaDA (masked diffusion, bidirectional): LLaDA-8B's config.json keys and OLMo parameter names.

Reference: GSAI-ML/LLaDA-8B `configuration_llada.py` / `modeling_llada.py` (LLaDALlamaBlock:
separate q/k/v, `ff_proj` is the SiLU-gated branch, `up_proj` the linear one, `ff_out` the down
projection; `model.transformer.ff_out` is the untied LM head).
"""
from kstep.models.config import ModelConfig

# Settings of the OLMo config that kstep's blocks do not implement, with the value they must have.
_REQUIRED = {"block_type": ("llama",), "activation_type": ("silu",), "layer_norm_type": ("rms",),
             "alibi": (False,), "rope": (True,), "attention_layer_norm": (False,),
             "multi_query_attention": (None, False)}


def parse_config(raw: dict, family: str, attention: str) -> ModelConfig:
    for key, allowed in _REQUIRED.items():
        if key in raw and raw[key] not in allowed:
            raise ValueError(f"config.json: {key}={raw[key]!r} is not supported (expected {allowed[0]!r})")
    d_model, n_heads = raw["d_model"], raw["n_heads"]
    eos = raw.get("eos_token_id")
    return ModelConfig(
        family=family, attention=attention,
        vocab_size=raw["vocab_size"], embedding_size=raw.get("embedding_size") or raw["vocab_size"],
        d_model=d_model, n_layers=raw["n_layers"], n_heads=n_heads,
        n_kv_heads=raw.get("n_kv_heads") or n_heads, head_dim=d_model // n_heads,
        ffn_dim=raw.get("mlp_hidden_size") or raw.get("mlp_ratio", 4) * d_model,
        norm_eps=raw.get("rms_norm_eps", 1e-5), rope_theta=raw.get("rope_theta", 10000.0),
        max_positions=raw.get("max_sequence_length", 4096),
        qkv_bias=bool(raw.get("include_bias") or raw.get("include_qkv_bias")),
        out_bias=bool(raw.get("include_bias")), mlp_bias=bool(raw.get("include_bias")),
        tie_embeddings=bool(raw.get("weight_tying", False)),
        embed_scale=d_model ** 0.5 if raw.get("input_emb_norm") else 1.0,
        logits_scale=d_model ** -0.5 if raw.get("scale_logits") else 1.0,
        mask_token_id=raw.get("mask_token_id"), bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
    )


def to_raw_config(cfg: ModelConfig) -> dict:
    """config.json in the layout the LLaDA checkpoints ship (for checkpoints kstep writes)."""
    if cfg.qkv_bias or cfg.out_bias or cfg.mlp_bias or cfg.embed_scale != 1.0 or cfg.logits_scale != 1.0:
        raise ValueError("kstep writes LLaDA checkpoints without biases or embedding/logit scaling")
    return {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "d_model": cfg.d_model, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "n_layers": cfg.n_layers,
        "mlp_hidden_size": cfg.ffn_dim, "mlp_ratio": cfg.ffn_dim // cfg.d_model,
        "vocab_size": cfg.vocab_size, "embedding_size": cfg.embedding_size,
        "mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
        "rope": True, "rope_theta": cfg.rope_theta, "rope_full_precision": True, "rms_norm_eps": cfg.norm_eps,
        "max_sequence_length": cfg.max_positions, "weight_tying": cfg.tie_embeddings,
        "include_bias": False, "include_qkv_bias": False, "input_emb_norm": False, "scale_logits": False,
        "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "alibi": False,
        "attention_layer_norm": False, "multi_query_attention": None, "use_cache": False,
    }


def checkpoint_names(cfg: ModelConfig) -> dict[str, str]:
    """kstep parameter name -> checkpoint tensor name."""
    names = {"embed.weight": "model.transformer.wte.weight", "norm.weight": "model.transformer.ln_f.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "model.transformer.ff_out.weight"
    parts = {"attn_norm.weight": "attn_norm.weight", "mlp_norm.weight": "ff_norm.weight",
             "attn.q_proj": "q_proj", "attn.k_proj": "k_proj", "attn.v_proj": "v_proj", "attn.o_proj": "attn_out",
             "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out"}
    for i in range(cfg.n_layers):
        for ours, theirs in parts.items():
            prefix = f"model.transformer.blocks.{i}."
            if ours.endswith(".weight"):
                names[f"layers.{i}.{ours}"] = prefix + theirs
                continue
            names[f"layers.{i}.{ours}.weight"] = prefix + theirs + ".weight"
            has_bias = cfg.qkv_bias if ours.split(".")[1] in ("q_proj", "k_proj", "v_proj") else \
                cfg.out_bias if ours == "attn.o_proj" else cfg.mlp_bias
            if has_bias:
                names[f"layers.{i}.{ours}.bias"] = prefix + theirs + ".bias"
    return names
