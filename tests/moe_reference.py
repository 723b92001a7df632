"""An independent, deliberately plain restatement of the MoE diffusion-LM references for parity tests.

Families (issue 23) and the public code each rule is restated from:

[D1] ZHZisZZ/dllm dllm/pipelines/llada2/models/{configuration,modeling}_llada2_moe.py
     @ d8cc1190ddbe47a7c38fd0eb5d29d3a0b12043c5 (first vendoring of the inclusionAI/LLaDA2.0-* remote code).
[D2] the same files @ ca176752fbceec49c6b4777a2c18ae88e4eb10ed (greedy branch in the sampler, 4-D bool masks accepted,
     eos_early_stop returns the generation only). `llada2_generate` restates [D2]'s `LLaDA2MoeModelLM.generate`.
[D3] ZHZisZZ/dllm dllm/pipelines/llada21/models/{configuration,modeling}_llada21_moe.py @ ca176752 (LLaDA2.1: the
     same model, `generate` with token editing). [D3a] dllm/pipelines/llada21/models/modeling_llada2_moe.py @
     9268328a71b56e08a0be48e4319b938e29cfe1a8, its first vendoring (see `llada21_generate` for its mask quirk).
[I1] InfiniTensor/InfiniLM modeling_lladamoe.py @ 0a7e522afb6079a30c7ecb50ce8abafe6cc3f808 and [I2]
     configuration_lladamoe.py @ 239f1d707f54c1e95ad2ec282842a3ed87038f05 (the LLaDA-MoE-7B-A1B remote code).

- `write_llada2_checkpoint` / `ReferenceLLaDA2`: LLaDA2.0 / 2.1 (`LLaDA2MoeModelLM`, model_type "llada2_moe").
- `llada2_generate` (LLaDA2.0) and `llada21_generate` (LLaDA2.1, token editing): batch one, whole-prefix recompute
  every step exactly as the references do (no KV cache), the same RNG draws at temperature > 0.
- `write_llada_moe_checkpoint` / `ReferenceLLaDAMoE`: LLaDA-MoE (`LLaDAMoEModelLM`, model_type "llada" as dense
  LLaDA).
  Its decoding is LLaDA's semi-autoregressive `generate` (ML-GSAI/LLaDA generate.py), already restated by
  tests/llada_reference.py: `ReferenceLLaDAMoE` is called as `model(x, attention_mask)` and returns logits (B, L, V),
  which is all `llada_reference.reference_generate` and `fast_dllm_generate(..., cache="none")` need (the attention mask
  is ignored as [I1] ignores it, so batch only without padding); tests/test_moe_families.py's `CachedLLaDAMoE` adds
  Fast-dLLM's prefix / dual caches.

Where the real checkpoints keep the mask and eos ids (researched; the Hub itself was not reachable):
- Neither config.json names a mask id, and no config names it `mask_token_id`. The dFactory training copy of the
  LLaDA2.0-mini config (inclusionAI/dFactory configs/model_configs/llada2_mini/config.json @ c29d72cc) has
  `pad_token_id: 156892` and no eos/mask id. The consumers hard-code the mask: [D1]/[D2]/[D3] `generate(...,
  eos_id=156892, mask_id=156895)`; SGLang python/sglang/srt/dllm/config.py @ 0ad4de45 `DLLM_PARAMS["LLaDA2MoeModelLM"] =
  {"block_size": 32, "mask_id": 156895}`; llama.cpp's converter `add_mask_token_id(156895)` for LLaDA-MoE; dInfer's
  tests `mask_id=156895, eos_id=156892`.
- The token itself is in the tokenizer: dllm dllm/utils/models.py @ ca176752 `get_tokenizer` calls
  `tokenizer.add_special_tokens({"mask_token": "<|mask|>"})` for LLaDAMoEModelLM and both LLaDA2MoeModelLM classes.
  A later dllm revision in the code index does it only `if tokenizer.mask_token is None`. So tokenizer_config.json does
  not name a mask token, and `<|mask|>` is already in the vocabulary (tokenizer.json's added tokens) at 156895. If it
  were not, add_special_tokens would append a new id at the end of the vocabulary, not 156895. Another project built on
  the same Ling tokenizer checks `"<|mask|>": 156895` (code index id 59825339007). dllm takes eos from
  `tokenizer.eos_token_id` and the end of turn from `<|role_end|>`.
- eos: `<|endoftext|>` = 156892 = pad (the Ling 2.0 tokenizer; inclusionAI/Ling-mini-base-2.0 generation_config.json:
  eos_token_id 156892, pad_token_id 156892). Whether LLaDA2.x ships a generation_config.json is unconfirmed, so the
  writers leave it out unless asked (`generation_config=True` writes the Ling one).
So the tiny checkpoints put the ids where the real ones do: `<|mask|>` and `<|endoftext|>` in tokenizer.json's added
tokens, tokenizer_config.json naming bos/eos/pad but no mask, config.json's pad_token_id (LLaDA-MoE's config class also
saves eos_token_id: its defaults 50279 / 1 are OLMoE's, so the real file must override them; the values are
unconfirmed, the writer uses the eos id). The tiny ids keep the real offsets: mask = endoftext + 3.
"""
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# The tiny vocabulary: ordinary tokens 0 .. 299, then the Ling tokenizer's specials, then reserved rows up to 320.
FIRST_SPECIAL_ID = 300
STARTOFTEXT_ID = 300  # <|startoftext|>: bos
ENDOFTEXT_ID = 301  # <|endoftext|>: eos and pad (156892 in the real tokenizer)
ROLE_OPEN_ID, ROLE_CLOSE_ID = 302, 303  # <role>, </role> of the chat template
MASK_ID = 304  # <|mask|> (156895 = <|endoftext|> + 3 in the real tokenizer)
ROLE_END_ID = 305  # <|role_end|>: end of turn
UNK_ID = 319  # the stand-in tokenizer's WordLevel model needs an unknown token
VOCAB_SIZE = 320
SPECIAL_TOKENS = {STARTOFTEXT_ID: "<|startoftext|>", ENDOFTEXT_ID: "<|endoftext|>", ROLE_OPEN_ID: "<role>",
                  ROLE_CLOSE_ID: "</role>", MASK_ID: "<|mask|>", ROLE_END_ID: "<|role_end|>", UNK_ID: "<unk>"}
