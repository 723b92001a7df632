"""An independent, deliberately plain restatement of the LLaDA reference for parity tests.

- `reference_forward`: LLaDA's LLaDALlamaBlock forward written from the checkpoint's raw OLMo
  tensors (no kstep model code), absolute positions, optional key padding mask.
- `reference_generate`: the semantics of ML-GSAI/LLaDA `generate.py` (commit b7e6c35): full-canvas
  logits every step, per-row top-k over the whole canvas with -inf confidence outside the current
  block, `get_num_transfer_tokens`' even split, unsupervised CFG with the prompt masked, and its
  global-RNG draws in its order: `add_gumbel_noise` (rand_like over the logits (B, L, V), float64,
  nothing at temperature 0), then `random` remasking's torch.rand((B, L)) over the whole canvas.
- `fast_dllm_generate`: the semantics of NVlabs/Fast-dLLM `llada/generate.py` (commit f6b35ec)
  `generate` / `generate_with_prefix_cache` / `generate_with_dual_cache` at temperature 0 with the
  fixed schedule, `threshold` (`get_transfer_index`) or `factor` (`get_transfer_index_dynamic`) and
  either remasking: `random` draws torch.rand((B, W)) over every position of the pass (W: the canvas
  in a block's first, full pass; [block start, end) in a prefix pass; the block in a dual pass). The
  cache holds pre-rotary keys as LLaDA's model code does; the prefix mode concatenates the prefix
  cache with a fresh pass over [block start, end); the dual mode overwrites the block's slots of the
  full cache and attends to all of it. Rows without padding (Fast-dLLM takes no attention mask); with
  `factor`, rows must finish each block together (there a row without masks raises IndexError).
Written for clarity, with per-row loops, exactly as the reference orders its operations.
"""
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class ReferenceLLaDA:
    def __init__(self, path: Path):
        self.c = json.loads((path / "config.json").read_text())
        self.w = load_file(str(path / "model.safetensors"))

    def _norm(self, x, weight):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"])).to(x.dtype)

    def _rope(self, t, first_position=0):
        """Rotary for t (B, H, T, hd) at positions first_position .. first_position + T - 1."""
        hd, T = t.shape[-1], t.shape[2]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.einsum("i,j->ij", torch.arange(first_position, first_position + T).float(), inv)
        pos = torch.cat([freqs, freqs], -1)
        x1, x2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * pos.cos() + torch.cat([-x2, x1], -1) * pos.sin()

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward(x, attention_mask)[0]

    @torch.no_grad()
    def forward(self, x, attention_mask=None, past=None, replace_start=None):
        """Logits and per-layer pre-rotary (k, v). `past` without `replace_start`: keys = past + new
        (queries sit after the past); with `replace_start`: new keys overwrite past slots from there."""
        c, w = self.c, self.w
        B, L = x.shape
        H, Hkv, D = c["n_heads"], c["n_kv_heads"], c["d_model"]
        hd = D // H
        h = w["model.transformer.wte.weight"][x]
        bias = None
        if attention_mask is not None:
            bias = torch.zeros(B, 1, 1, L).masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        present = []
        for i in range(c["n_layers"]):
            p = f"model.transformer.blocks.{i}."
            a = self._norm(h, w[p + "attn_norm.weight"])
            q = (a @ w[p + "q_proj.weight"].T).view(B, L, H, hd).transpose(1, 2)
            k = (a @ w[p + "k_proj.weight"].T).view(B, L, Hkv, hd).transpose(1, 2)
            v = (a @ w[p + "v_proj.weight"].T).view(B, L, Hkv, hd).transpose(1, 2)
            q_start = 0
            if past is not None and replace_start is None:
                q_start = past[i][0].shape[2]
                k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
            elif past is not None:
                q_start = replace_start
                k, v = past[i][0].clone(), past[i][1].clone()
                new_k = (a @ w[p + "k_proj.weight"].T).view(B, L, Hkv, hd).transpose(1, 2)
                new_v = (a @ w[p + "v_proj.weight"].T).view(B, L, Hkv, hd).transpose(1, 2)
                k[:, :, replace_start:replace_start + L], v[:, :, replace_start:replace_start + L] = new_k, new_v
            present.append((k, v))
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
            q, k = self._rope(q, q_start), self._rope(k)
            scores = q @ k.transpose(-1, -2) / hd ** 0.5
            if bias is not None:
                scores = scores + bias
            att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D)
            h = h + att @ w[p + "attn_out.weight"].T
            f = self._norm(h, w[p + "ff_norm.weight"])
            gated = F.silu(f @ w[p + "ff_proj.weight"].T) * (f @ w[p + "up_proj.weight"].T)
            h = h + gated @ w[p + "ff_out.weight"].T
        h = self._norm(h, w["model.transformer.ln_f.weight"])
        head = w["model.transformer.wte.weight"] if c["weight_tying"] else w["model.transformer.ff_out.weight"]
        return (h @ head.T)[..., : c["vocab_size"]], present


