"""The one architecture description every family's config.json is translated into."""
from dataclasses import dataclass, field

# two_mode: causal encoder passes that write the cache, bidirectional decoder passes over [prefix;
# canvas] that do not (DiffusionGemma)
ATTENTION_MODES = ("causal", "bidirectional", "block_causal", "two_mode")


@dataclass(slots=True, frozen=True)
class MoEConfig:
    """The sparse feed-forward of a Mixture-of-Experts model (kstep/layers/moe.py): every layer not
    in `dense_layers` routes each token to `top_k` of `num_experts` SwiGLU experts of width
    `expert_dim`, plus a shared SwiGLU of width `shared_dim` (0: none)."""
    num_experts: int
    top_k: int
    expert_dim: int
    router: str                        # layers/moe.py ROUTERS: "softmax" | "sigmoid_grouped"
    renormalize: bool = True           # softmax: weights renormalised over the chosen experts
    n_group: int = 1                   # sigmoid_grouped: groups of experts, and how many a token keeps
    topk_group: int = 1
    scaling: float = 1.0               # routed_scaling_factor
    has_bias: bool = False             # the checkpoint has an expert bias
    shared_dim: int = 0
    dense_layers: tuple[int, ...] = ()  # layers with a dense SwiGLU of ffn_dim instead
    logits_in_float32: bool = True     # the router's matmul in float32 (LLaDA2) or the model dtype (LLaDA-MoE)

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx not in self.dense_layers

    def expected_experts(self, tokens: float) -> float:
        """Distinct experts a sparse layer reads for `tokens` tokens, each choosing top_k of E
        (uniformly, independently): E (1 - (1 - k/E)^T). One token reads k; a block of 32 on
        LLaDA2.0-mini (k = 8 of 256) about 160."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens)

    def layer_params(self, d_model: int) -> int:
        """Weights of one sparse layer's feed-forward (router, every expert, shared experts)."""
        return d_model * self.num_experts + 3 * d_model * (self.num_experts * self.expert_dim + self.shared_dim)

    def active_layer_params(self, d_model: int) -> int:
        """Weights one token goes through in a sparse layer (router, its top_k experts, shared)."""
        return d_model * self.num_experts + 3 * d_model * (self.top_k * self.expert_dim + self.shared_dim)


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
    rotary_dim: int | None = None    # partial rotary (LLaDA2): only the first rotary_dim dims of a head rotate
    moe: MoEConfig | None = None     # a Mixture-of-Experts model's sparse layers
    canvas_length: int | None = None  # uniform diffusion (DiffusionGemma): tokens per canvas
    image_token_id: int | None = None  # a multimodal checkpoint's image placeholder: never in a text prompt

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
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even and in (0, head_dim={self.head_dim}]")

    @property
    def is_causal(self) -> bool:
        return self.attention == "causal"

    @property
    def rotary_width(self) -> int:
        return self.rotary_dim or self.head_dim

    def layer_ffn_params(self, layer_idx: int, active: bool = False) -> int:
        """Feed-forward weights of one layer: all of them, or those one token goes through (`active`)."""
        if self.moe is None or not self.moe.is_sparse(layer_idx):
            return 3 * self.d_model * self.ffn_dim
        return self.moe.active_layer_params(self.d_model) if active else self.moe.layer_params(self.d_model)

    def body_params(self, active: bool = False) -> int:
        """Weights of the layer stack and final norm (not the embedding or the head)."""
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        ffn = sum(self.layer_ffn_params(i, active) for i in range(self.n_layers))
        return self.n_layers * (attn + 2 * self.d_model) + ffn + self.d_model

    @property
    def num_params(self) -> int:
        heads = 1 if self.tie_embeddings else 2
        return self.body_params() + heads * self.embedding_size * self.d_model

    @property
    def num_active_params(self) -> int:
        """Parameters one token's forward pass reads (an MoE model's top_k experts, not all)."""
        heads = 1 if self.tie_embeddings else 2
        return self.body_params(active=True) + heads * self.embedding_size * self.d_model
