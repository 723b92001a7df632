"""What a greedy decoding rule reads of a pass's logits, per position, computed from vocabulary
shards without ever gathering the (positions x vocabulary) logits.

Greedy AR, LLaDA's low-confidence remasking, Fast-dLLM's threshold and factor rules, the block
samplers' confidence, LLaDA2.1's token editing and Dream's maskgit/margin/entropy scores at
temperature 0 need, per position, only: the argmax (the mask token excluded: a masked position must
become a token), its probability, the top-2 probability margin and the entropy. Each tensor-parallel
rank computes shard-local statistics over its vocabulary columns (max, sum of exp, the masked argmax
and its logit, the second largest logit, sum of exp * logit: 6 float64 per position), one gather
brings them to rank 0, and `merge` combines them exactly as the dense formulas would (SGLang PR
#29970's `[max, logsumexp, argmax]` layout, extended with the margin and entropy terms):

    lse = M + log sum_r s_r exp(m_r - M),  p(argmax) = exp(x_argmax - lse),
    margin = exp(M - lse) - exp(second - lse),  sum p log p = sum_r t_r exp(m_r - M) / S - lse.

Ties go to the smallest token id, as torch.argmax (ranks hold ascending vocabulary ranges).

The merged statistics are (..., 4) float64 per position, [id, probability, margin, -entropy]: a
`PassOutput`'s top tokens (runner/pass_output.py), which the decoders read as they read logits. A
runner computes them only for passes that ask (`ForwardPass.top`), and only where it computes top
tokens (tensor parallel); a single-device runner returns the logits, so its outputs stay bit-equal
to the references'.
"""
from dataclasses import dataclass

import torch

from kstep.runner.pass_output import PassOutput

NUM_STATS = 6  # per position and rank: max, sum exp(x - max), masked max, its id, second max, sum exp(x - max) * x


@dataclass(frozen=True, slots=True)
class TopRequest:
    """A pass's ask: top tokens instead of logits. `exclude_id`: never the argmax (the mask token);
    `needs_margin` / `needs_entropy`: compute those columns (others hold no meaning)."""
    exclude_id: int | None = None
    needs_margin: bool = False
    needs_entropy: bool = False


def local_stats(logits: torch.Tensor, vocab_start: int, request: TopRequest) -> torch.Tensor:
    """(R, Vl) logits of vocabulary ids [vocab_start, vocab_start + Vl) -> (R, NUM_STATS) float64.
    Vl may be 0 (a rank whose rows are all padding): its max is -inf and its sums 0."""
    x = logits.float()
    R, Vl = x.shape
    if Vl == 0:
        empty = torch.zeros(R, NUM_STATS, dtype=torch.float64, device=x.device)
        empty[:, [0, 2, 4]] = float("-inf")
        return empty
    m = x.amax(-1, keepdim=True)  # (R, 1)
    e = (x - m).exp()  # (R, Vl)
    proposal = x
    local_exclude = None if request.exclude_id is None else request.exclude_id - vocab_start
    if local_exclude is not None and 0 <= local_exclude < Vl:
        proposal = x.clone()
        proposal[:, local_exclude] = float("-inf")
    best = proposal.argmax(-1, keepdim=True)  # (R, 1): the first maximum
    second = x.topk(2, dim=-1).values[:, 1:] if request.needs_margin and Vl > 1 else torch.full_like(m, float("-inf"))
    weighted = (e * x).sum(-1, keepdim=True) if request.needs_entropy else torch.zeros_like(m)
    return torch.cat([m, e.sum(-1, keepdim=True), proposal.gather(-1, best), best + vocab_start, second, weighted],
                     -1).double()


def merge(stats: torch.Tensor) -> torch.Tensor:
    """(R, N, NUM_STATS) the N shards' local statistics, in vocabulary order -> top tokens (R, 4)."""
    m, s, best_logit, best_id, second, weighted = stats.unbind(-1)  # each (R, N)
    M = m.amax(-1, keepdim=True)  # (R, 1)
    w = (m - M).exp()  # (R, N): 0 for a shard without columns
    S = (s * w).sum(-1)  # (R,)
    lse = M.squeeze(-1) + S.log()
    shard = best_logit.argmax(-1, keepdim=True)  # ties: the lowest shard, i.e. the smallest id
    ids = best_id.gather(-1, shard).squeeze(-1)
    prob = (best_logit.gather(-1, shard).squeeze(-1) - lse).exp()
    runner_up = torch.cat([m, second], -1).topk(2, dim=-1).values[:, 1]  # the second largest logit overall
    margin = (M.squeeze(-1) - lse).exp() - (runner_up - lse).exp()
    neg_entropy = (weighted * w).sum(-1) / S - lse
    return torch.stack([ids, prob, margin, neg_entropy], -1)


def top_tokens(logits: torch.Tensor, request: TopRequest) -> PassOutput:
    """Dense logits (..., V) -> their top tokens (..., 4), as one shard (tests; a runner made to compute them)."""
    lead = logits.shape[:-1]
    merged = merge(local_stats(logits.reshape(-1, logits.shape[-1]), 0, request)[:, None])
    return PassOutput.of_top_tokens(merged.view(*lead, 4), request.exclude_id)
