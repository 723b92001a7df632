"""SDAR (JetAstra, arXiv:2510.06303): a Qwen3 network (per-head q/k RMSNorm before rotary, Qwen3
tensor names, explicit `head_dim`) trained as a block-diffusion model. config.json has
`architectures: ["SDARForCausalLM"]`, `block_size` and `mask_token_id`. Logits are not shifted: the
output at j predicts the token at j.
"""
from kstep.models import llama
from kstep.models.config import ModelConfig


def parse_config(raw: dict, family: str, attention: str) -> ModelConfig:
    cfg = llama.parse_config(raw, family, attention)
    cfg.qkv_bias = cfg.out_bias = bool(raw.get("attention_bias", False))  # Qwen3: all four or none
    cfg.qk_norm = True
    cfg.block_size = int(raw.get("block_size", 4))
    cfg.mask_token_id = raw.get("mask_token_id")
    return cfg


def checkpoint_names(cfg: ModelConfig) -> dict[str, str]:
    names = llama.checkpoint_names(cfg)
    for i in range(cfg.n_layers):
        for norm in ("q_norm", "k_norm"):
            names[f"layers.{i}.attn.{norm}.weight"] = f"model.layers.{i}.self_attn.{norm}.weight"
    return names


def to_raw_config(cfg: ModelConfig) -> dict:
    """config.json in SDAR's layout (for checkpoints kstep writes)."""
    return {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar", "block_size": cfg.block_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias, "tie_word_embeddings": cfg.tie_embeddings, "mask_token_id": cfg.mask_token_id,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        "pad_token_id": cfg.pad_token_id,
    }
