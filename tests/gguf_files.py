"""GGUF files written from Hugging Face checkpoints with gguf-py's writer and tensor tables, the way
llama.cpp's convert_hf_to_gguf.py writes them (TextModel.set_gguf_parameters, LlamaModel's q / k
permutation, the gpt2 vocabulary with its merges and control tokens, 1-d tensors in F32): CI has no
llama.cpp tree to run the converter itself."""
import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

PERMUTED = ("llama", "llada")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """LlamaModel.permute: within each head, rows (2, half) -> (half, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hparams(config: dict) -> dict:
    """The converter's view of a config.json: LLaDA's own keys (LLaDAModel) or the Hugging Face ones."""
    if "d_model" in config:
        heads = config["n_heads"]
        return dict(context=config.get("max_sequence_length", 4096), d_model=config["d_model"],
                    layers=config["n_layers"], ffn=config["mlp_hidden_size"], heads=heads,
                    kv_heads=config.get("n_kv_heads") or heads, head_dim=None)
    heads = config["num_attention_heads"]
    return dict(context=config.get("max_position_embeddings", 2048), d_model=config["hidden_size"],
                layers=config["num_hidden_layers"], heads=heads,
                ffn=config.get("intermediate_size") or config.get("dense_intermediate_size"),
                kv_heads=config.get("num_key_value_heads") or heads, head_dim=config.get("head_dim"))


def add_spm_vocab(writer: gguf.GGUFWriter, pieces: dict[str, float]) -> int:
    """A SentencePiece vocabulary (tokenizer model "llama") as the converter's _set_vocab_sentencepiece
    writes one: <unk>, <s>, </s>, the 256 byte tokens, then the pieces with their scores; its size."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + list(pieces.values()))
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] +
                           [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(pieces))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    return len(tokens)


def write_gguf(checkpoint: Path, out: Path, arch: str, kind=gguf.GGMLQuantizationType.F32, pre: str = "gpt-2",
               spm: dict[str, float] | None = None) -> Path:
    """The checkpoint as the converter writes it; with `spm`, a SentencePiece vocabulary of those
    pieces instead of the checkpoint's tokenizer (the checkpoint's vocab_size must be its size)."""
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    h = hparams(config)
    heads, kv_heads = h["heads"], h["kv_heads"]
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(checkpoint.name)
    writer.add_context_length(h["context"])
    writer.add_embedding_length(h["d_model"])
    writer.add_block_count(h["layers"])
    writer.add_feed_forward_length(h["ffn"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    if h["head_dim"]:
        writer.add_key_length(h["head_dim"])
        writer.add_value_length(h["head_dim"])
    if arch in ("llama", "llada"):
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(h["head_dim"] or h["d_model"] // heads)
    if arch in ("llada", "dream", "llada-moe"):  # bidirectional; LLaDA's logits not shifted, Dream's are (no key)
        writer.add_causal_attention(False)
        if arch != "dream":
            writer.add_diffusion_shift_logits(False)
    if arch == "llada-moe":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["expert_intermediate_size"])
    if spm is not None:
        assert add_spm_vocab(writer, spm) == config["vocab_size"]
    else:
        _add_bpe_vocab(writer, config, tokenizer, tokenizer_config, pre)
    arches = {name: value for value, name in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(arches[arch], h["layers"])
    for name, tensor in _stacked_experts(load_file(checkpoint / "model.safetensors")).items():
        data = tensor.to(torch.float32).numpy()
        if arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _permute(data, heads)
        elif arch in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _permute(data, kv_heads)
        stored = gguf.GGMLQuantizationType.F32 if data.ndim == 1 else kind
        if stored == gguf.GGMLQuantizationType.F16:
            data = data.astype(np.float16)
        elif stored != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, stored)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data, raw_dtype=stored)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors: each frequency's factor
        writer.add_tensor("rope_freqs.weight", _llama3_factors(config, h["head_dim"] or h["d_model"] // heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out



def _add_bpe_vocab(writer: gguf.GGUFWriter, config: dict, tokenizer: dict, tokenizer_config: dict, pre: str) -> None:
    """The vocabulary as _set_vocab_gpt2 writes it: ids in order, added special tokens as CONTROL."""
    vocab, special = tokenizer["model"]["vocab"], {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    for name, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                      ("pad_token", writer.add_pad_token_id), ("mask_token", writer.add_mask_token_id)):
        if tokenizer_config.get(name) in ids:
            add(ids[tokenizer_config[name]])
        elif name == "mask_token" and config.get("mask_token_id") is not None:  # SpecialVocab reads config.json too
            add(config["mask_token_id"])
    writer.add_add_bos_token(False)
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])


def _stacked_experts(tensors: dict) -> dict:
    """Each layer's per-expert weights as one (experts, out, in) tensor, as the converter's MoE classes
    stack them (`model.layers.N.mlp.experts.{gate,up,down}_proj.weight`)."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = tensor
    for name, by_index in experts.items():
        out[name] = torch.stack([by_index[e] for e in sorted(by_index)])
    return out


def _llama3_factors(config: dict, dim: int) -> np.ndarray:
    """The converter's rope_freqs for a llama3 rope_scaling, computed as it computes them (float32 torch)."""
    scaling = config["rope_scaling"]
    freqs = 1.0 / (config.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low = scaling.get("factor", 8.0), scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = config.get("original_max_position_embeddings", 8192)  # the converter reads the top level
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()
