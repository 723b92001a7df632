"""An independent, deliberately plain restatement of the Dream-v0 reference for parity tests.

- `write_dream_checkpoint`: a tiny random checkpoint in Dream-v0's on-disk layout (config.json with
  DreamConfig's keys, generation_config.json with DreamGenerationConfig's, model.safetensors with
  Qwen2 tensor names: q/k/v biases, o_proj without one, an untied lm_head).
- `ReferenceDream`: the DreamModel forward written from those raw tensors (no kstep code): Qwen2
  layers with bidirectional attention, rotary at explicit position ids, an optional 4D bool mask
  (a query row with nothing to attend to gives zeros, as torch's SDPA does), and the two cached
  forwards of NVlabs/Fast-dLLM `dream/model/modeling_dream.py` (commit 24cc59e): the cache holds
  the pre-rotary k_proj / v_proj outputs; `past` alone concatenates it before the fresh keys
  (prefix cache), `past` with `replace_start` overwrites its slots from there (dual cache).
- `sample_tokens`: `sample_tokens` of `dream/model/generation_utils.py` (top-p, top-k, the
  confidence of maskgit_plus / topk_margin / entropy).
- `dream_generate`: `DreamGenerationMixin._sample` of `dream/model/generation_utils.py` (the full
  canvas: algs origin, maskgit_plus, topk_margin, entropy, confidence_threshold).
- `dream_block_generate`: `_sample` of `dream/model/generation_utils_block.py` (block by block, a
  full pass per block that also commits the block's first token, then prefix- or dual-cache passes
  over the block; its fixed schedule always scores by negative entropy, whatever `alg` says).

Both samplers return (canvas, number of forward passes) and use the global torch RNG exactly where
the reference does. Written for clarity, with per-row loops, in the reference's order of operations.
"""
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# Token ids of the tiny vocabulary: ordinary tokens are 0 .. FIRST_SPECIAL_ID - 1; like Dream-v0
# (Qwen2.5's <|endoftext|> = 151643 is bos, eos and pad at once, <|im_end|> = 151645 ends a turn,
# <|mask|> = 151666) the specials sit at the top, followed by a few never-trained rows up to vocab_size.
FIRST_SPECIAL_ID = 300
ENDOFTEXT_ID = 300  # bos = eos = pad
IM_START_ID, IM_END_ID = 301, 302
MASK_ID = 310


