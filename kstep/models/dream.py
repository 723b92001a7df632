"""Dream-v0 (HKUNLP, arXiv:2508.15487): a Qwen2 network (q/k/v biases, Qwen2 tensor names) run with
bidirectional attention, trained from Qwen2.5 as a masked-diffusion model. config.json carries
`architectures: ["DreamModel"]`, `model_type: "Dream"` and the special ids (`mask_token_id`, ...);
Dream's sampler defaults live in generation_config.json (read by the decoder's family entry).

Dream keeps the AR model's logit shift: position i's logits predict token i + 1 (the decoder asks
the runner for the right columns). No remote code is executed: the layout is read as data.
"""
from kstep.models import llama
from kstep.models.config import ModelConfig

checkpoint_names = llama.checkpoint_names


def parse_config(raw: dict, family: str, attention: str) -> ModelConfig:
    cfg = llama.parse_config(raw, family, attention)
    cfg.mask_token_id = raw.get("mask_token_id")
    return cfg


def to_raw_config(cfg: ModelConfig) -> dict:
    """config.json in Dream-v0's layout (for checkpoints kstep writes)."""
    return {
        "architectures": ["DreamModel"], "model_type": "Dream",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "use_sliding_window": False, "sliding_window": None,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": False,
        "mask_token_id": cfg.mask_token_id, "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
    }
