"""LLaMA and Qwen2 (autoregressive, causal) in the Hugging Face `LlamaForCausalLM` /
`Qwen2ForCausalLM` layouts. Qwen2 is LLaMA with q/k/v biases."""
from kstep.models.config import ModelConfig


def _rope(raw: dict) -> tuple[float, dict | None]:
    # transformers >= 5 nests theta and scaling in `rope_parameters`; older configs use top-level keys.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    params["rope_type"] = kind
    return theta, params


def _ids(value) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def parse_config(raw: dict, family: str, attention: str) -> ModelConfig:
    """Also Qwen2-named layouts (family "qwen2", "dream"): LLaMA with q/k/v biases."""
    is_qwen2 = family != "llama"
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={raw['hidden_act']!r} is not supported (expected 'silu')")
    if raw.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported")
    theta, scaling = _rope(raw)
    d_model, n_heads = raw["hidden_size"], raw["num_attention_heads"]
    tie = raw.get("tie_word_embeddings", False)
    return ModelConfig(
        family=family, attention=attention,
        vocab_size=raw["vocab_size"], embedding_size=raw["vocab_size"],
        d_model=d_model, n_layers=raw["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads, head_dim=raw.get("head_dim") or d_model // n_heads,
        ffn_dim=raw["intermediate_size"], norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=scaling, max_positions=raw.get("max_position_embeddings", 2048),
        qkv_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
        out_bias=False if is_qwen2 else bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)), tie_embeddings=bool(tie),
        bos_token_id=raw.get("bos_token_id"), pad_token_id=raw.get("pad_token_id"),
        eos_token_ids=tuple(_ids(raw.get("eos_token_id"))),
    )


def to_raw_config(cfg: ModelConfig) -> dict:
    """config.json as `LlamaForCausalLM` / `Qwen2ForCausalLM` write it (for checkpoints kstep writes)."""
    qwen2 = cfg.family == "qwen2"
    if cfg.family not in ("llama", "qwen2") or (not qwen2 and cfg.qkv_bias != cfg.out_bias) or \
            (qwen2 and (not cfg.qkv_bias or cfg.out_bias)):
        raise ValueError("kstep writes AR checkpoints in the LLaMA layout or Qwen2's (q/k/v biases only)")
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"], "model_type": cfg.family,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        **({} if qwen2 else {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}),
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids),
    }


def checkpoint_names(cfg: ModelConfig) -> dict[str, str]:
    """kstep parameter name -> checkpoint tensor name."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        names[f"layers.{i}.attn_norm.weight"] = p + "input_layernorm.weight"
        names[f"layers.{i}.mlp_norm.weight"] = p + "post_attention_layernorm.weight"
        for proj, has_bias in (("q_proj", cfg.qkv_bias), ("k_proj", cfg.qkv_bias), ("v_proj", cfg.qkv_bias),
                               ("o_proj", cfg.out_bias)):
            names[f"layers.{i}.attn.{proj}.weight"] = p + f"self_attn.{proj}.weight"
            if has_bias:
                names[f"layers.{i}.attn.{proj}.bias"] = p + f"self_attn.{proj}.bias"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"layers.{i}.mlp.{proj}.weight"] = p + f"mlp.{proj}.weight"
            if cfg.mlp_bias:
                names[f"layers.{i}.mlp.{proj}.bias"] = p + f"mlp.{proj}.bias"
    return names