def write_dream_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """A tiny random Dream-v0 checkpoint in `path` (config.json keys may be overridden); returns the path.

    The weights are scaled so that the logits are spread out (argmax probabilities from ~0.15 to ~0.99,
    no ties), the end-of-text row of lm_head is a little longer (some completions end early), and
    the lm_head row of the mask token is zero: its logit is 0 while the
    largest logit is well above, so the mask token is never an argmax (real Dream never predicts it;
    the reference samplers would otherwise leave it, or re-mask other positions, see the spec).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": ENDOFTEXT_ID,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 176,
        "mask_token_id": MASK_ID,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "model_type": "Dream",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": ENDOFTEXT_ID,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.46.2",
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": 320,
    }
    config.update(overrides)
    # Dream-v0's generation_config.json: note mask_token_id is null there (config.json has it).
    generation_config = {
        "_from_model_config": True,
        "alg": "origin",
        "alg_temp": None,
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "eps": 0.001,
        "mask_token_id": None,
        "output_history": False,
        "pad_token_id": config["pad_token_id"],
        "steps": 512,
        "temperature": 0.0,
        "top_k": None,
        "top_p": None,
        "transformers_version": "4.46.2",
    }

    D, F_, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H, Hkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = D // H
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return torch.randn(*shape, generator=g) * std

    def norm_weight():  # not exactly one, so a missing or wrong norm is caught
        return 0.8 + 0.4 * torch.rand(D, generator=g)

    w = {"model.embed_tokens.weight": normal(V, D, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = normal(H * hd, D, std=0.3)
        w[p + "self_attn.q_proj.bias"] = normal(H * hd, std=0.3)
        w[p + "self_attn.k_proj.weight"] = normal(Hkv * hd, D, std=0.3)
        w[p + "self_attn.k_proj.bias"] = normal(Hkv * hd, std=0.3)
        w[p + "self_attn.v_proj.weight"] = normal(Hkv * hd, D, std=0.3)
        w[p + "self_attn.v_proj.bias"] = normal(Hkv * hd, std=0.3)
        w[p + "self_attn.o_proj.weight"] = normal(D, H * hd, std=0.15)
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        w[p + "mlp.gate_proj.weight"] = normal(F_, D, std=0.15)
        w[p + "mlp.up_proj.weight"] = normal(F_, D, std=0.15)
        w[p + "mlp.down_proj.weight"] = normal(D, F_, std=0.1)
    w["model.norm.weight"] = norm_weight()
    if not config["tie_word_embeddings"]:
        head = normal(V, D, std=0.52)
        head[config["eos_token_id"]] *= 1.6  # end of text now and then, so completions get cut
        head[config["mask_token_id"]] = 0.0
        w["lm_head.weight"] = head
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return path


class ReferenceDream:
    def __init__(self, path):
        path = Path(path)
        self.c = json.loads((path / "config.json").read_text())
        self.w = load_file(str(path / "model.safetensors"))

    def _norm(self, x, weight):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"])).to(x.dtype)

    def _rotary(self, t, positions):
        """Rotate t (B, heads, T, hd) by the angles of `positions` (B, T) (rotate-half convention)."""
        hd = t.shape[-1]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        angles = positions[:, :, None].float() * inv[None, None, :]  # (B, T, hd/2)
        angles = torch.cat([angles, angles], -1)[:, None]  # (B, 1, T, hd)
        half1, half2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * angles.cos().to(t.dtype) + torch.cat([-half2, half1], -1) * angles.sin().to(t.dtype)

    @torch.no_grad()
    def __call__(self, x, attention_mask=None, position_ids=None):
        """Unshifted logits (B, T, V) of a full forward."""
        return self.forward(x, attention_mask, position_ids)[0]

    @torch.no_grad()
    def forward(self, x, attention_mask=None, position_ids=None, past=None, replace_start=None):
        """Logits (B, T, V), unshifted, and per layer the pre-rotary (k, v) the pass attended to,
        each (B, keys, n_kv_heads * head_dim) as Fast-dLLM's cache holds them.

        - no `past`: the T tokens attend to each other; `attention_mask` (B, 1, T, T) bool or None,
          `position_ids` (B, T) or None for 0 .. T-1.
        - `past` without `replace_start` (prefix cache): keys = past then the T fresh ones, at positions
          0 .. len(past) + T - 1; the queries sit at len(past) ...
        - `past` with `replace_start` (dual cache): keys = past with slots [replace_start, + T) replaced by
          the fresh ones, positions 0 .. len(past) - 1; the queries sit at replace_start ...
        The cached forwards attend to every key (no mask), as the block sampler calls them.
        """
        c, w = self.c, self.w
        B, T = x.shape
        H, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
        hd = D // H
        if past is None:
            q_pos = position_ids if position_ids is not None else torch.arange(T).expand(B, T)
        elif replace_start is None:
            q_pos = torch.arange(past[0][0].shape[1], past[0][0].shape[1] + T).expand(B, T)
        else:
            q_pos = torch.arange(replace_start, replace_start + T).expand(B, T)
        h = w["model.embed_tokens.weight"][x]
        present = []
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}.self_attn."
            a = self._norm(h, w[f"model.layers.{i}.input_layernorm.weight"])
            q = a @ w[p + "q_proj.weight"].T + w[p + "q_proj.bias"]
            k = a @ w[p + "k_proj.weight"].T + w[p + "k_proj.bias"]
            v = a @ w[p + "v_proj.weight"].T + w[p + "v_proj.bias"]
            if past is not None and replace_start is None:
                k, v = torch.cat([past[i][0], k], 1), torch.cat([past[i][1], v], 1)
            elif past is not None:
                fresh_k, fresh_v = k, v
                k, v = past[i][0].clone(), past[i][1].clone()
                k[:, replace_start:replace_start + T], v[:, replace_start:replace_start + T] = fresh_k, fresh_v
            present.append((k, v))
            n_keys = k.shape[1]
            k_pos = q_pos if past is None else torch.arange(n_keys).expand(B, n_keys)
            q = self._rotary(q.view(B, T, H, hd).transpose(1, 2), q_pos)
            k = self._rotary(k.view(B, n_keys, Hkv, hd).transpose(1, 2), k_pos)
            v = v.view(B, n_keys, Hkv, hd).transpose(1, 2)
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
            scores = q @ k.transpose(-1, -2) / hd ** 0.5
            if attention_mask is not None:
                scores = scores.masked_fill(~attention_mask, float("-inf"))
            weights = scores.softmax(-1)
            if attention_mask is not None:  # a query with nothing to attend to gets zeros, not NaN
                weights = torch.where(attention_mask.any(-1, keepdim=True), weights, torch.zeros(()))
            att = (weights @ v).transpose(1, 2).reshape(B, T, D)
            h = h + att @ w[p + "o_proj.weight"].T
            m = f"model.layers.{i}.mlp."
            f = self._norm(h, w[f"model.layers.{i}.post_attention_layernorm.weight"])
            gated = F.silu(f @ w[m + "gate_proj.weight"].T) * (f @ w[m + "up_proj.weight"].T)
            h = h + gated @ w[m + "down_proj.weight"].T
        h = self._norm(h, w["model.norm.weight"])
        head = w["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else w["lm_head.weight"]
        return h @ head.T, present


def _shift(logits):
    """Dream predicts token j from the output at j - 1: position 0 keeps its own logits."""
    return torch.cat([logits[:, :1], logits[:, :-1]], 1)


def _keep_top_p(logits, top_p):
    """Nucleus filter: tokens past the smallest prefix (by descending logit) whose mass exceeds top_p
    get the dtype's lowest value; the token that crosses top_p, and the first one, are kept."""
    order = logits.argsort(-1, descending=True)
    sorted_logits = logits.gather(-1, order)
    mass = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = torch.zeros_like(mass, dtype=torch.bool)
    drop_sorted[..., 1:] = mass[..., :-1] > top_p  # a token goes when the ones before it already exceed
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, torch.finfo(logits.dtype).min)


