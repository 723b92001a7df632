"""Nemotron-Labs-Diffusion (NVIDIA, 3B/8B/14B; arXiv 2607.05722): one Ministral 3 network that
decodes in three modes by switching its attention (the checkpoint's remote code,
`modeling_nemotron_labs_diffusion.py` + `modeling_ministral.py`, is never run here):
causal passes for AR decoding, for the prompt and for the passes that write the cache; bidirectional
passes that denoise a block against that cache; and self-speculation, which drafts a block
bidirectionally and verifies it causally (registry.py picks the decoder per request, `mode`).

config.json (`model_type: "nemotron_labs_diffusion"`, `architectures: ["NemotronLabsDiffusionModel"]`):
Ministral 3's keys (GQA 32/8 heads of 128, `rope_parameters` with YaRN and `llama_4_scaling_beta`:
queries scaled by 1 + beta log(1 + floor(position / original_max_position_embeddings))), plus
`mask_token_id` (100), `block_size` (32) and `dlm_paradigm` ("bidirectional"). Tensors: `encoder.*` (a
Ministral3Model: `encoder.embed_tokens`, `encoder.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `encoder.norm`) and the untied LM head
`diffusion_head`. The optional `linear_spec_lora/` adapter (a LoRA on o_proj for the drafts) is not read.
"""
from kstep.models import llama
from kstep.models.config import ModelConfig

ARCHITECTURE, MODEL_TYPE = "NemotronLabsDiffusionModel", "nemotron_labs_diffusion"
# The remote code's paradigms: "autoregressive" only changes the attention its training forward
# defaults to; every decoding method sets the attention itself. "block_diff" runs a FlexAttention
# mask of the two-stream training sequence even at inference, which kstep does not implement.
PARADIGMS = ("bidirectional", "autoregressive")
# The released configs' rope parameters (all sizes): YaRN x16 over 16384 positions, Llama 4 scaling 0.1.
ROPE = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
ROPE_THETA = 1_000_000.0


def parse_config(raw: dict, family: str, attention: str) -> ModelConfig:
    paradigm = raw.get("dlm_paradigm", "bidirectional")
    if paradigm not in PARADIGMS:
        raise ValueError(f"config.json: dlm_paradigm={paradigm!r} is not supported (expected one of "
                         f"{', '.join(PARADIGMS)})")
    if raw.get("sliding_window") is not None:
        raise ValueError("config.json: sliding_window is not supported (the released checkpoints have none)")
    cfg = llama.parse_config(raw, family, attention)
    if cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn":  # transformers' default for it
        cfg.rope_scaling.setdefault("original_max_position_embeddings", cfg.max_positions)
    cfg.qkv_bias = cfg.out_bias = bool(raw.get("attention_bias", False))  # Ministral 3: the LLaMA rule
    cfg.mask_token_id = raw.get("mask_token_id")
    cfg.block_size = int(raw.get("block_size", 32))
    return cfg


def checkpoint_names(cfg: ModelConfig) -> dict[str, str]:
    """kstep parameter name -> checkpoint tensor name: LLaMA's, under `encoder.`, head `diffusion_head`."""
    names = llama.checkpoint_names(cfg)
    return {ours: "diffusion_head.weight" if theirs == "lm_head.weight" else "encoder." + theirs.removeprefix("model.")
            for ours, theirs in names.items()}


def random_rope(max_positions: int) -> tuple[float, dict]:
    """The rope parameters of a checkpoint kstep writes: the released ones, with the original context
    at max_positions / 16 as theirs (262144 / 16), so a tiny model's positions cross it too."""
    return ROPE_THETA, {**ROPE, "original_max_position_embeddings": max(1, max_positions // 16)}


def to_raw_config(cfg: ModelConfig) -> dict:
    """config.json in the released layout (for checkpoints kstep writes)."""
    rope = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "auto_map": {"AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
                     "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope, "hidden_act": "silu", "attention_bias": cfg.qkv_bias, "attention_dropout": 0.0,
        "mlp_bias": cfg.mlp_bias, "sliding_window": None, "tie_word_embeddings": cfg.tie_embeddings,
        "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size, "dlm_paradigm": "bidirectional",
        "dlm_loss_weight": None, "ar_loss_weight": 1.0, "dp_varying_mask_ratio": False, "use_cache": False,
        "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids),
    }
