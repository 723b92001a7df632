"""A GGUF file's metadata as the Hugging Face config.json its converter read (llama.cpp's
convert_hf_to_gguf.py, TextModel.set_gguf_parameters and each model class): the keys kstep's family
parsers take. Architectures kstep runs from a GGUF file: ARCHITECTURES; any other is refused by name."""
import numpy as np

from kstep.gguf.reader import GGUFFile

# general.architecture -> the Hugging Face architecture and model_type its converter class read
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "dream": ("DreamModel", "Dream"),
    "llada": ("LLaDAModelLM", "llada"),
    "llada-moe": ("LLaDAMoEModelLM", "llada"),
}
# llama.cpp's `rope.scaling.type` values kstep's rope takes from a config.json's rope_scaling
ROPE_SCALING = ("linear", "yarn")


def hf_config(file: GGUFFile) -> dict:
    """config.json for the file's architecture, or a ValueError naming what kstep cannot run."""
    if file.arch not in ARCHITECTURES:
        raise ValueError(f"{file.path}: GGUF architecture {file.arch!r} is not one kstep runs "
                         f"(it runs {', '.join(ARCHITECTURES)} from GGUF files)")
    architecture, model_type = ARCHITECTURES[file.arch]
    heads, d_model = file.arch_get("attention.head_count"), file.arch_get("embedding_length")
    kv_heads, head_dim = file.arch_get("attention.head_count_kv") or heads, file.arch_get("attention.key_length")
    rows = int(file.tensors["token_embd.weight"].shape[-1])  # the embedding's rows (GGML lists them last)
    vocab = file.arch_get("vocab_size") or len(file.get("tokenizer.ggml.tokens") or []) or rows
    shape = {"vocab_size": vocab if file.arch == "llada" else rows,  # Hugging Face's vocab_size: the rows
             "rms_norm_eps": _float32_value(file.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
             "rope_theta": _float32_value(file.arch_get("rope.freq_base", 10000.0)),
             "bos_token_id": file.get("tokenizer.ggml.bos_token_id"),
             "eos_token_id": file.get("tokenizer.ggml.eos_token_id"),
             "pad_token_id": file.get("tokenizer.ggml.padding_token_id"),
             "mask_token_id": file.get("tokenizer.ggml.mask_token_id")}
    tied = "output.weight" not in file.tensors
    if file.arch == "llada":  # LLaDA's own config.json keys (LLaDAModel in the converter)
        raw = {"d_model": d_model, "n_heads": heads, "n_kv_heads": kv_heads,
               "n_layers": file.arch_get("block_count"), "mlp_hidden_size": file.arch_get("feed_forward_length"),
               "max_sequence_length": file.arch_get("context_length", 4096), "weight_tying": tied,
               "embedding_size": rows}
    elif file.arch == "llada-moe":  # every layer sparse, no shared expert: what llama.cpp's llada-moe holds
        raw = _llada_moe(file, d_model, heads, kv_heads, head_dim or d_model // heads, tied)
    else:
        raw = {"hidden_size": d_model, "intermediate_size": file.arch_get("feed_forward_length"),
               "num_hidden_layers": file.arch_get("block_count"), "num_attention_heads": heads,
               "num_key_value_heads": kv_heads, "head_dim": head_dim or d_model // heads,
               "max_position_embeddings": file.arch_get("context_length", 2048), "hidden_act": "silu",
               "tie_word_embeddings": tied}
    raw = {"architectures": [architecture], "model_type": model_type, **shape, **raw}
    scaling = file.arch_get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ROPE_SCALING:
            raise ValueError(f"{file.path}: rope scaling {scaling!r} is not supported from GGUF files "
                             f"(supported: {', '.join(ROPE_SCALING)})")
        raw["rope_scaling"] = {"rope_type": scaling, "factor": file.arch_get("rope.scaling.factor"),
                               **({"original_max_position_embeddings": original} if (
                                   original := file.arch_get("rope.scaling.original_context_length")) else {})}
    if "rope_freqs.weight" in file.tensors:  # Llama 3.x's scaling, written as each frequency's factor
        raw["rope_scaling"] = _llama3_scaling(file, raw["rope_theta"],
                                              file.arch_get("rope.dimension_count") or head_dim or d_model // heads)
    return {k: v for k, v in raw.items() if v is not None}


# The converter's defaults for Llama 3.x's rope (LlamaModel.generate_extra_tensors), which every Llama
# 3.1-3.3 config.json also gives; its `factor` is the largest of the factors it writes.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_scaling(file: GGUFFile, theta: float, dim: int) -> dict:
    """The config.json rope_scaling whose factors the file's rope_freqs.weight holds: llama3 with the
    converter's defaults and the largest factor, checked by computing the factors again as the converter
    does; any other set is refused by name."""
    tensor = file.tensors["rope_freqs.weight"]
    stored = np.asarray(tensor.data, dtype=np.float64).reshape(-1) if tensor.tensor_type.name == "F32" else None
    spec = {"rope_type": "llama3", "factor": float(stored.max()) if stored is not None else None, **LLAMA3_ROPE}
    if stored is None or stored.shape != (dim // 2,) or not np.allclose(_llama3_factors(theta, dim, spec), stored,
                                                                        rtol=1e-6, atol=0):
        raise ValueError(f"{file.path}: its rope frequency factors (rope_freqs.weight) are not Llama 3's with "
                         f"low/high frequency factors 1 and 4 over 8192 positions, the only ones kstep reads "
                         "from a GGUF file; load the safetensors checkpoint")
    return spec


def _llama3_factors(theta: float, dim: int, spec: dict) -> np.ndarray:
    """Each frequency's factor as llama.cpp's converter writes them for a llama3 rope_scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    old_len, low, high = spec["original_max_position_embeddings"], spec["low_freq_factor"], spec["high_freq_factor"]
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(spec["factor"])
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / spec["factor"] + smooth))
    return np.asarray(out, dtype=np.float32).astype(np.float64)


def _llada_moe(file: GGUFFile, d_model: int, heads: int, kv_heads: int, head_dim: int, tied: bool) -> dict:
    """LLaDA-MoE's config.json keys (LLaDAMoEModel in the converter, which writes the MoE sizes; the
    rest is what the tensors show: q / k norms, which layers route)."""
    layers = file.arch_get("block_count")
    if any(f"blk.{i}.ffn_gate_inp.weight" not in file.tensors for i in range(layers)):
        raise ValueError(f"{file.path}: a llada-moe file with dense layers is not one llama.cpp writes")
    return {"hidden_size": d_model, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "dense_intermediate_size": file.arch_get("feed_forward_length"),
            "expert_intermediate_size": file.arch_get("expert_feed_forward_length"),
            "num_experts": file.arch_get("expert_count"), "num_experts_per_tok": file.arch_get("expert_used_count"),
            "norm_topk_prob": False, "moe_layer_freq": [1] * layers, "moe_router_score_function": "softmax",
            "qk_layernorm": "blk.0.attn_q_norm.weight" in file.tensors,
            "partial_rotary_factor": (file.arch_get("rope.dimension_count") or head_dim) / head_dim,
            "max_position_embeddings": file.arch_get("context_length", 4096), "hidden_act": "silu",
            "tie_word_embeddings": tied}


def _float32_value(value: float) -> float:
    """A float32 metadata value as the decimal the converter wrote (1e-05 is stored as 9.9999997e-06):
    the shortest decimal that rounds to the same float32."""
    return float(np.format_float_positional(np.float32(value), unique=True))