def _keep_top_k(logits, top_k):
    kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[..., -1:]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def sample_tokens(logits, temperature=0.0, top_p=None, top_k=None, margin_confidence=False, neg_entropy=False):
    """(confidence, token) per row of logits (N, V), computed in the logits' dtype.

    Temperature divides the logits first; then top-p, then top-k. The token is the argmax of the
    probabilities at temperature 0, else one categorical draw (global RNG), whose probability is
    the confidence (maskgit_plus). topk_margin replaces the confidence by top1 - top2 probability,
    entropy by sum p * log(p + 1e-10), whatever the token.
    """
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = _keep_top_p(logits, top_p)
    if top_k is not None:
        logits = _keep_top_k(logits, top_k)
    probs = logits.softmax(-1)
    if temperature > 0:
        try:
            token = torch.distributions.Categorical(probs=probs).sample()
            confidence = probs.gather(-1, token[:, None])[:, 0]
        except Exception:  # the reference falls back to the argmax (e.g. NaN probabilities)
            confidence, token = probs.max(-1)
    else:
        confidence, token = probs.max(-1)
    if margin_confidence:
        top2 = probs.sort(-1, descending=True).values
        confidence = top2[:, 0] - top2[:, 1]
    if neg_entropy:
        confidence = (probs * torch.log(probs + 1e-10)).sum(-1)
    return confidence, token


def _dream_attention(attention_mask, max_length):
    """Dream's `_sample` preamble: with any padding, the padded mask extended by ones over the
    canvas, tok_idx = cumsum - 1 (pads at 1) and a (B, 1, L, L) bool mask of real-real pairs;
    without padding no mask and default positions."""
    if attention_mask is None or not (attention_mask == 0).any():
        return None, None
    am = F.pad(attention_mask, (0, max_length - attention_mask.shape[1]), value=1)
    tok_idx = am.long().cumsum(-1) - 1
    tok_idx = tok_idx.masked_fill(am == 0, 1)
    real = am.bool()
    return real[:, None, None, :] & real[:, None, :, None], tok_idx


