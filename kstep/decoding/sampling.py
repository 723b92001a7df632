"""Token sampling shared by every decoder: top-k / top-p filtering, then argmax or Gumbel-max; and the
rules on what completion positions may hold (`OutputRules`: min_tokens, token healing, logit_bias, a
grammar). The functions on a pass's outputs (`pick_tokens`, `constrain`) take a `PassOutput`
(runner/pass_output.py); the others plain logits.

Gumbel-max follows LLaDA's `add_gumbel_noise`: argmax of exp(logits) / (-log u)^T in float64,
because low-precision Gumbel noise hurts MDM generation quality (arXiv:2409.02908). It samples
from softmax(logits / T). Logits are shifted by their row max first (same argmax, no overflow).
"""
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kstep.decoding.row_tiles import tiled
from kstep.runner.pass_output import PassOutput

if TYPE_CHECKING:
    from kstep.params import GenerationParams
    from kstep.structured.constraint import Constraint


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
    softmax(logits / T), as transformers and vLLM do. In row tiles (row_tiles.py): the same ids and
    draws as whole, a few tiles of memory whatever the positions and vocabulary."""
    return tiled(lambda rows: _sample_rows(rows, temperature, generator, top_k, top_p), logits)


def _sample_rows(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
                 top_k: int | None, top_p: float | None) -> torch.Tensor:
    if top_k is not None or top_p is not None:
        kept = filter_logits(logits / temperature if temperature > 0 else logits, top_k, top_p)
        logits = logits.masked_fill(torch.isinf(kept), float("-inf"))
    if temperature == 0:
        return logits.argmax(-1)
    shifted = logits.double() - logits.double().amax(-1, keepdim=True)
    noise = torch.rand(shifted.shape, generator=generator, dtype=torch.float64, device=logits.device)
    return (shifted.exp() / (-torch.log(noise)) ** temperature).argmax(-1)


def pick_tokens(out: PassOutput, temperature: float, generator: torch.Generator | None = None,
                top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """(...) a token for each position of a pass's outputs, as `sample_tokens` draws it (top tokens,
    a greedy pass's: their ids)."""
    return out.read("ids", lambda logits: sample_tokens(logits, temperature, generator, top_k, top_p))


def sampling_probs(logits: torch.Tensor, params: "GenerationParams") -> torch.Tensor:
    """(..., V) -> the float64 distribution `sample_tokens` draws from at params.temperature > 0."""
    logits = logits.double()
    if params.top_k is not None or params.top_p is not None:
        kept = filter_logits(logits / params.temperature, params.top_k, params.top_p)
        logits = logits.masked_fill(torch.isinf(kept), float("-inf"))
    return F.softmax(logits / params.temperature, dim=-1)


def suppress_stop_tokens(logits: torch.Tensor, stop_ids: torch.Tensor, output_index: torch.Tensor | int,
                         min_tokens: int) -> torch.Tensor:
    """vLLM's min_tokens: logits (B, T, V) whose positions are completion tokens number
    `output_index` (broadcastable to (B, T)), with the stop ids at -inf where that is below min_tokens."""
    B, T, _ = logits.shape
    if isinstance(output_index, int):  # one position for the whole batch (AR decode): no host sync
        if output_index >= min_tokens:
            return logits
        return logits.index_fill(-1, stop_ids, float("-inf"))
    early = (torch.as_tensor(output_index, device=logits.device) < min_tokens).expand(B, T)  # (B, T)
    if not bool(early.any()):
        return logits
    logits = logits.clone()
    stop = logits[..., stop_ids]
    logits[..., stop_ids] = torch.where(early[..., None], float("-inf"), stop)
    return logits


@dataclass(slots=True, frozen=True)
class OutputRules:
    """The rules on what completion positions may hold, which every decoder applies to the logits it
    samples from (`constrain`): vLLM's min_tokens (no stop token before it), token healing's first
    token (`first_allowed` (B, V) bool: the tokens that start with the text the prompt gave back),
    OpenAI's logit_bias (added to the logits), and a structured output's grammar at each row's commit
    frontier (kstep/structured/constraint.py)."""
    stop_ids: torch.Tensor
    min_tokens: int = 0
    first_allowed: torch.Tensor | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None
    grammar: "Constraint | None" = None

    @classmethod
    def of(cls, batch, params: "GenerationParams") -> "OutputRules":
        """A decoder batch's rules under its params."""
        return cls(batch.stop_ids, params.min_tokens, batch.first_allowed, params.logit_bias, batch.constraint)

    @property
    def is_empty(self) -> bool:
        return not self.min_tokens and self.first_allowed is None and not self.logit_bias and self.grammar is None

    def of_rows(self, rows: torch.Tensor | None) -> "OutputRules":
        """The rules of logits whose rows are batch rows `rows` (None: all of them, in order); a
        grammar keeps its rows' frontiers, so only whole batches take one."""
        if rows is None or self.first_allowed is None:
            return self
        return replace(self, first_allowed=self.first_allowed[rows])


def constrain_outputs(logits: torch.Tensor, output_index: torch.Tensor | int, rules: OutputRules) -> torch.Tensor:
    """`rules` on logits (B, T, V) of completion tokens number `output_index` (an int, or
    broadcastable to (B, T))."""
    if rules.grammar is not None:
        logits = rules.grammar.mask(logits, output_index)
    if rules.logit_bias:
        ids, bias = zip(*rules.logit_bias)
        logits = logits.clone()
        logits[..., list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    if rules.min_tokens:
        logits = suppress_stop_tokens(logits, rules.stop_ids, output_index, rules.min_tokens)
    first_allowed = rules.first_allowed
    if first_allowed is None:
        return logits
    if isinstance(output_index, int):
        return logits if output_index else logits.masked_fill(~first_allowed[:, None, :], float("-inf"))
    is_first = (torch.as_tensor(output_index, device=logits.device) == 0).expand(logits.shape[:2])  # (B, T)
    if not bool(is_first.any()):
        return logits
    return logits.masked_fill(is_first[..., None] & ~first_allowed[:, None, :], float("-inf"))


def constrain(out: PassOutput, output_index: torch.Tensor | int, rules: OutputRules) -> PassOutput:
    """`constrain_outputs` on a pass's outputs (B, T): unchanged when no rule applies (a top-token
    pass is only asked for when none does)."""
    if rules.is_empty:
        return out
    return out.with_logits(constrain_outputs(out.logits, output_index, rules))
