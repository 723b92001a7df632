"""The one architecture description every family's config.json is translated into."""
from dataclasses import dataclass, field

ATTENTION_MODES = ("causal", "bidirectional", "block_causal")


@dataclass(slots=True)
class ModelConfig:
    family: str                      # registry name (kstep/registry.py): "llada", "llama", "qwen2", "dream"
    attention: str                   # "causal", "bidirectional" or "block_causal": how positions attend (the registry's)
    vocab_size: int                  # ids the tokenizer can produce; logits are cut to this
    embedding_size: int              # rows of the embedding / LM head (LLaDA pads it)
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    max_positions: int
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    embed_scale: float = 1.0         # OLMo's input_emb_norm multiplies embeddings by sqrt(d_model)
    logits_scale: float = 1.0        # OLMo's scale_logits divides logits by sqrt(d_model)
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    block_size: int | None = None    # block_causal: bidirectional inside blocks of this many tokens
    qk_norm: bool = False            # Qwen3: RMSNorm over each head's q and k before rotary

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.embedding_size < self.vocab_size:
            raise ValueError(f"embedding_size ({self.embedding_size}) is smaller than vocab_size ({self.vocab_size})")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention {self.attention!r} is not one of {', '.join(ATTENTION_MODES)}")

    @property
    def is_causal(self) -> bool:
        return self.attention == "causal"

    @property
    def num_params(self) -> int:
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 3 * self.d_model * self.ffn_dim + 2 * self.d_model
        heads = 1 if self.tie_embeddings else 2
        return self.n_layers * per_layer + heads * self.embedding_size * self.d_model + self.d_model