def _by_confidence(confidence, count, alg_temp):
    """Indices (B, count) of the positions to unmask: top-count of each row, or `count` draws without
    replacement from softmax(confidence / alg_temp) (global RNG, one call for the batch)."""
    if alg_temp is None or alg_temp == 0:
        return torch.stack([confidence[row].topk(count).indices for row in range(confidence.shape[0])])
    return torch.multinomial((confidence / alg_temp).softmax(-1), num_samples=count)


@torch.no_grad()
def dream_generate(model, input_ids, attention_mask=None, *, max_length, steps=512, alg="origin", alg_temp=None,
                   temperature=0.0, top_p=None, top_k=None, eps=1e-3, mask_token_id, threshold=0.9,
                   positions="tok_idx"):
    """Dream's full-canvas `_sample`; returns (canvas, forward passes).

    positions="tok_idx" passes Dream's tok_idx as position ids (the original Dream-org modeling
    honours them); "arange" reproduces Fast-dLLM's modeling_dream.py, which overwrites them with
    0 .. L-1 (they differ only for left-padded batches).
    """
    B = input_ids.shape[0]
    x = F.pad(input_ids, (0, max_length - input_ids.shape[1]), value=mask_token_id)
    mask4d, tok_idx = _dream_attention(attention_mask, max_length)
    if positions == "arange":
        tok_idx = None
    timesteps = torch.linspace(1, eps, steps + 1)
    if alg == "confidence_threshold":
        total = int((x == mask_token_id).sum())
        assert total % steps == 0 and B == 1, "confidence_threshold: batch 1, masks divisible by steps"
        per_step, carry = total // steps, 0
    nfe, i = 0, 0
    while i < steps:
        mask_index = x == mask_token_id
        logits = _shift(model.forward(x, mask4d, tok_idx)[0])
        nfe += 1
        mask_logits = logits[mask_index]  # row-major over (row, position)
        if alg != "confidence_threshold":
            t, s = timesteps[i], timesteps[i + 1]

        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            tokens = torch.full((mask_logits.shape[0],), mask_token_id, dtype=torch.long)
            reveal = torch.rand(mask_logits.shape[0]) < p_transfer
            tokens[reveal] = sample_tokens(mask_logits[reveal], temperature, top_p, top_k)[1]
            x[mask_index] = tokens

        elif alg == "confidence_threshold":
            confidence, tokens = sample_tokens(mask_logits, temperature, top_p, top_k)
            proposal = torch.full_like(x, mask_token_id)
            proposal[mask_index] = tokens
            full_confidence = torch.full(x.shape, float("-inf"), dtype=logits.dtype)
            full_confidence[mask_index] = confidence
            count = per_step + carry
            carry = 0
            top = full_confidence[0].topk(count)
            chosen = [int(j) for j in top.indices]
            for k in range(1, count):  # the most confident one always goes
                if top.values[k] < threshold:
                    chosen.remove(int(top.indices[k]))
                    carry += 1
                    if i == steps - 1:  # `steps` is live: only the first refusal at the last step extends
                        per_step = 0
                        steps += 1
            x[0, chosen] = proposal[0, chosen]

        else:
            flags = {"maskgit_plus": {}, "topk_margin": {"margin_confidence": True},
                     "entropy": {"neg_entropy": True}}
            if alg not in flags:
                raise RuntimeError(f"Unknown alg: {alg}")
            confidence, tokens = sample_tokens(mask_logits, temperature, top_p, top_k, **flags[alg])
            mean_masked = mask_index.sum() / B  # float32: the mean over the batch, not per row
            count = int(mean_masked * (1 - s / t)) if i < steps - 1 else int(mean_masked)
            full_confidence = torch.full(x.shape, float("-inf"), dtype=logits.dtype)
            full_confidence[mask_index] = confidence
            if count > 0:
                chosen = _by_confidence(full_confidence, count, alg_temp)
                proposal = torch.full_like(x, mask_token_id)
                proposal[mask_index] = tokens
                for row in range(B):
                    x[row, chosen[row]] = proposal[row, chosen[row]]
        i += 1
    return x, nfe


