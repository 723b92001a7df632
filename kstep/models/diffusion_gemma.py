"""DiffusionGemma (Google, Gemma-4-26B-A4B run as a block diffusion model from random tokens): its
config.json (transformers 5.24 `DiffusionGemmaConfig` with a nested `text_config`), its
generation_config.json defaults, and its checkpoint tensor names (kstep/models/diffusion_gemma_model.py
is the network); config.json and generation_config.json are also written, in save_pretrained's layout,
for the random checkpoints kstep writes (kstep/random_checkpoint.py), without transformers.

The checkpoint stores the decoder's copy of every shared weight (`model.decoder.*`, the encoder's are
tied to it) plus the encoder's own per-layer scalars (`model.encoder.language_model.layers.*.layer_scalar`,
buffers, not tied); the vision tower's tensors are not read. Text only.
"""
from dataclasses import dataclass

from kstep.models.config import ModelConfig, MoEConfig
from kstep.models.diffusion_gemma_layers import ACTIVATIONS, FULL, SLIDING
from kstep.models.parts import Part

DEFAULT_SOFTCAP = 30.0      # a class attribute in transformers: save_pretrained does not write it
DEFAULT_GLOBAL_HEAD_DIM = 512  # DiffusionGemmaTextConfig's default for full layers without per_layer_config
SAMPLER = "EntropyBoundSamplerConfig"  # the only sampler transformers ships for it
DTYPE_KEY = "dtype"  # config.json's dtype entry: transformers 5 writes `dtype`, not `torch_dtype`
# The smallest Gemma-4 vision tower transformers builds (it builds one for every checkpoint of this
# family): a checkpoint kstep writes carries no vision tensors, so transformers initialises these.
VISION_CONFIG = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "position_embedding_size": 64}


@dataclass(slots=True)
class DiffusionGemmaConfig(ModelConfig):
    """ModelConfig's fields hold the sliding layers' geometry; these add what differs per layer."""
    layer_types: tuple[str, ...] = ()      # SLIDING | FULL per layer
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    sliding_window: int = 512
    rope_thetas: tuple[float, float] = (1e4, 1e6)        # (sliding, full)
    rotary_fractions: tuple[float, float] = (1.0, 0.25)  # of each head's frequencies that rotate
    softcap: float | None = DEFAULT_SOFTCAP
    activation: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        ModelConfig.__post_init__(self)  # (zero-argument super() does not work in slotted dataclasses)
        if self.canvas_length is None:
            self.canvas_length = 256
        if not len(self.layer_types) == len(self.layer_head_dims) == len(self.layer_kv_heads) == self.n_layers:
            raise ValueError("layer_types, layer_head_dims and layer_kv_heads need one entry per layer")
        for i, (kind, kv) in enumerate(zip(self.layer_types, self.layer_kv_heads)):
            if kind not in (SLIDING, FULL):
                raise ValueError(f"layer_types[{i}] = {kind!r} is not {SLIDING!r} or {FULL!r}")
            if self.n_heads % kv:
                raise ValueError(f"layer {i}: num_attention_heads ({self.n_heads}) is not a multiple of its "
                                 f"key/value heads ({kv})")
        if self.sliding_window < 1 or self.canvas_length < 1:
            raise ValueError(f"sliding_window ({self.sliding_window}) and canvas_length ({self.canvas_length}) "
                             "must be positive")

    def body_params(self, active: bool = False) -> int:
        """Weights of the layer stack (per-layer attention geometry, the MoE block with its router,
        the dense MLP, norms and scalars), the final norm and the self-conditioning MLP."""
        D, total = self.d_model, 0
        for i, (kind, hd, kv) in enumerate(zip(self.layer_types, self.layer_head_dims, self.layer_kv_heads)):
            attn = D * hd * (2 * self.n_heads + (2 if kind == SLIDING else 1) * kv) + 2 * hd
            total += attn + self.layer_ffn_params(i, active) + self.moe.num_experts + 8 * D + 2
        return total + D + (D + 3 * D * self.ffn_dim)


def _text(raw: dict) -> dict:
    return raw["text_config"] if "text_config" in raw else raw


def _per_layer(text: dict, layer_types: list[str]) -> tuple[list[int], list[int]]:
    """Head dim and KV heads of each layer: `per_layer_config` (as save_pretrained writes it) or the
    `global_head_dim` / `num_global_key_value_heads` keys it is built from (full layers)."""
    head_dims = [text.get("head_dim", 256)] * len(layer_types)
    kv_heads = [text.get("num_key_value_heads", 4)] * len(layer_types)
    overrides = text.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": text.get("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)}
        if text.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = text["num_global_key_value_heads"]
        overrides = {str(i): full for i, kind in enumerate(layer_types) if kind == FULL}
    for key, override in overrides.items():
        i = int(key)
        head_dims[i] = override.get("head_dim", head_dims[i])
        kv_heads[i] = override.get("num_key_value_heads", kv_heads[i])
    return head_dims, kv_heads


