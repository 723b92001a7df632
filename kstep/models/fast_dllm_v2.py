"""Fast-dLLM v2 (NVlabs, arXiv:2509.26328): a Qwen2.5 network (q/k/v biases, Qwen2 tensor names)
converted into a block-diffusion model. config.json has `architectures:
["Fast_dLLM_QwenForCausalLM"]` and the block size as `bd_size`; the published config has no mask id
(its samplers default to `|<MASK>|`, read from the tokenizer by the loader), kstep writes one.

Logits stay shifted as in the AR parent: the token at j is read from the output at j - 1.
"""
from kstep.models import llama
from kstep.models.config import ModelConfig

checkpoint_names = llama.checkpoint_names


def parse_config(raw: dict, family: str, attention: str) -> ModelConfig:
    cfg = llama.parse_config(raw, family, attention)  # Qwen2: q/k/v biases
    cfg.block_size = int(raw.get("bd_size", 32))
    cfg.mask_token_id = raw.get("mask_token_id")
    return cfg


def to_raw_config(cfg: ModelConfig) -> dict:
    """config.json in Fast-dLLM v2's layout, plus `mask_token_id` (for checkpoints kstep writes)."""
    return {
        "architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen",
        "bd_size": cfg.block_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
        "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0,
        "mask_token_id": cfg.mask_token_id, "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
    }