# A Ling-style template (<role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>); its exact text is unconfirmed.
CHAT_TEMPLATE = ("{% for message in messages %}<role>{{ message['role'] | upper }}</role>{{ message['content'] }}"
                 "<|role_end|>{% endfor %}{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}")


# ------------------------------------------------------------------------------------------ checkpoint files

def _normal(g, *shape, std):
    return torch.randn(*shape, generator=g) * std


def _tokenizer_files(path: Path, vocab_size: int):
    """A minimal tokenizers-library tokenizer.json (WordLevel over "w0" .. "w299" and the specials) and a
    tokenizer_config.json that names bos / eos / pad but, like the real one, no mask token."""
    vocab = {f"w{i}": i for i in range(FIRST_SPECIAL_ID)}
    for i in range(FIRST_SPECIAL_ID, vocab_size):
        vocab[SPECIAL_TOKENS.get(i, f"<|reserved_{i}|>")] = i
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, text in sorted(SPECIAL_TOKENS.items()) if i < vocab_size]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
              "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "model_max_length": 32768,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _save(path: Path, config: dict, tensors: dict, dtype: torch.dtype, sharded: bool, generation_config: bool):
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    if sharded:  # like the released checkpoints: several files plus model.safetensors.index.json
        names = list(tensors)
        n = 3
        weight_map = {}
        for s in range(n):
            file = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
            part = {k: tensors[k] for k in names[s::n]}
            save_file(part, str(path / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    else:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config:  # inclusionAI/Ling-mini-base-2.0's, with the tiny ids
        gen = {"eos_token_id": ENDOFTEXT_ID, "pad_token_id": ENDOFTEXT_ID, "do_sample": False,
               "transformers_version": "4.52.3"}
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _tokenizer_files(path, config["vocab_size"])
    return path


def _apply(config: dict, overrides: dict) -> dict:
    """config.json with `overrides` applied; an override of None deletes the key (the class default then applies)."""
    for key, value in overrides.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def _head(g, V, D):
    """lm_head rows: the eos row a little longer (completions end now and then), the mask row zero (the model never
    proposes the mask), the reserved rows above the specials shorter (they rarely win)."""
    head = _normal(g, V, D, std=0.7)
    head[ROLE_END_ID + 1:] *= 0.3
    head[ENDOFTEXT_ID] *= 1.5
    head[MASK_ID] = 0.0
    return head


def write_llada2_checkpoint(path, seed: int = 0, *, sharded: bool = False, dtype: torch.dtype = torch.float32,
                            generation_config: bool = False, **overrides) -> Path:
    """A tiny random LLaDA2.0 / 2.1 checkpoint in `path`: config.json with the released keys (sizes shrunk), the
    HF tensor names with one tensor per expert, tokenizer files naming the ids as the real ones do (module docstring).

    overrides change config.json keys (None deletes one). Note the class defaults when a key is deleted:
    use_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, rms_norm_eps=1e-5 ([D1] LLaDA2MoeConfig).
    Every layer from `first_k_dense_replace` on is MoE. The gate's expert_bias is non-zero (about the spread of the
    sigmoid scores), so it changes the selection of some tokens, and group-limited routing also bites (n_group 4 of
    2 experts, keep 2).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LLaDA2MoeModelLM"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "embedding_dropout": 0.0,
        "first_k_dense_replace": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 16384,
        "max_window_layers": 28,
        "model_type": "llada2_moe",
        "moe_intermediate_size": 32,
        "moe_router_enable_expert_bias": True,
        "n_group": 4,
        "norm_head": False,
        "norm_softmax": False,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_shared_experts": 1,
        "output_dropout": 0.0,
        "output_router_logits": False,
        "pad_token_id": ENDOFTEXT_ID,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 600000,
        "rotary_dim": 8,
        "routed_scaling_factor": 2.5,
        "router_dtype": "fp32",
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 2,
        "torch_dtype": "float32" if dtype == torch.float32 else "bfloat16",
        "transformers_version": "4.52.3",
        "use_bias": False,
        "use_cache": False,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_rmsnorm": True,
        "use_sliding_window": False,
        "using_split_qkv_in_self_attention": False,
        "vocab_size": VOCAB_SIZE,
    }
    _apply(config, overrides)
    c = _llada2_config(config)
    D, V, H, Hkv = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd, E, Im = c["head_dim"], c["num_experts"], c["moe_intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def norm_weight(n):  # not exactly one, so a missing or misplaced norm is caught
        return 0.8 + 0.4 * torch.rand(n, generator=g)

    def mlp(prefix, width, std_in=0.15, std_out=0.1):
        w[prefix + "gate_proj.weight"] = _normal(g, width, D, std=std_in)
        w[prefix + "up_proj.weight"] = _normal(g, width, D, std=std_in)
        w[prefix + "down_proj.weight"] = _normal(g, D, width, std=std_out)

    w = {"model.word_embeddings.weight": _normal(g, V, D, std=1.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(D)
        # rows: the H query heads, then the Hkv key heads, then the Hkv value heads, hd rows each
        w[p + "attention.query_key_value.weight"] = _normal(g, (H + 2 * Hkv) * hd, D, std=0.3)
        if c["use_qkv_bias"]:
            w[p + "attention.query_key_value.bias"] = _normal(g, (H + 2 * Hkv) * hd, std=0.3)
        if c["use_qk_norm"]:
            w[p + "attention.query_layernorm.weight"] = norm_weight(hd) * 1.5
            w[p + "attention.key_layernorm.weight"] = norm_weight(hd) * 1.5
        w[p + "attention.dense.weight"] = _normal(g, D, H * hd, std=0.1)
        if c["use_bias"]:
            w[p + "attention.dense.bias"] = _normal(g, D, std=0.1)
        w[p + "post_attention_layernorm.weight"] = norm_weight(D)
        if i < c["first_k_dense_replace"] or c["num_experts"] is None:
            mlp(p + "mlp.", c["intermediate_size"])
            continue
        w[p + "mlp.gate.weight"] = _normal(g, E, D, std=0.25)  # router logits of std ~2: sigmoid scores spread
        w[p + "mlp.gate.expert_bias"] = _normal(g, E, std=0.15)
        for e in range(E):
            mlp(p + f"mlp.experts.{e}.", Im, std_in=0.2, std_out=0.15)
        if c["num_shared_experts"]:
            mlp(p + "mlp.shared_experts.", Im * c["num_shared_experts"])
    w["model.norm.weight"] = norm_weight(D)
    w["lm_head.weight"] = _head(g, V, D)
    return _save(path, config, w, dtype, sharded, generation_config)


def write_llada_moe_checkpoint(path, seed: int = 0, *, sharded: bool = False, dtype: torch.dtype = torch.float32,
                               generation_config: bool = False, **overrides) -> Path:
    """A tiny random LLaDA-MoE checkpoint in `path` ([I2] LLaDAConfig's keys; OLMoE-style tensor names).

    model_type is "llada" (the same string as dense LLaDA-8B: tell them apart by `architectures`). Defaults: 2 layers,
    `moe_layer_freq` [0, 1] (one dense layer of dense_intermediate_size, one MoE layer; the released model is all MoE),
    MHA 4 heads of 16 (num_key_value_heads may be lowered: GQA), 8 experts of 32, top-2, no shared expert
    (`shared_expert_intermediate_size` null; a number adds `model.layers.i.shared_expert.*` on MoE layers), no expert
    bias (`moe_router_enable_expert_bias: true` adds a non-zero `model.layers.i.mlp.expert_bias`), full rotary
    (partial_rotary_factor 1.0; the released value is unconfirmed). overrides change config.json keys (None deletes).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LLaDAMoEModelLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig",
                     "AutoModel": "modeling_lladamoe.LLaDAMoEModel",
                     "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"},
        "bos_token_id": None,
        "clip_qkv": None,
        "dense_intermediate_size": 128,
        "eos_token_id": ENDOFTEXT_ID,
        "expert_intermediate_size": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "max_position_embeddings": 8192,
        "model_type": "llada",
        "moe_layer_freq": [0, 1],
        "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax",
        "norm_topk_prob": False,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "pad_token_id": ENDOFTEXT_ID,
        "partial_rotary_factor": 1.0,
        "qk_layernorm": True,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 50000,
        "routed_scaling_factor": 1,
        "router_aux_loss_coef": 0.01,
        "router_num_group": None,
        "router_topk_group": None,
        "shared_expert_intermediate_size": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32" if dtype == torch.float32 else "bfloat16",
        "transformers_version": "4.52.4",
        "use_cache": False,
        "vocab_size": VOCAB_SIZE,
    }
    if "num_hidden_layers" in overrides and "moe_layer_freq" not in overrides:
        config["moe_layer_freq"] = [0] + [1] * (overrides["num_hidden_layers"] - 1)
    _apply(config, overrides)
    c = config
    D, V, H = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    Hkv = c.get("num_key_value_heads") or H
    hd = D // H
    E = c["num_experts"]
    g = torch.Generator().manual_seed(seed)

    def norm_weight(n):
        return 0.8 + 0.4 * torch.rand(n, generator=g)

    def mlp(prefix, width, std_in=0.15, std_out=0.1):
        w[prefix + "gate_proj.weight"] = _normal(g, width, D, std=std_in)
        w[prefix + "up_proj.weight"] = _normal(g, width, D, std=std_in)
        w[prefix + "down_proj.weight"] = _normal(g, D, width, std=std_out)

    w = {"model.embed_tokens.weight": _normal(g, V, D, std=1.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(D)
        for name, n in (("q_proj", H * hd), ("k_proj", Hkv * hd), ("v_proj", Hkv * hd)):
            w[p + f"self_attn.{name}.weight"] = _normal(g, n, D, std=0.3)
        w[p + "self_attn.o_proj.weight"] = _normal(g, D, D, std=0.1)
        if c.get("attention_bias"):
            for name, n in (("q_proj", H * hd), ("k_proj", Hkv * hd), ("v_proj", Hkv * hd), ("o_proj", D)):
                w[p + f"self_attn.{name}.bias"] = _normal(g, n, std=0.3)
        if c.get("qk_layernorm"):  # RMSNorm over each head's vector (not OLMoE's full-width q/k norm)
            w[p + "self_attn.q_norm.weight"] = norm_weight(hd) * 1.5
            w[p + "self_attn.k_norm.weight"] = norm_weight(hd) * 1.5
        w[p + "post_attention_layernorm.weight"] = norm_weight(D)
        if c["moe_layer_freq"][i] == 0:
            mlp(p + "mlp.", c["dense_intermediate_size"])
            continue
        w[p + "mlp.gate.weight"] = _normal(g, E, D, std=0.25)
        if c.get("moe_router_enable_expert_bias"):
            w[p + "mlp.expert_bias"] = _normal(g, E, std=0.05)  # softmax probabilities are ~1/E: bias of that order
        for e in range(E):
            mlp(p + f"mlp.experts.{e}.", c["expert_intermediate_size"], std_in=0.2, std_out=0.15)
        if c.get("shared_expert_intermediate_size") is not None:
            mlp(p + "shared_expert.", c["shared_expert_intermediate_size"])  # under the layer, not under mlp
    w["model.norm.weight"] = norm_weight(D)
    w["lm_head.weight"] = _head(g, V, D)
    return _save(path, config, w, dtype, sharded, generation_config)


def load_tensors(path) -> dict:
    """All tensors of a checkpoint: model.safetensors, or the shards model.safetensors.index.json names."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(str(path / "model.safetensors"))
    tensors = {}
    for file in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(str(path / file)))
    return tensors


# --------------------------------------------------------------------------------------- shared pieces

def _rms_norm(x, weight, eps):
    """LLaDA2MoeRMSNorm / LLaDAMoERMSNorm: normalise in float32, back to x's dtype, then scale."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _linear(w, x, name):
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def _swiglu(w, x, prefix):
    """LLaDA2MoeMLP / LLaDAMoEMLP: down(silu(gate(x)) * up(x)), no biases."""
    return (F.silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) \
        @ w[prefix + "down_proj.weight"].T


def _partial_rotary(t, positions, theta, rotary_dim):
    """Rotary on the first `rotary_dim` dims of t (B, heads, T, hd), rotate-half (NeoX) inside that slice, the
    rest passes through ([D1] apply_rotary_pos_emb with rotary_dim = cos.shape[-1]; [I1] the same).

    inv_freq = theta^(-arange(0, rd, 2) / rd) as transformers 4.5x's default rope init, with rd = int(head_dim *
    partial_rotary_factor); cos / sin in float32, then in t's dtype."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    angles = positions[:, None].float() * inv[None, :]
    angles = torch.cat([angles, angles], -1)  # (T, rd)
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
    rot, rest = t[..., :rotary_dim], t[..., rotary_dim:]
    half1, half2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    rot = rot * cos + torch.cat([-half2, half1], -1) * sin
    return torch.cat([rot, rest], -1)


def _attend(q, k, v, mask):
    """softmax(q k^T / sqrt(hd) + mask) v for q (B, H, T, hd), k, v (B, Hkv, S, hd) (GQA: each kv head serves
    H / Hkv query heads, repeat_kv). mask: None (full attention), bool (T, S) (True = may attend), or float (T, S)
    added to the scores (0 / -inf, or [D3a]'s 0 / 1).

    Computed with torch's scaled_dot_product_attention and an additive mask in q's dtype, which is what the
    references run (attn_implementation "sdpa"; [I1]'s LLaDAMoESdpaAttention calls it directly). An explicit
    softmax differs from SDPA's CPU kernel by about one float32 ulp per step, which the final norm and lm_head turn
    into ~2e-5 on logits of magnitude ~20: above the 1e-5 the parity harness holds these checkpoints to."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    elif mask is not None:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5)


def block_causal_mask(length: int, block_length: int) -> torch.Tensor:
    """(length, length) bool: query i sees key j when j's block is not after i's (bidirectional inside a block).
    [D2] generate builds it as tril(ones(nb, nb)) repeated over blocks, `.log()` (0 / -inf), in bfloat16."""
    blocks = torch.arange(length) // block_length
    return blocks[:, None] >= blocks[None, :]


# ------------------------------------------------------------------------------------------- LLaDA2.x

# [D1] LLaDA2MoeConfig's defaults for keys a config.json may leave out.
_LLADA2_DEFAULTS = {"use_qkv_bias": False, "use_qk_norm": True, "use_bias": True, "rms_norm_eps": 1e-5,
                    "rope_theta": 10000.0, "num_experts": 16, "num_shared_experts": 0, "num_experts_per_tok": 2,
                    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 0,
                    "head_dim": None, "partial_rotary_factor": 0.5, "num_key_value_heads": 0}


def _llada2_config(raw: dict) -> dict:
    c = {**_LLADA2_DEFAULTS, **raw}
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]  # [D3] maps 0 to MHA
    return c


class ReferenceLLaDA2:
    """`LLaDA2MoeModelLM.forward` at inference ([D1]/[D2]/[D3]: the model code is the same in all three), from raw
    tensors. Call it as `model(ids, mask=None, positions=None)` -> logits (B, T, V) float32: the output at position i
    predicts the token at i (no shift: "LLaDA2.0 will use same label position logits")."""

    def __init__(self, path):
        path = Path(path)
        self.c = _llada2_config(json.loads((path / "config.json").read_text()))
        self.w = load_tensors(path)
        c = self.c
        self.rotary_dim = int(c["head_dim"] * c["partial_rotary_factor"])  # LLaDA2MoeAttention.rope_dim

    @torch.no_grad()
    def __call__(self, ids, mask=None, positions=None):
        return self.forward(ids, mask, positions)[0]

    @torch.no_grad()
    def router_choices(self, ids, mask=None, positions=None):
        """Per MoE layer (in order): (expert ids (B*T, k) sorted ascending per token, their combine weights (B*T, k)
        float32, i.e. the renormalised and scaled unbiased sigmoid scores), for the tokens of `ids` flattened."""
        return self.forward(ids, mask, positions)[1]

    def forward(self, ids, mask=None, positions=None):
        c, w = self.c, self.w
        B, T = ids.shape
        H, Hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        positions = torch.arange(T) if positions is None else positions
        h = w["model.word_embeddings.weight"][ids]  # (B, T, D); no embedding scale
        choices = []
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = _rms_norm(h, w[p + "input_layernorm.weight"], c["rms_norm_eps"])
            # fused QKV: (B, T, H + 2 Hkv, hd), split along the head axis into H, Hkv, Hkv heads
            qkv = _linear(w, a, p + "attention.query_key_value").view(B, T, H + 2 * Hkv, hd)
            q, k, v = (t.transpose(1, 2) for t in qkv.split([H, Hkv, Hkv], dim=2))
            if c["use_qk_norm"]:  # per-head RMSNorm over hd, before rotary
                q = _rms_norm(q, w[p + "attention.query_layernorm.weight"], c["rms_norm_eps"])
                k = _rms_norm(k, w[p + "attention.key_layernorm.weight"], c["rms_norm_eps"])
            q = _partial_rotary(q, positions, c["rope_theta"], self.rotary_dim)
            k = _partial_rotary(k, positions, c["rope_theta"], self.rotary_dim)
            att = _attend(q, k, v, mask).transpose(1, 2).reshape(B, T, H * hd)
            h = h + _linear(w, att, p + "attention.dense")
            f = _rms_norm(h, w[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
            if c["num_experts"] is None or i < c["first_k_dense_replace"]:  # LLaDA2MoeDecoderLayer's rule
                h = h + _swiglu(w, f, p + "mlp.")
            else:
                y, choice = self._moe(f, p + "mlp.")
                h = h + y
                choices.append(choice)
        h = _rms_norm(h, w["model.norm.weight"], c["rms_norm_eps"])
        return (h @ w["lm_head.weight"].T).float(), choices

    def route(self, x, prefix):
        """`LLaDA2MoeGate.forward` for tokens x (N, D): (expert ids (N, k) in selection order, weights (N, k) fp32).

        Router logits and sigmoid scores in float32 whatever the model dtype; the expert bias is added for the
        selection only (aux-loss-free balancing); group-limited top-k: a group's score is the sum of its two best
        biased scores, the `topk_group` best groups stay, top-k experts among them; the combine weights are the
        UNBIASED scores of the chosen experts, renormalised over them when k > 1 (config `norm_topk_prob` is not
        read), times `routed_scaling_factor`."""
        c, w = self.c, self.w
        E, k, n_group = c["num_experts"], c["num_experts_per_tok"], c["n_group"]
        scores = torch.sigmoid(x.float() @ w[prefix + "gate.weight"].float().T)  # (N, E)
        biased = scores + w.get(prefix + "gate.expert_bias", torch.zeros(E))  # a registered buffer: zeros if absent
        N = x.shape[0]
        group_scores = biased.view(N, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # (N, n_group)
        kept = group_scores.topk(c["topk_group"], dim=-1, sorted=False).indices
        group_keep = torch.zeros(N, n_group, dtype=torch.bool).scatter(1, kept, True)
        expert_keep = group_keep[:, :, None].expand(N, n_group, E // n_group).reshape(N, E)
        idx = biased.masked_fill(~expert_keep, float("-inf")).topk(k, dim=-1).indices  # (N, k)
        weight = scores.gather(1, idx)
        if k > 1:
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        return idx, weight * c["routed_scaling_factor"]

    def _moe(self, x, prefix):
        """`LLaDA2MoeSparseMoeBlock` at eval (`moe_infer`): each chosen expert's output in the model dtype, weighted and
        summed over the k choices in float32, back to the model dtype; the shared expert (width
        moe_intermediate_size * num_shared_experts) is added after."""
        c, w = self.c, self.w
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        idx, weight = self.route(flat, prefix)
        N, k = idx.shape
        # moe_infer's order: the (token, slot) pairs sorted by expert with the same argsort call, each expert run
        # once on its rows in that order (the row order within a batch changes float rounding, nothing else)
        by_expert = idx.view(-1).argsort()
        counts = torch.bincount(idx.view(-1), minlength=c["num_experts"]).tolist()
        out = torch.zeros(N * k, D, dtype=x.dtype)
        start = 0
        for e, n in enumerate(counts):
            pairs = by_expert[start:start + n]
            if n:
                out[pairs] = _swiglu(w, flat[pairs // k], prefix + f"experts.{e}.")
            start += n
        y = (out.view(N, k, D).float() * weight[..., None]).sum(1).to(x.dtype)
        if c["num_shared_experts"]:
            y = y + _swiglu(w, flat, prefix + "shared_experts.")
        order = idx.argsort(-1)
        return y.view(B, T, D), (idx.gather(1, order), weight.gather(1, order))


def llada2_sample(logits, temperature=0.0, top_k=None, top_p=None):
    """`_sample_with_temperature_topk_topp` of [D2]: (tokens, probabilities) for logits (n, V).

    temperature 0 (the greedy branch [D2] added; [D1] has none and samples at temperature 1 there): argmax of
    softmax(logits) and its probability ([D3] takes argmax of the logits: the same but for exact ties). Otherwise
    logits / T (unless T is 1), top-k, then top-p (a token goes once the mass before it exceeds p; the first stays),
    softmax, one multinomial draw per row in one call (global RNG); the probability is under the filtered softmax."""
    if temperature == 0.0:
        probs = logits.softmax(-1)
        token = probs.argmax(-1)
        return token, probs.gather(-1, token[:, None])[:, 0]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = logits.topk(top_k).values[..., -1:]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        drop_sorted = sorted_logits.softmax(-1).cumsum(-1) > top_p
        drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    token = torch.multinomial(probs, num_samples=1)
    return token[:, 0], probs.gather(-1, token)[:, 0]


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """`_get_num_transfer_tokens`: block_length over `steps` steps, the first ones get the remainder (none if 0)."""
    return [block_length // steps + (1 if i < block_length % steps else 0) for i in range(steps)]


def _cut_at_eos(x, P, gen_length, eos_id):
    """The generation x[P : P + gen_length] up to and including its first eos."""
    gen = x[P:P + gen_length]
    hits = (gen == eos_id).nonzero()
    return gen[: int(hits[0, 0]) + 1] if len(hits) else gen


def _window_mask(end, block_length, additive_01):
    """The mask of the window [0, end): bool block-causal, or [D3a]'s additive 0 / 1 float (1 where visible)."""
    mask = block_causal_mask(end, block_length)
    return mask.float() if additive_01 else mask


@torch.no_grad()
def llada2_generate(model, prompt_ids, gen_length, *, block_length=32, steps=32, threshold=0.95, temperature=0.0,
                    top_k=None, top_p=None, eos_early_stop=False, minimal_topk=1, eos_id, mask_id, return_trace=False):
    """LLaDA2.0's `LLaDA2MoeModelLM.generate` ([D2], the revision with the greedy branch), batch one: returns
    (ids, nfe) or (ids, nfe, trace) with trace = the absolute positions committed by each forward.

    `model(ids (1, L), mask=(L, L) bool)` -> logits (1, L, V). The rules:
    - steps = min(steps, gen_length // minimal_topk); the canvas is ceil((P + gen_length) / B) blocks of B; the
      schedule splits B over the steps (the first steps get the remainder; zeros when steps > B).
    - Blocks from P // B on: the block holding the prompt's tail is decoded first, its prompt tokens re-encoded with
      its masks. Each step runs the whole prefix [0, end of block) with the block-causal mask and positions 0 .. end-1
      (no cache), samples the block's B positions, and among the still-masked ones commits ALL whose probability is
      > threshold if there are at least the schedule's count of them, else the top min(count, masks left) by
      probability. A step is skipped (and the block ends) once the block has no masks. Committed tokens never change.
    - eos_early_stop: after a step that committed an eos, take the first eos of the whole window [0, end) (the prompt
      included); if nothing between the prompt and it is still masked, return x[P : that eos + 1] at once: the
      generation only ([D1] returns the prompt too), and it may run past gen_length into the last block's tail.
    - After each block: stop if the generation so far (x[P : end]) holds an eos.
    - The result is x[P : P + gen_length] up to and including its first eos.
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    P, B = len(prompt), block_length
    steps = min(steps, gen_length // minimal_topk)
    num_blocks = (P + gen_length + B - 1) // B
    x = torch.full((num_blocks * B,), mask_id, dtype=torch.long)
    x[:P] = prompt
    schedule = transfer_schedule(B, steps) if steps > 0 else []
    nfe, trace = 0, []

    def done(ids):
        return (ids, nfe, trace) if return_trace else (ids, nfe)

    for block in range(P // B, num_blocks):
        end = (block + 1) * B
        for step in range(steps):
            active = x[end - B:end] == mask_id
            if not active.any():
                break
            logits = model(x[None, :end], mask=block_causal_mask(end, B))[0, -B:]  # (B, V)
            nfe += 1
            x0, p = llada2_sample(logits, temperature, top_k, top_p)
            confidence = torch.where(active, p, torch.tensor(float("-inf")))
            high = confidence > threshold
            if int(high.sum()) >= schedule[step]:
                transfer = high
            else:
                transfer = torch.zeros(B, dtype=torch.bool)
                transfer[confidence.topk(min(schedule[step], int(active.sum()))).indices] = True
            x[end - B:end][transfer] = x0[transfer]
            trace.append((transfer.nonzero()[:, 0] + end - B).tolist())
            if eos_early_stop and (x0[transfer] == eos_id).any():
                first = int((x[:end] == eos_id).nonzero()[0, 0])
                if not (x[P:first] == mask_id).any():
                    return done(x[P:first + 1].clone())
        if (x[P:end] == eos_id).any():
            break
    return done(_cut_at_eos(x, P, gen_length, eos_id).clone())


@torch.no_grad()
def llada21_generate(model, prompt_ids, gen_length, *, block_length=32, steps=32, threshold=0.95,
                     editing_threshold=0.9, max_post_steps=16, num_to_transfer=1, temperature=0.0, top_k=None,
                     top_p=None, eos_early_stop=False, minimal_topk=1, eos_id, mask_id, additive_01_mask=False,
                     return_trace=False):
    """LLaDA2.1's `generate` with token editing ([D3]), batch one: returns (ids, nfe) or (ids, nfe, trace) with trace
    = per forward (M2T positions, T2T positions), absolute.

    Same canvas, blocks, window mask and sampler as `llada2_generate`; `steps` (and so minimal_topk) is computed but
    unused: there is no schedule. Each block loops:
    - old = the block; active = its masks. If none are left, post_steps += 1; stop the block once post_steps exceeds
      max_post_steps (so max_post_steps=0 runs no forward after the block is filled).
    - one forward of the window; x0, p from the sampler.
    - M2T (mask to token), if masks are left: all masked positions with p > threshold if there are at least
      num_to_transfer of them, else the top min(num_to_transfer, masks left) by p.
    - T2T (token to token): positions that were not masks before this step and are not prompt tokens, with
      p > editing_threshold and x0 != old. Both sets are written at once.
    - the block ends when it had no masks before this step and nothing was edited.
    After each block, with eos_early_stop only: stop if x[P : end] has no masks and holds an eos (there is no
    unconditional eos stop as in 2.0). The result is x[P : P + gen_length] up to and including its first eos.

    additive_01_mask=True restates [D3a] (the first vendoring): it builds the block mask without `.log()`, so the
    forward adds 1 to the scores of visible pairs and 0 to the rest instead of masking: earlier blocks see later
    ones. dllm fixed it in 62ebe4f3 ("producing correct additive mask"); the default restates the fixed [D3].
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    P, B = len(prompt), block_length
    num_blocks = (P + gen_length + B - 1) // B
    x = torch.full((num_blocks * B,), mask_id, dtype=torch.long)
    x[:P] = prompt
    nfe, trace = 0, []
    for block in range(P // B, num_blocks):
        start, end = block * B, (block + 1) * B
        prompt_in_block = torch.arange(start, end) < P
        post_steps = 0
        while True:
            old = x[start:end].clone()
            active = old == mask_id
            if not active.any():
                post_steps += 1
            if post_steps > max_post_steps:
                break
            logits = model(x[None, :end], mask=_window_mask(end, B, additive_01_mask))[0, -B:]
            nfe += 1
            x0, p = llada2_sample(logits, temperature, top_k, top_p)
            m2t = torch.zeros(B, dtype=torch.bool)
            if active.any():
                confidence = torch.where(active, p, torch.tensor(float("-inf")))
                high = (confidence > threshold) & active
                if int(high.sum()) >= num_to_transfer:
                    m2t = high
                else:
                    m2t[confidence.topk(min(num_to_transfer, int(active.sum()))).indices] = True
            editable = ~active & ~prompt_in_block
            t2t = editable & (torch.where(editable, p, torch.tensor(float("-inf"))) > editing_threshold) & (x0 != old)
            both = m2t | t2t
            x[start:end][both] = x0[both]
            trace.append(((m2t.nonzero()[:, 0] + start).tolist(), (t2t.nonzero()[:, 0] + start).tolist()))
            if not active.any() and not t2t.any():
                break
        if eos_early_stop:
            gen = x[P:end]
            if not (gen == mask_id).any() and (gen == eos_id).any():
                break
    ids = _cut_at_eos(x, P, gen_length, eos_id).clone()
    return (ids, nfe, trace) if return_trace else (ids, nfe)


# ------------------------------------------------------------------------------------------- LLaDA-MoE

class ReferenceLLaDAMoE:
    """`LLaDAMoEModelLM.forward` at inference ([I1]) from raw tensors: full bidirectional attention, every attention
    mask ignored (the decoder layer and all three attention classes set it to None), no KV cache, no logit shift.

    `model(x, attention_mask=None)` -> logits (B, L, V) in the model dtype ([I1] does not cast them): the interface
    tests/llada_reference.py's `reference_generate` (LLaDA's generate.py) and `fast_dllm_generate(cache="none")` call,
    so LLaDA-MoE's decoding is run by passing this object there."""

    def __init__(self, path):
        path = Path(path)
        self.c = json.loads((path / "config.json").read_text())
        self.w = load_tensors(path)
        c = self.c
        self.H = c["num_attention_heads"]
        self.Hkv = c.get("num_key_value_heads") or self.H  # LLaDAConfig: None means MHA
        self.hd = c["hidden_size"] // self.H  # no head_dim field
        self.rotary_dim = int(self.hd * c["partial_rotary_factor"])

    @torch.no_grad()
    def __call__(self, x, attention_mask=None):
        return self.forward(x)[0]

    @torch.no_grad()
    def router_choices(self, x):
        """Per MoE layer: (expert ids (B*L, k) sorted ascending per token, their raw combine weights (B*L, k) float32:
        softmax probabilities (plus the expert bias, if any), not renormalised)."""
        return self.forward(x)[1]

    def forward(self, x, attention_mask=None):
        c, w = self.c, self.w
        B, L = x.shape
        H, Hkv, hd, eps = self.H, self.Hkv, self.hd, c["rms_norm_eps"]
        positions = torch.arange(L)
        h = w["model.embed_tokens.weight"][x]
        choices = []
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = _rms_norm(h, w[p + "input_layernorm.weight"], eps)
            q = _linear(w, a, p + "self_attn.q_proj")
            k = _linear(w, a, p + "self_attn.k_proj")
            if c.get("qk_layernorm"):  # q.reshape(-1, hd) -> RMSNorm -> back: per head
                q = _rms_norm(q.reshape(B, L, H, hd), w[p + "self_attn.q_norm.weight"], eps).reshape(B, L, -1)
                k = _rms_norm(k.reshape(B, L, Hkv, hd), w[p + "self_attn.k_norm.weight"], eps).reshape(B, L, -1)
            v = _linear(w, a, p + "self_attn.v_proj")
            if c.get("clip_qkv") is not None:  # after the q/k norm
                q, k, v = (t.clamp(-c["clip_qkv"], c["clip_qkv"]) for t in (q, k, v))
            q = q.view(B, L, H, hd).transpose(1, 2)
            k = k.view(B, L, Hkv, hd).transpose(1, 2)
            v = v.view(B, L, Hkv, hd).transpose(1, 2)
            q = _partial_rotary(q, positions, c["rope_theta"], self.rotary_dim)
            k = _partial_rotary(k, positions, c["rope_theta"], self.rotary_dim)
            att = _attend(q, k, v, None).transpose(1, 2).reshape(B, L, H * hd)
            h = h + _linear(w, att, p + "self_attn.o_proj")
            f = _rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
            if c["moe_layer_freq"][i] == 0:
                h = h + _swiglu(w, f, p + "mlp.")
                continue
            y, choice = self._moe(f, p)
            if p + "shared_expert.gate_proj.weight" in w:  # added to the routed output, from the same input
                y = y + _swiglu(w, f, p + "shared_expert.")
            h = h + y
            choices.append(choice)
        h = _rms_norm(h, w["model.norm.weight"], eps)
        return h @ w["lm_head.weight"].T, choices

    def route(self, x, prefix):
        """`LLaDAMoESparseMoeBlock`'s router for tokens x (N, D): router logits in the model dtype, softmax in
        float32, plus the expert bias when there is one (the biased values are both what top-k ranks and the combine
        weights), top-k, no renormalisation (norm_topk_prob is hard-coded False; score function, groups and scaling
        are not read). Returns (ids (N, k) in selection order, weights (N, k) float32)."""
        probs = F.softmax(x @ self.w[prefix + "mlp.gate.weight"].T, dim=1, dtype=torch.float32)
        if prefix + "mlp.expert_bias" in self.w:
            probs = probs + self.w[prefix + "mlp.expert_bias"]
        weight, idx = probs.topk(self.c["num_experts_per_tok"], dim=-1)
        return idx, weight

    def _moe(self, x, prefix):
        """Each expert runs on its tokens; its output times the weight (cast to the model dtype) is index-added
        into a zero buffer, experts in order 0 .. E-1 ([I1])."""
        B, L, D = x.shape
        flat = x.reshape(-1, D)
        idx, weight = self.route(flat, prefix)
        weight_m = weight.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in range(self.c["num_experts"]):
            rows, slots = (idx == e).nonzero(as_tuple=True)
            if len(rows):
                expert = _swiglu(self.w, flat[rows], prefix + f"mlp.experts.{e}.") * weight_m[rows, slots, None]
                out.index_add_(0, rows, expert)
        order = idx.argsort(-1)
        return out.view(B, L, D), (idx.gather(1, order), weight.gather(1, order))
