"""An independent, deliberately plain restatement of two block-diffusion references for parity tests.

Block diffusion (BD3-LM style): attention is bidirectional inside a block of `block_size` tokens and
causal across blocks; a block is decoded by masked-diffusion steps while the blocks before it sit in
a KV cache; once a block has no masks it is run once more and its keys/values are appended to the cache.
The full semantics, sources and quirks are written down in block_spec.md (the research notes).

Fast-dLLM v2 (NVlabs/Fast-dLLM `v2/`, commit 65b6c8f, and the `modeling.py` published with the
checkpoint Efficient-Large-Model/Fast_dLLM_v2_7B):
- `write_fast_dllm_v2_checkpoint`: a tiny random checkpoint in its layout (config.json with
  Fast_dLLM_QwenConfig's keys incl. `bd_size`, no mask id in it; generation_config.json as shipped,
  never read by its samplers; Qwen2 tensor names: q/k/v biases, o_proj without, untied lm_head).
- `ReferenceFastDllmV2`: `Fast_dLLM_QwenModel.forward` at inference from the raw tensors: keys are
  cached after rotary, the committed cache is concatenated before the fresh keys, the optional block
  cache has its slots overwritten in place (`replace_position`), and the bool mask `eval_mask`
  (block-causal, with the block size the call passes: 32 when none is passed).
- `fast_dllm_v2_generate`: `Fast_dLLM_QwenForCausalLM.generate` of modeling.py (batch one).
- `fast_dllm_v2_batch_sample`: `batch_sample` of v2/generation_functions.py (what v2/eval.py runs),
  prompts of different lengths right-padded with the mask id.
  Both shift logits (the token at j is read from the output at j - 1; the first of a window keeps its own).

SDAR (JetAstra/SDAR, commit c2041a8: `generate.py`, `evaluation/opencompass/opencompass/models/
huggingface_bd3.py`, `training/model/SDAR-*-Chat/modeling_sdar.py`):
- `write_sdar_checkpoint`: a tiny random checkpoint in its layout (config.json with SDARConfig's keys
  incl. `block_size`, `mask_token_id`, explicit `head_dim`; generation_config.json; Qwen3 tensor names:
  per-head q_norm / k_norm, no biases, untied lm_head).
- `ReferenceSDAR`: `SDARModel.forward` at inference (q/k RMSNorm over head_dim before rotary, cache
  after rotary, explicit position ids, bool (T, S) mask or none).
- `sdar_generate`: `block_diffusion_generate` of generate.py (variant="generate") or of
  huggingface_bd3.py (variant="opencompass"). No shift: the output at j predicts the token at j.

Every sampler returns the output ids and the number of model calls (forward passes), and draws from
the global torch RNG exactly where the reference does. Written for clarity, not speed.
"""
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# Token ids of the tiny vocabulary: ordinary tokens are 0 .. 299; the specials sit above them like
# Qwen2.5's / Qwen3's (<|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, the mask token
# 151665 "|<MASK>|" in Fast-dLLM v2, 151669 "<|MASK|>" in SDAR), then never-trained rows up to 320.
FIRST_SPECIAL_ID = 300
ENDOFTEXT_ID = 300  # bos; Fast-dLLM v2's tokenizer pad; SDAR's eos and pad
IM_START_ID, IM_END_ID = 301, 302  # <|im_end|>: Fast-dLLM v2's stop token (and config eos/pad)
MASK_ID = 310


def _normal(g, *shape, std):
    return torch.randn(*shape, generator=g) * std


