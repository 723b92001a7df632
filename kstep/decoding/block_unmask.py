"""One unmask step of a block-diffusion block (decoding/block_diffusion.py): which masks a pass
fills (token editing's replacements of filled tokens are token_editing.py's).

Among the masks of the block (Fast-dLLM v2: of its first sub-block that still has one), every one
whose confidence is above the threshold (strict, as the references), when at least the count are;
else the count most confident (SDAR's `low_confidence_dynamic`, LLaDA2's rule; without a threshold,
exactly the count: SDAR's static schedule). Confidence is the sampled token's probability under the
tempered, top-k/top-p filtered distribution it was drawn from, as all three references score it
(SDAR's generate.py, Fast-dLLM v2's and LLaDA2's samplers), or another remasking rule's score.
"""
import torch

from kstep.decoding.sampling import pick_tokens
from kstep.decoding.unmask import ConfidenceRule, choose_top, sampled_probability
from kstep.params import GenerationParams
from kstep.runner.pass_output import PassOutput


def open_columns(block: torch.Tensor, mask_id: int, sub_block: int) -> torch.Tensor:
    """(B, bs) the columns a pass may unmask: the first sub-block that still has a mask."""
    if sub_block >= block.shape[1]:
        return torch.ones_like(block, dtype=torch.bool)
    has_mask = (block == mask_id).view(block.shape[0], -1, sub_block).any(-1)  # (B, num_sub)
    first = torch.where(has_mask.any(-1), has_mask.float().argmax(-1), 0)  # (B,)
    return (torch.arange(block.shape[1], device=block.device) // sub_block) == first[:, None]


def block_scores(out: PassOutput, params: GenerationParams, mask_id: int, rule: ConfidenceRule,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pass's outputs (B, bs) predicting a block -> each position's token, its probability and its
    confidence (B, bs) (the probability, or another remasking rule's score)."""
    proposal = out.excluding(mask_id)  # a masked position must become a token
    tokens = pick_tokens(proposal, params.temperature, generator, params.top_k, params.top_p)  # (B, bs)
    probs = sampled_probability(out, tokens, params)  # (B, bs)
    confidence = probs if params.remasking == "low_confidence" else rule(out, tokens, generator).float()
    return tokens, probs, confidence


def scheduled(schedule: torch.Tensor | None, passes: torch.Tensor) -> torch.Tensor:
    """(R,) the least a pass unmasks at each row's `passes` (R,) in its block: the schedule's count, else 1."""
    return torch.ones_like(passes) if schedule is None else schedule[passes.clamp(max=len(schedule) - 1)]


def choose_in_block(block: torch.Tensor, confidence: torch.Tensor, rows: torch.Tensor, count: torch.Tensor,
                    params: GenerationParams, mask_id: int) -> torch.Tensor:
    """(B, bs) the masks a pass fills: among the open sub-block's, for `rows` (B,), every one above
    the threshold when at least `count` (B,) are, else the `count` most confident."""
    is_masked = (block == mask_id) & open_columns(block, mask_id, params.sub_block_length) & rows[:, None]
    confidence = confidence.masked_fill(~is_masked, float("-inf"))
    count = torch.minimum(count, is_masked.sum(-1))
    chosen = choose_top(confidence, count, block.shape[1])
    if params.policy.kind == "threshold":
        above = confidence > params.policy.value
        chosen = torch.where((above.sum(-1) >= count)[:, None], above, chosen)
    return chosen & is_masked