@torch.no_grad()
def dream_block_generate(model, input_ids, *, max_length, steps, block_length=32, cache="prefix", alg="entropy",
                         alg_temp=None, temperature=0.0, top_p=None, top_k=None, eps=1e-3, mask_token_id,
                         threshold=0.9):
    """Fast-dLLM's block `_sample` (generation_utils_block.py) for unpadded prompts; returns
    (canvas, forward passes). cache="prefix" or "dual" (its `dual_cache`). alg="confidence_threshold"
    is the threshold path (`steps` only has to be a multiple of the number of blocks there); any other
    alg is the fixed path, which scores by negative entropy whatever alg says."""
    B, P = input_ids.shape
    x = F.pad(input_ids, (0, max_length - P), value=mask_token_id)
    gen_length = max_length - P
    assert gen_length % block_length == 0 and steps % (gen_length // block_length) == 0
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    timesteps = torch.linspace(1, eps, steps_per_block + 1)
    if alg == "confidence_threshold":
        assert B == 1, "the threshold path only updates row 0"
    nfe = 0
    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        # A full pass: it refreshes the cache and commits the block's first token, whatever its confidence.
        logits, past = model.forward(x)
        nfe += 1
        first = sample_tokens(_shift(logits).reshape(B * max_length, -1), temperature, top_p, top_k)[1]
        x[:, start] = first.view(B, max_length)[:, start]
        if cache == "prefix":
            past = [(k[:, :start], v[:, :start]) for k, v in past]
        i = 1
        while True:
            lo, hi = start, (end if cache == "dual" else max_length)  # the window the pass computes
            mask_index = x[:, lo:hi] == mask_token_id
            if cache == "dual":
                logits, past = model.forward(x[:, lo:hi], past=past, replace_start=start)
            else:
                logits, _ = model.forward(x[:, lo:hi], past=past)
            nfe += 1
            logits = _shift(logits)  # within the window: its first position keeps its own logits
            if alg == "confidence_threshold":
                confidence, tokens = sample_tokens(logits[mask_index], temperature, top_p, top_k)
                proposal = torch.full_like(x[:, lo:hi], mask_token_id)
                proposal[mask_index] = tokens
                full_confidence = torch.full((B, hi - lo), float("-inf"), dtype=logits.dtype)
                full_confidence[mask_index] = confidence
                full_confidence[:, block_length:] = float("-inf")
                count = int((x[:, start:end] == mask_token_id).sum())
                top = full_confidence[0].topk(count)
                chosen = [int(j) for j in top.indices[:1]]
                chosen += [int(j) for j, value in zip(top.indices[1:], top.values[1:]) if not value < threshold]
                x[0, [lo + j for j in chosen]] = proposal[0, chosen]
            else:
                if i == steps_per_block:  # only reached when steps_per_block == 1: a wasted pass
                    break
                t, s = timesteps[i], timesteps[i + 1]
                mask_index[:, block_length:] = False
                confidence, tokens = sample_tokens(logits[mask_index], temperature, top_p, top_k, neg_entropy=True)
                mean_masked = mask_index.sum() / B
                count = int(mean_masked * (1 - s / t)) if i < steps_per_block - 1 else int(mean_masked)
                full_confidence = torch.full((B, hi - lo), float("-inf"), dtype=logits.dtype)
                full_confidence[mask_index] = confidence
                full_confidence[:, block_length:] = float("-inf")
                if count > 0:
                    chosen = _by_confidence(full_confidence, count, alg_temp)
                    proposal = torch.full_like(x[:, lo:hi], mask_token_id)
                    proposal[mask_index] = tokens
                    for row in range(B):
                        x[row, lo + chosen[row]] = proposal[row, chosen[row]]
                i += 1
            if not (x[:, start:end] == mask_token_id).any():
                break
    return x, nfe