def _write(path, config, generation_config, tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return path


def write_fast_dllm_v2_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """A tiny random Fast-dLLM v2 checkpoint in `path` (config.json keys may be overridden).

    Like the real one, config.json has `bd_size` but no mask token id (the samplers take mask_id and
    stop_token as arguments, defaulting to 151665 / 151645); add "mask_token_id" through `overrides`
    if a loader needs it there. The <|im_end|> row of lm_head is a little longer (completions stop),
    and the mask row is zero (the model never proposes the mask token; the reference would loop).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Fast_dLLM_QwenForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                     "AutoModel": "modeling.Fast_dLLM_QwenModel",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "bd_size": 8,
        "bos_token_id": ENDOFTEXT_ID,
        "conplemenrary_mask": True,  # sic: the published key
        "eos_token_id": IM_END_ID,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 176,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "model_type": "Fast_dLLM_Qwen",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": IM_END_ID,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.53.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 320,
    }
    config.update(overrides)
    if "layer_types" not in overrides:
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    # As shipped (Qwen2.5-Instruct's); no Fast-dLLM v2 sampler reads it.
    generation_config = {"bos_token_id": ENDOFTEXT_ID, "do_sample": True, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
                         "pad_token_id": ENDOFTEXT_ID, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20,
                         "top_p": 0.8, "transformers_version": "4.53.1"}
    D, F_, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H, Hkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = D // H
    g = torch.Generator().manual_seed(seed)

    def norm_weight():  # not exactly one, so a missing or wrong norm is caught
        return 0.8 + 0.4 * torch.rand(D, generator=g)

    w = {"model.embed_tokens.weight": _normal(g, V, D, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = _normal(g, H * hd, D, std=0.3)
        w[p + "self_attn.q_proj.bias"] = _normal(g, H * hd, std=0.3)
        w[p + "self_attn.k_proj.weight"] = _normal(g, Hkv * hd, D, std=0.3)
        w[p + "self_attn.k_proj.bias"] = _normal(g, Hkv * hd, std=0.3)
        w[p + "self_attn.v_proj.weight"] = _normal(g, Hkv * hd, D, std=0.3)
        w[p + "self_attn.v_proj.bias"] = _normal(g, Hkv * hd, std=0.3)
        w[p + "self_attn.o_proj.weight"] = _normal(g, D, H * hd, std=0.15)
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        w[p + "mlp.gate_proj.weight"] = _normal(g, F_, D, std=0.15)
        w[p + "mlp.up_proj.weight"] = _normal(g, F_, D, std=0.15)
        w[p + "mlp.down_proj.weight"] = _normal(g, D, F_, std=0.1)
    w["model.norm.weight"] = norm_weight()
    head = _normal(g, V, D, std=0.7)  # argmax probabilities from ~0.3 to ~0.98
    head[FIRST_SPECIAL_ID + 3:] *= 0.3  # the never-trained rows above the chat specials rarely win
    head[IM_END_ID] *= 1.6  # the stop token now and then
    head[MASK_ID] = 0.0
    if config["tie_word_embeddings"]:
        w["model.embed_tokens.weight"] = head  # a tied checkpoint stores no lm_head.weight
    else:
        w["lm_head.weight"] = head
    return _write(path, config, generation_config, w)


def write_sdar_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """A tiny random SDAR checkpoint in `path` (config.json keys may be overridden).

    head_dim is 32 although hidden_size / num_attention_heads is 16 (as in SDAR-4B: 2560 / 32 = 80 but
    head_dim 128), so q_proj is (128, 64). The <|endoftext|> and <|im_end|> rows of lm_head are a little
    longer (completions stop), the mask row is zero.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_implementation": "flex_attention",
        "bos_token_id": ENDOFTEXT_ID,
        "debug": False,
        "eos_token_id": ENDOFTEXT_ID,
        "block_size": 4,
        "mask_token_id": MASK_ID,
        "ep_size": 1,
        "fuse_cross_entropy": True,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 176,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "micro_forward": False,
        "model_type": "sdar",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "skip_checkpoint": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.52.4",
        "use_cache": False,
        "use_deepep": False,
        "use_sliding_window": False,
        "vocab_size": 320,
    }
    config.update(overrides)
    generation_config = {"bos_token_id": ENDOFTEXT_ID, "do_sample": True, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
                         "pad_token_id": ENDOFTEXT_ID, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                         "transformers_version": "4.51.0"}
    D, F_, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H, Hkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    bias = config["attention_bias"]
    g = torch.Generator().manual_seed(seed)

    def norm_weight(n):
        return 0.8 + 0.4 * torch.rand(n, generator=g)

    w = {"model.embed_tokens.weight": _normal(g, V, D, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(D)
        w[p + "self_attn.q_proj.weight"] = _normal(g, H * hd, D, std=0.3)
        w[p + "self_attn.k_proj.weight"] = _normal(g, Hkv * hd, D, std=0.3)
        w[p + "self_attn.v_proj.weight"] = _normal(g, Hkv * hd, D, std=0.3)
        w[p + "self_attn.o_proj.weight"] = _normal(g, D, H * hd, std=0.1)
        if bias:
            for name, n in (("q_proj", H * hd), ("k_proj", Hkv * hd), ("v_proj", Hkv * hd), ("o_proj", D)):
                w[p + f"self_attn.{name}.bias"] = _normal(g, n, std=0.3)
        w[p + "self_attn.q_norm.weight"] = norm_weight(hd) * 1.5  # sharper attention despite the norm
        w[p + "self_attn.k_norm.weight"] = norm_weight(hd) * 1.5
        w[p + "post_attention_layernorm.weight"] = norm_weight(D)
        w[p + "mlp.gate_proj.weight"] = _normal(g, F_, D, std=0.15)
        w[p + "mlp.up_proj.weight"] = _normal(g, F_, D, std=0.15)
        w[p + "mlp.down_proj.weight"] = _normal(g, D, F_, std=0.1)
    w["model.norm.weight"] = norm_weight(D)
    head = _normal(g, V, D, std=0.7)
    head[FIRST_SPECIAL_ID + 3:] *= 0.3
    head[ENDOFTEXT_ID] *= 1.4
    head[IM_END_ID] *= 1.4
    head[MASK_ID] = 0.0
    if config["tie_word_embeddings"]:
        w["model.embed_tokens.weight"] = head
    else:
        w["lm_head.weight"] = head
    return _write(path, config, generation_config, w)


class _Reference:
    """Shared pieces of the two Qwen-style forwards; the cache is a list over layers of (k, v),
    each (B, n_kv_heads, keys, head_dim), keys already rotated."""

    def __init__(self, path):
        path = Path(path)
        self.c = json.loads((path / "config.json").read_text())
        self.w = load_file(str(path / "model.safetensors"))
        self.head_dim = self.c.get("head_dim") or self.c["hidden_size"] // self.c["num_attention_heads"]

    def _norm(self, x, weight):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"])).to(x.dtype)

    def _rotary(self, t, positions):
        """Rotate t (B, heads, T, hd) by the angles of `positions` (T,) (rotate-half convention)."""
        hd = t.shape[-1]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        angles = positions[:, None].float() * inv[None, :]
        angles = torch.cat([angles, angles], -1)
        half1, half2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * angles.cos().to(t.dtype) + torch.cat([-half2, half1], -1) * angles.sin().to(t.dtype)

    def _linear(self, x, name):
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if name + ".bias" in self.w else y

    def _qk(self, a, layer, B, T):
        """Projected q (B, H, T, hd), k and v (B, Hkv, T, hd) before rotary."""
        p = f"model.layers.{layer}.self_attn."
        hd = self.head_dim
        q = self._linear(a, p + "q_proj").view(B, T, -1, hd)
        k = self._linear(a, p + "k_proj").view(B, T, -1, hd)
        v = self._linear(a, p + "v_proj").view(B, T, -1, hd)
        if p + "q_norm.weight" in self.w:  # Qwen3 / SDAR: RMSNorm over each head's vector, before rotary
            q, k = self._norm(q, self.w[p + "q_norm.weight"]), self._norm(k, self.w[p + "k_norm.weight"])
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def _attend(q, k, v, mask):
        """Softmax attention of q (B, H, T, hd) over k, v (B, Hkv, S, hd); mask (T, S) bool or None."""
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v

    def _mlp_and_residual(self, h, layer, att):
        B, T = h.shape[:2]
        h = h + self._linear(att.transpose(1, 2).reshape(B, T, -1), f"model.layers.{layer}.self_attn.o_proj")
        m = f"model.layers.{layer}.mlp."
        f = self._norm(h, self.w[f"model.layers.{layer}.post_attention_layernorm.weight"])
        return h + (F.silu(f @ self.w[m + "gate_proj.weight"].T) * (f @ self.w[m + "up_proj.weight"].T)) \
            @ self.w[m + "down_proj.weight"].T

    def _logits(self, h):
        h = self._norm(h, self.w["model.norm.weight"])
        head = self.w["lm_head.weight"] if "lm_head.weight" in self.w else self.w["model.embed_tokens.weight"]
        return h @ head.T


def eval_mask(n_queries, block_size, cache_len):
    """Fast-dLLM v2's `eval_block_diff_mask`: query i sits at cache_len + i, key j at j; the query sees
    the key when the key's block (j // block_size) is not after its own."""
    q = torch.arange(n_queries) + cache_len
    k = torch.arange(n_queries + cache_len)
    return (q[:, None] // block_size) >= (k[None, :] // block_size)


class ReferenceFastDllmV2(_Reference):
    @torch.no_grad()
    def __call__(self, x):
        """Logits (B, T, V), unshifted, of a full pass with the block-causal mask of `bd_size` (as the
        training forward's eval path would with block_size=bd_size)."""
        return self.forward(x, mask=eval_mask(x.shape[1], self.c["bd_size"], 0))[0]

    @torch.no_grad()
    def forward(self, x, past=None, mask=None, block_cache=None, replace_position=None):
        """Logits (B, T, V) (unshifted) and the fresh per-layer (k, v), rotated.

        - past: the committed cache (list of (k, v)) or None; the T queries sit at positions
          len(past) .. len(past) + T - 1, or len(past) + replace_position .. when replace_position is given.
        - block_cache without replace_position is not a thing: the full pass over a block *returns* what
          becomes the block cache. With block_cache and replace_position (a sub-block pass), the fresh
          k, v are written in place into block_cache[layer] slots [replace_position, + T) and the queries
          attend to past + the whole block cache, with no mask (modeling.py passes attention_mask=None).
        - mask: (T, keys) bool for the ordinary pass (keys = past + the fresh ones), or None for all.
        """
        c, w = self.c, self.w
        B, T = x.shape
        cache_len = 0 if past is None else past[0][0].shape[2]
        start = cache_len + (replace_position or 0)
        positions = torch.arange(start, start + T)
        h = w["model.embed_tokens.weight"][x]
        fresh = []
        for i in range(c["num_hidden_layers"]):
            a = self._norm(h, w[f"model.layers.{i}.input_layernorm.weight"])
            q, k, v = self._qk(a, i, B, T)
            q, k = self._rotary(q, positions), self._rotary(k, positions)
            fresh.append((k, v))
            if block_cache is not None:
                bk, bv = block_cache[i]
                bk[:, :, replace_position:replace_position + T] = k  # in place, as the reference does
                bv[:, :, replace_position:replace_position + T] = v
                k, v = bk, bv
            if past is not None:
                k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
            h = self._mlp_and_residual(h, i, self._attend(q, k, v, mask))
        return self._logits(h), fresh


class ReferenceSDAR(_Reference):
    @torch.no_grad()
    def __call__(self, x):
        """Logits (B, T, V), unshifted, of a full pass with the block-causal mask of config block_size."""
        bl = self.c["block_size"]
        idx = torch.arange(x.shape[1]) // bl
        return self.forward(x, torch.arange(x.shape[1]), mask=idx[:, None] >= idx[None, :])[0]

    @torch.no_grad()
    def forward(self, x, positions, past=None, mask=None):
        """Logits (B, T, V) (unshifted) and the fresh per-layer (k, v), rotated. Keys = past then the
        fresh ones; mask (T, keys) bool or None (generate.py's all-ones block rows take flash_attn, no mask)."""
        c, w = self.c, self.w
        B, T = x.shape
        h = w["model.embed_tokens.weight"][x]
        fresh = []
        for i in range(c["num_hidden_layers"]):
            a = self._norm(h, w[f"model.layers.{i}.input_layernorm.weight"])
            q, k, v = self._qk(a, i, B, T)
            q, k = self._rotary(q, positions), self._rotary(k, positions)
            fresh.append((k, v))
            if past is not None:
                k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
            h = self._mlp_and_residual(h, i, self._attend(q, k, v, mask))
        return self._logits(h), fresh


def _append(past, fresh):
    if past is None:
        return [(k.clone(), v.clone()) for k, v in fresh]
    return [(torch.cat([pk, k], 2), torch.cat([pv, v], 2)) for (pk, pv), (k, v) in zip(past, fresh)]


def _shift(logits):
    """Fast-dLLM v2's token shift inside a window: position j takes the logits of j - 1, the first
    position keeps its own."""
    return torch.cat([logits[:, :1], logits[:, :-1]], 1)


def fast_dllm_v2_sample(logits, top_p=0.95, temperature=0.0):
    """`sample_with_top_p` of modeling.py: (tokens, probabilities) for logits (B, n, V).

    Temperature 0: probabilities = softmax(logits), tokens = argmax. Otherwise softmax(logits / T),
    nucleus filter (a token goes when the mass before it already exceeds top_p; the first always stays),
    renormalised, and one multinomial draw per position of row 0 only (global RNG): batch one."""
    if temperature <= 0:
        probs = logits.softmax(-1)
        return probs.argmax(-1), probs
    probs = (logits / temperature).softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    drop_sorted = sorted_probs.cumsum(-1) > top_p
    drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    assert probs.shape[0] == 1, "the reference samples row 0 only: temperature > 0 needs batch one"
    return torch.multinomial(probs[0], num_samples=1)[:, 0][None], probs


def _unmask(x_block, mask_index, logits, lo, hi, threshold, top_p, temperature):
    """One step of threshold decoding over the sub-block [lo, hi) of the block `x_block` (B, bs), in
    place. logits (B, hi - lo, V) already shifted. Returns (tokens, chosen) over the sub-block."""
    tokens, probs = fast_dllm_v2_sample(logits, top_p, temperature)
    confidence = probs.gather(-1, tokens[..., None])[..., 0]
    confidence = torch.where(mask_index[:, lo:hi], confidence, torch.tensor(float("-inf")))
    chosen = confidence > threshold  # strictly above
    chosen[torch.arange(x_block.shape[0]), confidence.argmax(-1)] = True  # the most confident always goes
    chosen &= mask_index[:, lo:hi]
    sub = x_block[:, lo:hi]
    sub[chosen] = tokens[chosen]
    return tokens, chosen


def _denoise_pass(model, block, lo, hi, past, state, use_block_cache, attn_block_size, mask_id):
    """The forward of one denoising step of `block` (B, bs) for its sub-block [lo, hi); returns the
    shifted logits over [lo, hi). `state["block_cache"]` is the per-block cache of use_block_cache."""
    cache_len = 0 if past is None else past[0][0].shape[2]
    bs = block.shape[1]
    if use_block_cache and (state["block_cache"] is None or (block[:, lo] == mask_id).any()):
        # the whole block, and its k/v become the block cache
        logits, fresh = model.forward(block, past=past, mask=eval_mask(bs, attn_block_size, cache_len))
        state["block_cache"] = [(k.clone(), v.clone()) for k, v in fresh]
        return _shift(logits)[:, lo:hi]
    if use_block_cache:  # only the sub-block is run; it overwrites its slots of the block cache
        logits, _ = model.forward(block[:, lo:hi], past=past, block_cache=state["block_cache"], replace_position=lo)
        return _shift(logits)  # within the sub-block: its first position keeps its own logits
    logits, _ = model.forward(block, past=past, mask=eval_mask(bs, attn_block_size, cache_len))
    return _shift(logits)[:, lo:hi]


@torch.no_grad()
def fast_dllm_v2_generate(model, input_ids, *, max_new_tokens, block_size=32, small_block_size=8, threshold=1.0,
                          mask_id=151665, stop_token=151645, use_block_cache=False, top_p=0.95, temperature=0.0,
                          attn_block_size=32):
    """`Fast_dLLM_QwenForCausalLM.generate` of modeling.py for one prompt (1, P); returns (ids, passes).

    The ids are the prompt and what was generated, cut just after the first stop token if there is one.
    attn_block_size is the block size of the denoising passes' mask: modeling.py passes none there, so
    its forward's default 32 applies (only the prefill and commit passes get block_size).
    """
    assert input_ids.shape[0] == 1
    bs, P0 = block_size, input_ids.shape[1]
    x = input_ids.clone()
    nfe = 0
    past = None
    if P0 > bs:  # prefill the prompt's whole blocks (a prompt of exactly bs tokens is never seen: see spec)
        n = P0 // bs * bs
        logits, fresh = model.forward(x[:, :n], mask=eval_mask(n, bs, 0))
        nfe += 1
        past = _append(None, fresh)
        if P0 % bs == 0:  # the next block's first token, read autoregressively (argmax, any temperature)
            x = torch.cat([x, logits[:, -1].argmax(-1)[:, None]], 1)
    state = {}

    def stop_reached(prompt_length):
        gen = x[0, prompt_length:]
        hits = (gen == stop_token).nonzero()
        return len(hits) > 0 and not (gen[: int(hits[0, 0])] == mask_id).any()

    for _ in range(max_new_tokens // bs):
        if (x[0, P0:] == stop_token).any():
            break
        prompt_length = x.shape[1]
        x = torch.cat([x, torch.full((1, bs - prompt_length % bs), mask_id, dtype=torch.long)], 1)
        state["block_cache"] = None
        while True:
            if stop_reached(prompt_length):
                break
            if not (x[:, -bs:] == mask_id).any():  # the block is done: commit its k/v, read the next token
                cache_len = 0 if past is None else past[0][0].shape[2]
                logits, fresh = model.forward(x[:, -bs:], past=past, mask=eval_mask(bs, bs, cache_len))
                nfe += 1
                past = _append(past, fresh)
                x = torch.cat([x, logits[:, -1].argmax(-1)[:, None]], 1)
                break
            for lo in range(0, bs, small_block_size):
                hi = lo + small_block_size
                while True:
                    mask_index = x[:, -bs:] == mask_id
                    if not mask_index[:, lo:hi].any() or stop_reached(prompt_length):
                        break
                    logits = _denoise_pass(model, x[:, -bs:], lo, hi, past, state, use_block_cache, attn_block_size,
                                           mask_id)
                    nfe += 1
                    block = x[:, -bs:]
                    _unmask(block, mask_index, logits, lo, hi, threshold, top_p, temperature)
                    x[:, -bs:] = block
    hits = (x[0, P0:] == stop_token).nonzero()
    if len(hits):
        x = x[:, : P0 + int(hits[0, 0]) + 1]
    return x, nfe


@torch.no_grad()
def fast_dllm_v2_batch_sample(model, prompts, *, max_new_tokens, block_size=32, small_block_size=8, threshold=0.95,
                              mask_id=151665, stop_token=151645, pad_id=151643, use_block_cache=False, top_p=0.95,
                              temperature=0.0, attn_block_size=32):
    """`batch_sample` of v2/generation_functions.py (as v2/eval.py calls it) for a list of 1-D prompts;
    returns (list of 1-D outputs in the prompts' order, passes).

    The prompts are right-padded with mask_id to the longest, so a shorter prompt's padding is simply
    generated. Rows stop when a sub-block step unmasks their stop token; the block is still finished,
    everything after the row's first stop (after its prompt) becomes pad_id, and the row leaves the batch
    (and the cache) after that block. An output is the row's canvas up to the end of its last block plus,
    when that block was committed, the token read after it (pad_id for a finished row).
    """
    bs = block_size
    seq_len = torch.tensor([len(p) for p in prompts])
    B, max_len, min_len = len(prompts), int(seq_len.max()), int(seq_len.min())
    x = torch.full((B, max_len), mask_id, dtype=torch.long)
    for row, p in enumerate(prompts):
        x[row, : len(p)] = p
    num_blocks = max_new_tokens // bs + max_len // bs
    nfe = 0
    past = None
    if min_len > bs:
        n = min_len // bs * bs
        logits, fresh = model.forward(x[:, :n], mask=eval_mask(n, bs, 0))
        nfe += 1
        past = _append(None, fresh)
        if min_len % bs == 0:
            rows = seq_len == min_len
            token = logits[rows, -1].argmax(-1)
            if x.shape[1] <= min_len:  # all prompts have min_len tokens
                x = torch.cat([x, token[:, None]], 1)
            else:
                x[rows, min_len] = token
    seq_block = seq_len // bs
    finished = torch.zeros(B, dtype=torch.bool)
    alive = torch.arange(B)  # original index of each row still in the batch
    outputs = {}
    state = {}
    xt = x
    for block_idx in range(min_len // bs, num_blocks):
        if finished.all():
            break
        if (seq_block == block_idx).all():  # every row generates from this block on: open it with masks
            x = torch.cat([x, torch.full((x.shape[0], bs - x.shape[1] % bs), mask_id, dtype=torch.long)], 1)
            xt = x.clone()
        else:  # some prompts still run through this block (their padding masks get generated)
            xt = x[:, : (block_idx + 1) * bs].clone()
        xt[finished, -bs:] = pad_id  # (never any: finished rows leave at the end of their block)
        state["block_cache"] = None
        while True:
            if not (xt[:, -bs:] == mask_id).any():
                for row in range(xt.shape[0]):
                    if finished[row] and seq_len[row] < (block_idx + 1) * bs:
                        first = int((xt[row, seq_len[row]:] == stop_token).nonzero()[0, 0])
                        xt[row, int(seq_len[row]) + first + 1:] = pad_id
                if finished.all():
                    break
                cache_len = 0 if past is None else past[0][0].shape[2]
                logits, fresh = model.forward(xt[:, -bs:], past=past, mask=eval_mask(bs, bs, cache_len))
                nfe += 1
                past = _append(past, fresh)
                token = logits[:, -1].argmax(-1)
                token[finished] = pad_id
                xt = torch.cat([xt, token[:, None]], 1)
                break
            for lo in range(0, bs, small_block_size):
                hi = lo + small_block_size
                while True:
                    mask_index = xt[:, -bs:] == mask_id
                    if not mask_index[:, lo:hi].any():
                        break
                    logits = _denoise_pass(model, xt[:, -bs:], lo, hi, past, state, use_block_cache, attn_block_size,
                                            mask_id)
                    nfe += 1
                    block = xt[:, -bs:]
                    tokens, chosen = _unmask(block, mask_index, logits, lo, hi, threshold, top_p, temperature)
                    xt[:, -bs:] = block
                    finished |= ((tokens == stop_token) & chosen).any(1)
        # carry the block (and the token read after it) back into the canvas
        end = (block_idx + 1) * bs
        if x.shape[1] == xt.shape[1]:
            x = xt
        else:
            x[:, :end] = xt[:, :-1]
            if (seq_block == block_idx).all():
                x = torch.cat([x, xt[:, -1:]], 1)
            elif x.shape[1] <= end:
                x = xt
            else:  # rows whose prompt ended in this block take the token read after it; others keep their prompt
                rows = seq_block == block_idx
                x[rows, end] = xt[rows, end]
        seq_block[seq_block == block_idx] = block_idx + 1
        if finished.any():
            for row in range(xt.shape[0]):
                if finished[row]:
                    outputs[int(alive[row])] = xt[row].clone()
            keep = ~finished
            alive, x, seq_block, seq_len, xt = alive[keep], x[keep], seq_block[keep], seq_len[keep], xt[keep]
            if past is not None:  # the reference indexes the cache unconditionally: a TypeError (see spec)
                past = [(k[keep], v[keep]) for k, v in past]
            finished = finished[keep]
    for row in range(xt.shape[0]):  # rows that never stopped
        outputs[int(alive[row])] = xt[row].clone()
    return [outputs[i] for i in range(B)], nfe


# ----------------------------------------------------------------------------------------------- SDAR

def _top_k(logits, k):
    if k <= 0:
        return logits
    kth = logits.topk(k).values[..., -1:]
    return torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)


def _top_p(logits, p):
    sorted_logits, order = logits.sort(-1, descending=True)
    drop_sorted = sorted_logits.softmax(-1).cumsum(-1) > p
    drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sdar_sample(logits, temperature=1.0, top_k=0, top_p=1.0, confidence="filtered"):
    """(tokens, confidence) for logits (B, n, V), as SDAR's `sample_with_temperature_topk_topp`.

    Logits are divided by the temperature (unless it is 1), then top-k, then top-p; one multinomial draw
    per position (global RNG, one call over all B * n rows). The confidence is the drawn token's
    probability under the filtered distribution (generate.py: confidence="filtered"; with top_k=1 it is
    always 1) or under softmax(logits / T) before filtering (huggingface_bd3.py: "unfiltered").
    temperature=0 (not in either reference) is greedy: the argmax and its softmax(logits) probability,
    i.e. exactly what huggingface_bd3.py yields with temperature=1, top_k=1.
    """
    B, n, V = logits.shape
    flat = logits.reshape(-1, V)
    if temperature == 0:
        probs = flat.softmax(-1)
        conf, token = probs.max(-1)
        return token.view(B, n), conf.view(B, n)
    if temperature != 1.0:
        flat = flat / temperature
    unfiltered = flat.softmax(-1)
    if top_k > 0:
        flat = _top_k(flat, top_k)
    if top_p < 1.0:
        flat = _top_p(flat, top_p)
    probs = flat.softmax(-1)
    token = torch.multinomial(probs, num_samples=1)
    conf = (probs if confidence == "filtered" else unfiltered).gather(-1, token)
    return token.view(B, n), conf.view(B, n)


def num_transfer_tokens(block_length, steps):
    """`get_num_transfer_tokens`: block_length split evenly over the steps, the first ones get the rest."""
    counts = torch.full((steps,), block_length // steps, dtype=torch.int64)
    counts[: block_length % steps] += 1
    return counts


@torch.no_grad()
def sdar_generate(model, input_ids, *, mask_id, gen_length=128, block_length=4, denoising_steps=4,
                  temperature=1.0, top_k=0, top_p=1.0, remasking_strategy="low_confidence_dynamic",
                  confidence_threshold=0.85, stop_ids=None, variant="generate"):
    """SDAR's `block_diffusion_generate` for one prompt (1, P); returns (canvas, passes).

    variant="generate" (generate.py): remasking_strategy in low_confidence_dynamic (threshold
      `confidence_threshold`, at least num_transfer_tokens[step]), low_confidence_static, sequential;
      confidence = filtered probability; a transfer may overwrite a non-mask position (see spec).
    variant="opencompass" (huggingface_bd3.py, what the paper's evaluation ran): remasking_strategy
      "low_confidence" or "random", dynamic when confidence_threshold < 1 else static; confidence =
      unfiltered probability; positions that are not masks keep their token; block_length must be a
      multiple of denoising_steps.
    The canvas is ceil((P + gen_length) / block_length) * block_length long; blocks after the one where
    a stop id first appears (anywhere after the prompt) stay masks.
    """
    assert input_ids.shape[0] == 1
    bl = block_length
    P = input_ids.shape[1]
    num_blocks = (P + gen_length + bl - 1) // bl
    x = torch.full((1, num_blocks * bl), mask_id, dtype=torch.long)
    x[:, :P] = input_ids
    block_of = torch.arange(num_blocks * bl) // bl
    if variant == "opencompass":
        assert bl % denoising_steps == 0 and bl >= denoising_steps
    nfe = 0
    past = None
    prefill_blocks = P // bl
    if prefill_blocks > 0:
        n = prefill_blocks * bl
        _, fresh = model.forward(x[:, :n], torch.arange(n), mask=block_of[:n, None] >= block_of[None, :n])
        nfe += 1
        past = _append(None, fresh)
    counts = num_transfer_tokens(bl, denoising_steps)
    for b in range(prefill_blocks, num_blocks):
        lo, hi = b * bl, (b + 1) * bl
        cur = x[:, lo:hi].clone()
        positions = torch.arange(lo, hi)
        for step in range(denoising_steps + 1):
            mask_index = cur == mask_id
            if not mask_index.any():  # the block is done: run it once more and store its k/v
                _, fresh = model.forward(cur, positions, past=past)
                nfe += 1
                past = _append(past, fresh)
                break
            logits, _ = model.forward(cur, positions, past=past)  # the block attends to the cache and itself
            nfe += 1
            if variant == "opencompass":
                # add_gumbel_noise runs on every step, whatever the strategy: at temperature != 0 it draws
                # (1, bl, V) float64 uniforms from the global RNG before anything else is drawn.
                noisy = logits
                if temperature != 0:
                    l64 = logits.double()
                    noisy = l64.exp() / (-torch.log(torch.rand_like(l64))) ** temperature
            if variant == "opencompass" and remasking_strategy == "random":
                x0 = noisy.argmax(-1)
                x0_p = torch.rand(x0.shape)  # the confidence is uniform noise
            else:
                x0, x0_p = sdar_sample(logits, temperature, top_k, top_p,
                                       "unfiltered" if variant == "opencompass" else "filtered")
            count = int(counts[step])
            transfer = torch.zeros_like(mask_index)
            confidence = torch.where(mask_index, x0_p, torch.tensor(float("-inf"), dtype=x0_p.dtype))
            if variant == "opencompass":
                x0 = torch.where(mask_index, x0, cur)
                strategy = "low_confidence_dynamic" if confidence_threshold < 1.0 else "low_confidence_static"
            else:
                strategy = remasking_strategy
            if strategy == "sequential":
                first = int(mask_index[0].nonzero()[0, 0])
                transfer[0, first:first + count] = True
            elif strategy == "low_confidence_static":
                transfer[0, confidence[0].topk(count).indices] = True
            elif strategy == "low_confidence_dynamic":
                high = confidence[0] > confidence_threshold
                if int(high.sum()) >= count:
                    transfer[0] = high
                else:
                    transfer[0, confidence[0].topk(count).indices] = True
            else:  # generate.py's entropy_bounded raises UnboundLocalError before doing anything
                raise NotImplementedError(strategy)
            cur[transfer] = x0[transfer]
        x[:, lo:hi] = cur
        if stop_ids is not None and any(bool((x[0, P:] == s).any()) for s in stop_ids):
            break
    return x, nfe
