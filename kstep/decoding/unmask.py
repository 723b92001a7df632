"""What a diffusion step unmasks: the confidence rule that ranks the masked positions, and the
unmask policy that decides how many of them to unmask.

Confidence rules: `low_confidence` and `random` are LLaDA's remasking strategies (`generate.py`);
`margin` and `entropy` are Dream's `topk_margin` and `entropy` algorithms (top-1 minus top-2
probability, negative entropy). Higher confidence is unmasked first. A rule may be told the shape
its pass's reference draws over (`drawn_over`): `random` then draws as LLaDA's generate.py and
Fast-dLLM do, `torch.rand((B, width))` over every position of the pass, and reads the columns it
scores, so a seeded run reproduces the reference's numbers after `torch.manual_seed(seed)`.

Policies (one strategy each, built from the `UnmaskPolicy` that params resolution chose): the
fixed linear schedule, Fast-dLLM's confidence threshold, Fast-dLLM's factor rule.
"""
from typing import Protocol

import torch

from kstep.decoding.schedule import num_transfer_tokens
from kstep.decoding.sampling import sampling_probs
from kstep.params import REMASKING_RULES, GenerationParams, UnmaskPolicy
from kstep.runner.pass_output import PassOutput
from kstep.runner.top_tokens import TopRequest

# (width, index): the pass's reference draws over `width` positions per row; the scored positions are
# `index` (t,) among them.
DrawnOver = tuple[int, torch.Tensor]


class ConfidenceRule(Protocol):
    def __call__(self, out: PassOutput, candidates: torch.Tensor, generator: torch.Generator | None,
                 drawn_over: DrawnOver | None = None) -> torch.Tensor: ...


def low_confidence(out: PassOutput, candidates: torch.Tensor, generator: torch.Generator | None,
                   drawn_over: DrawnOver | None = None) -> torch.Tensor:
    """(B, T) each candidate's probability (top tokens: candidates are their ids)."""
    return out.read("prob", lambda logits: logits.float().softmax(-1).gather(-1, candidates.unsqueeze(-1)).squeeze(-1))


def random_confidence(out: PassOutput, candidates: torch.Tensor, generator: torch.Generator | None,
                      drawn_over: DrawnOver | None = None) -> torch.Tensor:
    """Uniform scores (B, T). With `drawn_over`, the references' draw: LLaDA's generate.py and
    Fast-dLLM's get_transfer_index draw torch.rand((B, L)) (float32, on the logits' device) over
    every position of the pass's logits, scored or not; the scored columns are read from it."""
    if drawn_over is None:
        return torch.rand(candidates.shape, generator=generator, device=candidates.device)
    width, index = drawn_over
    draws = torch.rand((candidates.shape[0], width), generator=generator, device=candidates.device)  # (B, width)
    return draws[:, index]  # (B, T)


def margin(out: PassOutput, candidates: torch.Tensor, generator: torch.Generator | None,
           drawn_over: DrawnOver | None = None) -> torch.Tensor:
    """(B, T) top-1 minus top-2 probability."""
    def dense(logits: torch.Tensor) -> torch.Tensor:
        top2 = logits.float().softmax(-1).topk(2, dim=-1).values  # (B, T, 2)
        return top2[..., 0] - top2[..., 1]
    return out.read("margin", dense)


def entropy(out: PassOutput, candidates: torch.Tensor, generator: torch.Generator | None,
            drawn_over: DrawnOver | None = None) -> torch.Tensor:
    """(B, T) negative entropy."""
    def dense(logits: torch.Tensor) -> torch.Tensor:
        logp = logits.float().log_softmax(-1)
        return (logp.exp() * logp).sum(-1)
    return out.read("neg_entropy", dense)


UNMASK_RULES: dict[str, ConfidenceRule] = dict(zip(REMASKING_RULES, (low_confidence, random_confidence, margin,
                                                                       entropy), strict=True))


def sampled_probability(out: PassOutput, tokens: torch.Tensor, params: GenerationParams) -> torch.Tensor:
    """(B, T) each sampled token's probability under the distribution it was drawn from: softmax(logits)
    at temperature 0, else the tempered, top-k / top-p filtered one (the block-diffusion references'
    confidence: SDAR's generate.py, Fast-dLLM v2's and LLaDA2's samplers; with top_k 1 it is 1).
    Top tokens (a greedy pass's): their probability (`tokens` are their ids)."""
    def dense(logits: torch.Tensor) -> torch.Tensor:
        probs = logits.float().softmax(-1) if params.temperature == 0 else sampling_probs(logits, params)
        return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()
    return out.read("prob", dense)


def top_request(params: GenerationParams, exclude_id: int | None, first_allowed: torch.Tensor | None,
                is_scored: bool = True) -> TopRequest | None:
    """What a pass asks instead of logits when the request is greedy and nothing constrains its
    outputs (min_tokens, token healing, logit_bias and a grammar act on logits), so top tokens hold all its rule reads
    (`is_scored`: the remasking rule's score too); else None."""
    if params.temperature != 0 or params.min_tokens or first_allowed is not None or params.structured is not None \
            or params.logit_bias:
        return None
    if not is_scored:
        return TopRequest(exclude_id)
    return TopRequest(exclude_id, params.remasking == "margin", params.remasking == "entropy")


