"""Token sampling shared by both decoders: top-k / top-p filtering, then argmax or Gumbel-max.

Gumbel-max follows LLaDA's `add_gumbel_noise`: argmax of exp(logits) / (-log u)^T in float64,
because low-precision Gumbel noise hurts MDM generation quality (arXiv:2409.02908). It samples
from softmax(logits / T). Logits are shifted by their row max first (same argmax, no overflow).
"""
import torch


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf; (..., V) -> (..., V)."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None,
                  top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """(..., V) logits -> (...) token ids. Top-k / top-p select from the tempered distribution
    softmax(logits / T), as transformers and vLLM do."""
    if top_k is not None or top_p is not None:
        kept = filter_logits(logits / temperature if temperature > 0 else logits, top_k, top_p)
        logits = logits.masked_fill(torch.isinf(kept), float("-inf"))
    if temperature == 0:
        return logits.argmax(-1)
    shifted = logits.double() - logits.double().amax(-1, keepdim=True)
    noise = torch.rand(shifted.shape, generator=generator, dtype=torch.float64, device=logits.device)
    return (shifted.exp() / (-torch.log(noise)) ** temperature).argmax(-1)