def _rope(text: dict, kind: str, default_theta: float, default_fraction: float) -> tuple[float, float]:
    params = (text.get("rope_parameters") or {}).get(kind) or {}
    rope_type = params.get("rope_type", "default" if kind == SLIDING else "proportional")
    if rope_type not in ("default", "proportional") or params.get("factor", 1.0) != 1.0:
        raise ValueError(f"config.json: {kind} rope {params} is not supported (default or proportional, factor 1)")
    return float(params.get("rope_theta", default_theta)), float(params.get("partial_rotary_factor", default_fraction))


def parse_config(raw: dict, family: str, attention: str) -> DiffusionGemmaConfig:
    text = _text(raw)
    if text.get("use_bidirectional_attention") == "all":
        raise ValueError("config.json: use_bidirectional_attention='all' (a bidirectional encoder) is not supported")
    if text.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not supported")
    if raw.get("tie_word_embeddings", True) is False or text.get("tie_word_embeddings", True) is False:
        raise ValueError("config.json: tie_word_embeddings=false (separate encoder weights) is not supported")
    activation = text.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_activation {activation!r} is not supported ({', '.join(ACTIVATIONS)})")
    n_layers = text.get("num_hidden_layers", 30)
    layer_types = list(text.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)])
    layer_types[-1] = FULL  # as DiffusionGemmaTextConfig forces it
    head_dims, kv_heads = _per_layer(text, layer_types)
    sliding = next((i for i, kind in enumerate(layer_types) if kind == SLIDING), 0)
    for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not text.get(name):
            raise ValueError(f"config.json: text_config.{name} is required (every DiffusionGemma layer has an MoE)")
    d_model, ffn_dim = text.get("hidden_size", 2304), text.get("intermediate_size", 9216)
    moe = MoEConfig(text["num_experts"], text["top_k_experts"], text["moe_intermediate_size"], router="softmax",
                    shared_dim=ffn_dim)  # the dense MLP beside the experts counts as a shared expert
    softcap = text.get("final_logit_softcapping", DEFAULT_SOFTCAP)
    rope = (_rope(text, SLIDING, 1e4, 1.0), _rope(text, FULL, 1e6, 0.25))
    vocab = text.get("vocab_size", 262144)
    return DiffusionGemmaConfig(
        family=family, attention=attention, vocab_size=vocab, embedding_size=vocab, d_model=d_model,
        n_layers=n_layers, n_heads=text.get("num_attention_heads", 8), n_kv_heads=kv_heads[sliding],
        head_dim=head_dims[sliding], ffn_dim=ffn_dim, norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope[0][0], max_positions=text.get("max_position_embeddings", 131072), tie_embeddings=True,
        embed_scale=d_model ** 0.5, bos_token_id=text.get("bos_token_id"), pad_token_id=text.get("pad_token_id"),
        moe=moe,
        layer_types=tuple(layer_types), layer_head_dims=tuple(head_dims), layer_kv_heads=tuple(kv_heads),
        sliding_window=text.get("sliding_window", 512), rope_thetas=(rope[0][0], rope[1][0]),
        rotary_fractions=(rope[0][1], rope[1][1]), softcap=None if softcap is None else float(softcap),
        canvas_length=raw.get("canvas_length") or 256, activation=activation, image_token_id=raw.get("image_token_id"))


def to_raw_config(cfg: DiffusionGemmaConfig) -> dict:
    """config.json as transformers' save_pretrained writes it (for checkpoints kstep writes): the
    nested text_config with a `per_layer_config` entry for every full layer (without one transformers
    would give them its default head dim of 512), and a vision tower of the smallest shape, since
    transformers builds one for every DiffusionGemma; kstep writes none of its tensors (text only)."""
    sliding_fraction, full_fraction = cfg.rotary_fractions
    sliding_rope = {"rope_theta": cfg.rope_thetas[0], "rope_type": "default"}
    if sliding_fraction != 1.0:
        sliding_rope["partial_rotary_factor"] = sliding_fraction
    text = {
        "model_type": "diffusion_gemma_text", "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        "pad_token_id": cfg.pad_token_id, "head_dim": cfg.head_dim, "hidden_activation": cfg.activation,
        "hidden_size": cfg.d_model, "initializer_range": 0.02, "intermediate_size": cfg.ffn_dim,
        "layer_types": list(cfg.layer_types), "max_position_embeddings": cfg.max_positions,
        "moe_intermediate_size": cfg.moe.expert_dim, "num_attention_heads": cfg.n_heads,
        "num_experts": cfg.moe.num_experts, "num_hidden_layers": cfg.n_layers, "num_key_value_heads": cfg.n_kv_heads,
        "per_layer_config": {str(i): {"head_dim": hd, "num_key_value_heads": kv} for i, (kind, hd, kv)
                             in enumerate(zip(cfg.layer_types, cfg.layer_head_dims, cfg.layer_kv_heads))
                             if kind == FULL or (hd, kv) != (cfg.head_dim, cfg.n_kv_heads)},
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {FULL: {"partial_rotary_factor": full_fraction, "rope_theta": cfg.rope_thetas[1],
                                   "rope_type": "proportional"}, SLIDING: sliding_rope},
        "sliding_window": cfg.sliding_window, "tie_word_embeddings": True, "top_k_experts": cfg.moe.top_k,
        "use_bidirectional_attention": "vision", "vocab_size": cfg.vocab_size,
    }
    if cfg.softcap != DEFAULT_SOFTCAP:  # a class attribute in transformers: written only when it differs
        text["final_logit_softcapping"] = cfg.softcap
    return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
            "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": cfg.image_token_id,
            "canvas_length": cfg.canvas_length, "initializer_range": 0.02, "tie_word_embeddings": True,
            "text_config": text, "vision_config": dict(VISION_CONFIG)}


