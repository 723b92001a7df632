"""Training objectives.

diffusion: LLaDA's masked-diffusion loss (arXiv:2502.09992, Eq. 3; ML-GSAI/LLaDA GUIDELINES.md):
  t ~ U(eps, 1] per sequence, each token masked with probability t, cross-entropy on the masked
  tokens weighted by 1/t, summed and divided by the number of tokens. With `prompt_lengths`, the
  prompt is never masked and the loss is normalised by each answer's length (LLaDA's SFT).
ar: next-token cross-entropy.
"""
import torch
import torch.nn.functional as F

from kstep.models import Transformer

EPS = 1e-3


def positions_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)


def forward_process(tokens: torch.Tensor, mask_id: int, generator: torch.Generator | None = None,
                    prompt_lengths: torch.Tensor | None = None,
                    stratified: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise (B, L) tokens: t ~ U(eps, 1] per row, each non-prompt token masked with probability t.
    Returns (noisy tokens, is_masked, p_mask (B, 1)).

    With `stratified`, the rows' t are MDLM's low-discrepancy sample (arXiv:2406.07524): one uniform
    offset plus i/B, mod 1; each t is still U(0, 1), so the loss stays unbiased."""
    B, L = tokens.shape
    if stratified:
        offset = torch.rand((), generator=generator, device=tokens.device)
        t = ((offset + torch.arange(B, device=tokens.device) / B) % 1.0)[:, None]
    else:
        t = torch.rand(B, 1, generator=generator, device=tokens.device)
    p_mask = (1 - EPS) * t + EPS  # (B, 1)
    is_masked = torch.rand(B, L, generator=generator, device=tokens.device) < p_mask  # (B, L)
    if prompt_lengths is not None:
        is_masked &= torch.arange(L, device=tokens.device) >= prompt_lengths[:, None]
    return torch.where(is_masked, mask_id, tokens), is_masked, p_mask


def diffusion_loss(model: Transformer, tokens: torch.Tensor, mask_id: int, generator: torch.Generator | None = None,
                   prompt_lengths: torch.Tensor | None = None, stratified: bool = False) -> torch.Tensor:
    B, L = tokens.shape
    noisy, is_masked, p_mask = forward_process(tokens, mask_id, generator, prompt_lengths, stratified)
    hidden = model.hidden_states(noisy, positions_for(tokens), None)  # (B, L, D)
    logits = model.logits(hidden[is_masked])  # (M, V): the head only where the loss is
    weight = 1.0 / p_mask.expand(B, L)[is_masked]  # (M,)
    token_loss = F.cross_entropy(logits.float(), tokens[is_masked], reduction="none") * weight
    if prompt_lengths is None:
        return token_loss.sum() / (B * L)
    answer_lengths = (L - prompt_lengths).clamp(min=1)[:, None].expand(B, L)[is_masked]
    return (token_loss / answer_lengths).sum() / B


def ar_loss(model: Transformer, tokens: torch.Tensor, generator: torch.Generator | None = None,
            prompt_lengths: torch.Tensor | None = None) -> torch.Tensor:
    logits = model(tokens[:, :-1], positions_for(tokens[:, :-1]))  # (B, L-1, V)
    targets = tokens[:, 1:]
    if prompt_lengths is not None:  # loss on the completion only
        is_prompt = torch.arange(1, tokens.shape[1], device=tokens.device) < prompt_lengths[:, None]
        targets = targets.masked_fill(is_prompt, -100)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


@torch.no_grad()
def diffusion_nll_bound(model: Transformer, tokens: torch.Tensor, mask_id: int, num_samples: int,
                        generator: torch.Generator) -> torch.Tensor:
    """Per-sequence upper bound on -log p(x) in nats (the ELBO), Monte-Carlo over the mask ratio, as
    LLaDA's `get_log_likelihood`: stratified masked counts k, loss = sum CE(masked) / (k / L)."""
    B, L = tokens.shape
    total = torch.zeros(B, device=tokens.device)
    offset = int(torch.randint(1, L + 1, (), generator=generator, device=generator.device))
    for s in range(num_samples):
        k = (offset + round(s * L / num_samples) - 1) % L + 1  # stratified over 1..L
        scores = torch.rand(B, L, generator=generator, device=tokens.device)
        is_masked = scores.argsort(-1).argsort(-1) < k  # exactly k masked per row
        noisy = torch.where(is_masked, mask_id, tokens)
        logits = model(noisy, positions_for(tokens)).float()
        ce = F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")  # (B, L)
        total += (ce * is_masked).sum(-1) / (k / L)
    return total / num_samples


@torch.no_grad()
def ar_nll(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Per-sequence -log p(x[1:] | x[0]) in nats."""
    logits = model(tokens[:, :-1], positions_for(tokens[:, :-1])).float()
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").sum(-1)
