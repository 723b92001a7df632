"""What a grammar walk over a whole canvas chooses from (uniform_diffusion.py's `_keep_grammar`):
each position's candidates, drawn on the device once per pass and moved to the host at once, so the
walk (sequential: what a position allows depends on the tokens before it) reads the grammar's packed
mask bit by bit on the host and needs no transfer per position, but for the rare one below.

- The argmax canvas: each position's top k tokens of the processed logits, best first; the first
  the grammar allows is the argmax among the allowed tokens.
- A kept sample: each position's top k tokens under Gumbel-perturbed logits (log p + G, G i.i.d.
  Gumbel(0, 1) per token; the Gumbel-top-k trick: Kool, van Hoof, Welling, ICML 2019), an ordered
  sample without replacement. The argmax of log p + G over any token set S is distributed as p
  renormalised to S (Gumbel-max over S), and the first candidate in the perturbed order that lies in
  S is that argmax. The allowed set S at a position depends only on the tokens walked before it,
  drawn with other positions' noise, so it is independent of this position's: the first allowed
  candidate is a sample from p restricted to the allowed tokens, exactly. When none of the k is
  allowed, that argmax is still distributed so (a Gumbel-max's argmax is independent of its value,
  so of the event that S lost to k other tokens): a fresh draw from p restricted to S, on the device,
  has the same law (the rare case: one transfer).
- Where no allowed token has any mass (the filters took it: a -inf candidate comes before an allowed
  one), a kept sample is drawn uniformly among the allowed tokens, as a renoised position's token is:
  the r-th allowed id of the packed mask, r from a random integer drawn with the rest; the argmax
  canvas then has no choice (the walk takes the known completion's token).
"""
import numpy as np
import torch

from kstep.decoding.row_tiles import tiled
from kstep.structured.token_mask import count, has, nth, unpack

TOP_K = 16


def ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(..., V) -> (..., k): the k best ids, best first; -1 where the score is -inf (no mass)."""
    values, ids = scores.topk(k, dim=-1)
    return torch.where(values > float("-inf"), ids, -1)


def gumbel_ranked(logits: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """(..., V) -> (..., k): `ranked` of logits + Gumbel noise (float64, as sampling.py's Gumbel-max),
    in row tiles (row_tiles.py: the noise drawn in row order, as one draw over every row would)."""
    def rows(part: torch.Tensor) -> torch.Tensor:
        part = part.double()
        noise = torch.rand(part.shape, generator=generator, dtype=torch.float64, device=part.device)
        return ranked(part - torch.log(-torch.log(noise)), k)
    return tiled(rows, logits)


class WalkCandidates:
    """One pass's candidates for the argmax canvas (`best`) and the next input canvas (`drawn`), each a
    walk's `choose` (constraint.py): (row, column, packed mask) -> a token, or None (module note)."""

    def __init__(self, processed: torch.Tensor, probs: torch.Tensor, accepted: torch.Tensor,
                 generator: torch.Generator | None):
        self.processed, self.probs, self.generator = processed, probs, generator  # (B, L, V) each
        self.k = k = min(TOP_K, processed.shape[-1])
        ranks = torch.randint(0, 1 << 62, (*accepted.shape, 1), generator=generator, device=processed.device)
        self.host = torch.cat([ranked(processed, k), gumbel_ranked(processed, k, generator), accepted[..., None].long(),
                               ranks], -1).tolist()  # (B, L, 2k + 2): the one transfer

    def best(self, b: int, c: int, words: np.ndarray) -> int | None:
        """The argmax among the allowed tokens of row b's column c (None: none has mass)."""
        for token in self.host[b][c][:self.k]:
            if token < 0:  # no allowed token has mass
                return None
            if has(words, token):
                return token
        masked = self.processed[b, c].masked_fill(~self._allowed(words), float("-inf"))
        value, token = masked.max(-1)
        token, finite = torch.stack([token, value.isfinite().long()]).tolist()
        return token if finite else None

    def drawn(self, b: int, c: int, words: np.ndarray) -> int:
        """Row b's column c: a kept sample among the allowed tokens, or a renoised one (module note)."""
        entry = self.host[b][c]
        if entry[2 * self.k]:  # a kept sample
            for token in entry[self.k:2 * self.k]:
                if token < 0:
                    break
                if has(words, token):
                    return token
            else:
                allowed = self._allowed(words)
                weights = self.probs[b, c] * allowed
                weights = torch.where(weights.sum() > 0, weights, allowed.float())
                return int(torch.multinomial(weights, 1, generator=self.generator))
        return nth(words, entry[-1] % count(words))  # renoised, or no allowed token has mass: uniform

    def _allowed(self, words: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(unpack(words, self.processed.shape[-1])).to(self.processed.device)
