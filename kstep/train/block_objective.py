"""The block-diffusion objective (BD3-LM, Arriola et al. 2025, arXiv:2503.09573), for a model
converted from an AR one (Fast-dLLM v2, arXiv:2509.26328; SDAR): attention is bidirectional inside
a block of `block_size` tokens and causal across blocks; each block is noised with its own mask
ratio and denoised given the clean blocks before it.

Vectorised as BD3-LM does: the model runs once on [noisy; clean] (2L positions, each copy at
positions 0..L-1) under one mask: a noisy token sees its own noisy block and the clean blocks
before it; a clean token sees the clean blocks up to its own. Every block's loss comes from one pass.

Logits are shifted as in the AR model the weights came from (Dream, Fast-dLLM v2): masked token j
is predicted by the output at j - 1: in its own noisy block, or, for a block's first token, at the
end of the clean block before it (what decoding has: the finished block's last position).

Complementary masks (Fast-dLLM v2, LLaDA2.0): each sequence also appears with the opposite mask, so
every token is trained once per pair. The loss is the mean cross-entropy over masked tokens
(unweighted: the 1/t weight is an ELBO for likelihoods, not what makes samples confident). With
`certainty_weight` > 0, dParallel's certainty forcing (arXiv:2509.26488) adds the entropy of
softmax(logits / 0.5) at the masked positions the model already predicts correctly.
"""
import torch
import torch.nn.functional as F

from kstep.models import Transformer

CERTAINTY_TEMPERATURE = 0.5  # dParallel


def block_training_mask(length: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(2L, 2L) bool, True = may attend, for the [noisy; clean] layout."""
    block = torch.arange(length, device=device) // block_size
    q, k = block[:, None], block[None, :]
    noisy_noisy = q == k
    noisy_clean = k < q
    clean_clean = k <= q
    clean_noisy = torch.zeros_like(noisy_noisy)
    return torch.cat([torch.cat([noisy_noisy, noisy_clean], 1), torch.cat([clean_noisy, clean_clean], 1)], 0)


def block_mask_draw(tokens: torch.Tensor, block_size: int, generator: torch.Generator | None,
                    prompt_lengths: torch.Tensor | None, ratio_range: tuple[float, float]) -> torch.Tensor:
    """(B, L) bool: which tokens are masked. Each block draws its ratio t ~ U(ratio_range); the
    prompt and position 0 (no output before it to predict it from) are never masked."""
    B, L = tokens.shape
    low, high = ratio_range
    t = low + (high - low) * torch.rand(B, L // block_size, generator=generator, device=tokens.device)
    p = t.repeat_interleave(block_size, dim=1)  # (B, L)
    is_masked = torch.rand(B, L, generator=generator, device=tokens.device) < p
    return is_masked & maskable_positions(tokens, prompt_lengths)


def maskable_positions(tokens: torch.Tensor, prompt_lengths: torch.Tensor | None) -> torch.Tensor:
    """(B, L) bool: positions a mask may cover (not position 0, not the prompt)."""
    index = torch.arange(tokens.shape[1], device=tokens.device)
    maskable = (index > 0).expand(tokens.shape)
    return maskable if prompt_lengths is None else maskable & (index >= prompt_lengths[:, None])


def shifted_sources(length: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(L,) index into the 2L outputs that predicts each position: j - 1 in the noisy copy, or the
    clean copy's j - 1 for a block's first position (position 0 has none; it is never masked)."""
    j = torch.arange(length, device=device)
    return torch.where(j == 0, 0, torch.where(j % block_size == 0, length + j - 1, j - 1))


def block_diffusion_loss(model: Transformer, tokens: torch.Tensor, mask_id: int, block_size: int,
                         generator: torch.Generator | None = None, prompt_lengths: torch.Tensor | None = None,
                         complementary: bool = True, ratio_range: tuple[float, float] = (0.0, 1.0),
                         certainty_weight: float = 0.0) -> torch.Tensor:
    B, L = tokens.shape
    if L % block_size:
        raise ValueError(f"seq_len ({L}) must be a multiple of block_size ({block_size})")
    is_masked = block_mask_draw(tokens, block_size, generator, prompt_lengths, ratio_range)
    if complementary:
        tokens, is_masked = torch.cat([tokens, tokens]), torch.cat([is_masked, maskable_positions(tokens, prompt_lengths)
                                                                     & ~is_masked])
    noisy = torch.where(is_masked, mask_id, tokens)
    positions = torch.arange(L, device=tokens.device).repeat(2).expand(tokens.shape[0], -1)  # (B', 2L)
    mask = block_training_mask(L, block_size, tokens.device)[None, None]  # (1, 1, 2L, 2L)
    hidden = model.hidden_states(torch.cat([noisy, tokens], 1), positions, mask)  # (B', 2L, D)
    sources = shifted_sources(L, block_size, tokens.device).expand(tokens.shape[0], -1)  # (B', L)
    rows, cols = is_masked.nonzero(as_tuple=True)
    if len(rows) == 0:  # nothing masked (e.g. a low ratio without complementary masks): no loss, no NaN
        return hidden.sum() * 0.0
    logits = model.logits(hidden[rows, sources[rows, cols]]).float()  # (M, V): the head only where the loss is
    targets = tokens[rows, cols]
    loss = F.cross_entropy(logits, targets)
    if certainty_weight > 0:
        is_right = logits.argmax(-1) == targets
        if bool(is_right.any()):
            logp = (logits[is_right] / CERTAINTY_TEMPERATURE).log_softmax(-1)
            loss = loss + certainty_weight * -(logp.exp() * logp).sum(-1).mean()
    return loss