def _num_transfer_tokens(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    counts = block_mask.sum(dim=1, keepdim=True)
    out = torch.zeros(counts.size(0), steps, dtype=torch.int64) + counts // steps
    for row in range(counts.size(0)):
        out[row, : int(counts[row] % steps)] += 1
    return out


def _add_gumbel_noise(logits, temperature):
    """LLaDA's `add_gumbel_noise`: nothing drawn at temperature 0; else rand_like over all of logits
    (B, L, V) in float64 from the global RNG."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    return logits.exp() / (-torch.log(torch.rand_like(logits, dtype=torch.float64))) ** temperature


def _remasking_scores(logits, x0, remasking, dtype):
    """x0_p as the references score it: the argmax's probability, or `random`'s torch.rand((B, L))
    from the global RNG over every position of the pass (after any Gumbel draw)."""
    if remasking == "low_confidence":
        return torch.gather(F.softmax(logits.to(dtype), -1), -1, x0.unsqueeze(-1)).squeeze(-1)
    if remasking == "random":
        return torch.rand((x0.shape[0], x0.shape[1]), device=x0.device)
    raise NotImplementedError(remasking)


@torch.no_grad()
def reference_generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128,
                       temperature=0.0, cfg_scale=0.0, remasking="low_confidence", mask_id=None):
    """LLaDA's generate: the draws of its global RNG in its order (Gumbel noise, then `random`'s)."""
    B, P = prompt.shape
    x = torch.full((B, P + gen_length), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones(B, gen_length, dtype=attention_mask.dtype)], -1)
    prompt_index = x != mask_id
    num_blocks = gen_length // block_length
    steps = steps // num_blocks
    for b in range(num_blocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        transfer = _num_transfer_tokens(x[:, lo:hi] == mask_id, steps)
        for i in range(steps):
            mask_index = x == mask_id
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                am = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
                cond, uncond = model(torch.cat([x, un_x]), am).chunk(2)
                logits = uncond + (cfg_scale + 1) * (cond - uncond)
            else:
                logits = model(x, attention_mask)
            x0 = _add_gumbel_noise(logits, temperature).argmax(-1)
            x0_p = _remasking_scores(logits, x0, remasking, logits.dtype)
            x0_p[:, hi:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(float("-inf")))
            chosen = torch.zeros_like(x0, dtype=torch.bool)
            for row in range(B):
                chosen[row, torch.topk(confidence[row], k=int(transfer[row, i])).indices] = True
            x[chosen] = x0[chosen]
    return x


def _fast_dllm_transfer(logits, mask_index, x, num_transfer, threshold, factor, remasking):
    """Fast-dLLM's `get_transfer_index` (fixed count or threshold) and `get_transfer_index_dynamic`
    (factor) at temperature 0, per row as there."""
    x0 = logits.argmax(-1)
    x0_p = _remasking_scores(logits, x0, remasking, torch.float64)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, torch.tensor(float("-inf"), dtype=x0_p.dtype))
    chosen = torch.zeros_like(x0, dtype=torch.bool)
    for row in range(x.shape[0]):
        num_masked = int(mask_index[row].sum())
        if factor is not None:
            bars = [-1] + [1 - factor / (n + 1) for n in range(2, num_masked + 1)]  # the first always passes
            ordered = torch.sort(confidence[row][mask_index[row]], descending=True)[0]
            for k in range(len(bars)):
                if ordered[k] < bars[k]:
                    break
            k = k + 1 if k in (0, len(bars) - 1) else k  # the quirk: a failure at the last one takes all
            chosen[row, torch.topk(confidence[row], k=k).indices] = True
            continue
        k = num_masked if threshold is not None else int(num_transfer[row])
        top = torch.topk(confidence[row], k=k).indices
        chosen[row, top] = True
        if threshold is not None:
            for j in range(1, k):
                if confidence[row, top[j]] < threshold:
                    chosen[row, top[j]] = False
    return x0, chosen


@torch.no_grad()
def fast_dllm_generate(model, prompt, cache, steps, gen_length, block_length, mask_id, threshold=None, factor=None,
                       remasking="low_confidence"):
    """Returns (canvas, nfe) as Fast-dLLM's generate / _with_prefix_cache / _with_dual_cache."""
    B, P = prompt.shape
    x = torch.full((B, P + gen_length), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    nfe = 0

    def transfer(logits, mask_index, window, i):
        return _fast_dllm_transfer(logits, mask_index, window, counts[:, min(i, steps_per_block - 1)], threshold,
                                   factor, remasking)

    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        counts = _num_transfer_tokens(x[:, start:end] == mask_id, steps_per_block)
        if cache == "none":
            i = 0
            while True:
                nfe += 1
                mask_index = x == mask_id
                mask_index[:, end:] = False
                x0, chosen = transfer(model(x), mask_index, x, i)
                x[chosen] = x0[chosen]
                i += 1
                if not (x[:, start:end] == mask_id).any():
                    break
            continue
        logits, past = model.forward(x)
        mask_index = x == mask_id
        mask_index[:, end:] = False
        x0, chosen = transfer(logits, mask_index, x, 0)
        x[chosen] = x0[chosen]
        nfe += 1
        if cache == "prefix":
            past = [(k[:, :, :start], v[:, :, :start]) for k, v in past]
        i = 1
        while (x[:, start:end] == mask_id).any():
            nfe += 1
            if cache == "prefix":
                window = x[:, start:]
                logits, _ = model.forward(window, past=past)
                mask_index = window == mask_id
                mask_index[:, block_length:] = False
            else:
                window = x[:, start:end]
                logits, past = model.forward(window, past=past, replace_start=start)
                mask_index = window == mask_id
            x0, chosen = transfer(logits, mask_index, window, i)
            window[chosen] = x0[chosen]
            i += 1
    return x, nfe