def confidence_rule(name: str) -> ConfidenceRule:
    if name not in UNMASK_RULES:
        raise ValueError(f"remasking {name!r} is not a known unmask rule (choose from {', '.join(UNMASK_RULES)})")
    return UNMASK_RULES[name]


# --- How many to unmask: the unmask policies ------------------------------------------------------
# Each returns a (B, T) bool choice among the masked positions of the block, given their confidence
# (-inf where not masked). All are batched: no per-row loop, no host sync.

def choose_top(confidence: torch.Tensor, num_unmask: torch.Tensor, max_unmask: int) -> torch.Tensor:
    """The `num_unmask[b]` most confident positions of each row (torch.topk order, as the references)."""
    top = confidence.topk(min(max_unmask, confidence.shape[-1]), dim=-1).indices  # (B, k)
    keep = torch.arange(top.shape[-1], device=confidence.device) < num_unmask.unsqueeze(1)  # (B, k)
    return torch.zeros_like(confidence, dtype=torch.bool).scatter_(-1, top, keep)


def choose_threshold(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Fast-dLLM's threshold rule: every masked position with confidence >= threshold, and always the
    single most confident one (so each pass unmasks at least one token)."""
    best = torch.zeros_like(confidence, dtype=torch.bool).scatter_(-1, confidence.argmax(-1, keepdim=True), True)
    return (confidence >= threshold) | best


def choose_factor(confidence: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM's factor rule (`get_transfer_index_dynamic`): sort the masked confidences; the n-th
    (1-based) passes if it is >= 1 - factor / (n + 1), the first always passes; unmask the run before
    the first failure. Quirk kept for parity: a failure at the last masked position unmasks all."""
    num_masked = torch.isfinite(confidence).sum(-1, keepdim=True)  # (B, 1)
    ordered = confidence.sort(dim=-1, descending=True).values  # (B, T)
    n = torch.arange(1, confidence.shape[-1] + 1, device=confidence.device)
    bar = (1 - factor / (n + 1)).to(ordered.dtype)
    bar[0] = float("-inf")
    fails = (ordered < bar) & (n <= num_masked)  # (B, T)
    first_fail = torch.where(fails.any(-1, keepdim=True), fails.float().argmax(-1, keepdim=True), num_masked)
    count = torch.where(first_fail >= num_masked - 1, num_masked, first_fail).squeeze(-1)  # (B,)
    return choose_top(confidence, count, confidence.shape[-1])


# --- The policies as strategies: choose(confidence, step_idx) -> (B, T) bool ----------------------

def choose_counts(confidence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """choose_top with each row's own count (B,): rows of one count together, each with torch.topk of
    exactly that many, so a row is ranked as it is alone (ties break the same way)."""
    chosen = torch.zeros_like(confidence, dtype=torch.bool)
    for k in counts.unique().tolist():
        rows = counts == k
        chosen[rows] = choose_top(confidence[rows], counts[rows], k)
    return chosen


class FixedSchedule:
    """LLaDA's linear schedule: the block's masks split evenly over its `value` steps (schedule.py)."""

    def __init__(self, steps_per_block: int, block_length: int):
        self.counts = num_transfer_tokens(torch.tensor([block_length]), steps_per_block)[0].tolist()

    def choose(self, confidence: torch.Tensor, step_idx: int | torch.Tensor) -> torch.Tensor:
        """`step_idx`: the batch's step, or each row's (B,) (self-speculation: rows advance apart)."""
        if isinstance(step_idx, torch.Tensor):
            counts = torch.tensor(self.counts, device=confidence.device)[step_idx.clamp(max=len(self.counts) - 1)]
            return choose_counts(confidence, counts)
        k = self.counts[min(step_idx, len(self.counts) - 1)]
        return choose_top(confidence, torch.full((confidence.shape[0],), k, device=confidence.device), k)


class ThresholdPolicy:
    def __init__(self, threshold: float, block_length: int):
        self.threshold = threshold

    def choose(self, confidence: torch.Tensor, step_idx: int) -> torch.Tensor:
        return choose_threshold(confidence, self.threshold)


class FactorPolicy:
    def __init__(self, factor: float, block_length: int):
        self.factor = factor

    def choose(self, confidence: torch.Tensor, step_idx: int) -> torch.Tensor:
        return choose_factor(confidence, self.factor)


POLICIES = {"fixed": FixedSchedule, "threshold": ThresholdPolicy, "factor": FactorPolicy}


def make_policy(spec: UnmaskPolicy, block_length: int) -> FixedSchedule | ThresholdPolicy | FactorPolicy:
    """The strategy for a resolved params' unmask policy."""
    value = int(spec.value) if spec.kind == "fixed" else spec.value
    return POLICIES[spec.kind](value, block_length)
