"""An independent, deliberately plain restatement of the LLaDA reference for parity tests.

- `reference_forward`: LLaDA's LLaDALlamaBlock forward written from the checkpoint's raw OLMo
  tensors (no kstep model code), absolute positions, optional key padding mask.
- `reference_generate`: the semantics of ML-GSAI/LLaDA `generate.py` (commit b7e6c35): full-canvas
  logits every step, per-row top-k over the whole canvas with -inf confidence outside the current
  block, `get_num_transfer_tokens`' even split, unsupervised CFG with the prompt masked.
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

    def _rope(self, t, L):
        hd = t.shape[-1]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.einsum("i,j->ij", torch.arange(L).float(), inv)
        pos = torch.cat([freqs, freqs], -1)
        x1, x2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * pos.cos() + torch.cat([-x2, x1], -1) * pos.sin()

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        c, w = self.c, self.w
        B, L = x.shape
        H, Hkv, D = c["n_heads"], c["n_kv_heads"], c["d_model"]
        hd = D // H
        h = w["model.transformer.wte.weight"][x]
        bias = None
        if attention_mask is not None:
            bias = torch.zeros(B, 1, 1, L).masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        for i in range(c["n_layers"]):
            p = f"model.transformer.blocks.{i}."
            a = self._norm(h, w[p + "attn_norm.weight"])
            q = (a @ w[p + "q_proj.weight"].T).view(B, L, H, hd).transpose(1, 2)
            k = (a @ w[p + "k_proj.weight"].T).view(B, L, Hkv, hd).transpose(1, 2)
            v = (a @ w[p + "v_proj.weight"].T).view(B, L, Hkv, hd).transpose(1, 2)
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
            q, k = self._rope(q, L), self._rope(k, L)
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
        return (h @ head.T)[..., : c["vocab_size"]]


def _num_transfer_tokens(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    counts = block_mask.sum(dim=1, keepdim=True)
    out = torch.zeros(counts.size(0), steps, dtype=torch.int64) + counts // steps
    for row in range(counts.size(0)):
        out[row, : int(counts[row] % steps)] += 1
    return out


@torch.no_grad()
def reference_generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128,
                       cfg_scale=0.0, remasking="low_confidence", mask_id=None):
    """Temperature-0 LLaDA sampling (temperature > 0 draws from a different random stream)."""
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
            x0 = logits.argmax(-1)
            if remasking == "low_confidence":
                x0_p = torch.gather(F.softmax(logits, -1), -1, x0.unsqueeze(-1)).squeeze(-1)
            else:
                raise NotImplementedError(remasking)
            x0_p[:, hi:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(float("-inf")))
            chosen = torch.zeros_like(x0, dtype=torch.bool)
            for row in range(B):
                chosen[row, torch.topk(confidence[row], k=int(transfer[row, i])).indices] = True
            x[chosen] = x0[chosen]
    return x