def to_generation_config(cfg: DiffusionGemmaConfig) -> dict:
    """generation_config.json as save_pretrained writes it: the sampler's knobs null (transformers'
    defaults, which kstep's are), its output as a dict (what transformers' generate returns for this
    model), and the end ids."""
    knobs = dict.fromkeys(("confidence_threshold", "max_denoising_steps", "sampler_config", "stability_threshold",
                           "t_max", "t_min"))
    return {**knobs, "return_dict_in_generate": True, "eos_token_id": list(cfg.eos_token_ids),
            "pad_token_id": cfg.pad_token_id}


def generation_defaults(raw: dict) -> dict:
    """Knob values from generation_config.json: transformers' names, the entropy bound from its
    `sampler_config`. Null entries are unset (transformers fills its defaults in), as kstep does."""
    sampler = raw.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("_cls_name", SAMPLER) != SAMPLER:
        raise ValueError(f"generation_config.json: sampler_config {sampler.get('_cls_name')!r} is not supported "
                         f"(only {SAMPLER})")
    knobs = {name: raw[name] for name in ("max_denoising_steps", "t_min", "t_max", "stability_threshold",
                                          "confidence_threshold") if raw.get(name) is not None}
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        knobs["entropy_bound"] = sampler["entropy_bound"]
    return knobs


def checkpoint_names(cfg: DiffusionGemmaConfig) -> dict[str, "str | list[Part]"]:
    """kstep parameter name -> checkpoint tensor (the decoder's copy of every shared weight)."""
    dec = "model.decoder."
    names: dict[str, str | list[Part]] = {"embed.weight": dec + "embed_tokens.weight", "norm.weight": dec + "norm.weight",
                                          "sc_norm.weight": dec + "self_conditioning.pre_norm.weight"}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"sc_mlp.{proj}.weight"] = f"{dec}self_conditioning.{proj}.weight"
    parts = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm_1",
             "moe_norm": "pre_feedforward_layernorm_2", "post_moe_norm": "post_feedforward_layernorm_2",
             "post_ffn_norm": "post_feedforward_layernorm", "attn.q_norm": "self_attn.q_norm",
             "attn.k_norm": "self_attn.k_norm"}
    for i, kind in enumerate(cfg.layer_types):
        ours, theirs = f"layers.{i}.", f"{dec}layers.{i}."
        for name, hf in parts.items():
            names[f"{ours}{name}.weight"] = f"{theirs}{hf}.weight"
        for proj in ("q_proj", "k_proj", "o_proj") + (("v_proj",) if kind == SLIDING else ()):
            names[f"{ours}attn.{proj}.weight"] = f"{theirs}self_attn.{proj}.weight"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"{ours}mlp.{proj}.weight"] = f"{theirs}mlp.{proj}.weight"
        names[f"{ours}router.proj.weight"] = f"{theirs}router.proj.weight"
        names[f"{ours}router.scale"] = f"{theirs}router.scale"
        names[f"{ours}router.expert_scale"] = f"{theirs}router.per_expert_scale"
        # transformers stores experts (E, out, in); kstep's layer keeps (E, in, out)
        names[f"{ours}experts.gate_up"] = [Part(f"{theirs}experts.gate_up_proj", transpose=True)]
        names[f"{ours}experts.down"] = [Part(f"{theirs}experts.down_proj", transpose=True)]
        names[f"{ours}scalars"] = [Part(f"model.encoder.language_model.layers.{i}.layer_scalar", index=(0,)),
                                   Part(f"{theirs}layer_scalar", index=(1,))]
    return names
