"""What a forward pass gives its decoder, per position: `PassOutput`, one type whichever way the
runner computed it, so a decoder and its sampling rules have one path.

- Dense: the logits (..., V), which every rule can read (a single device always returns these, so
  its outputs stay bit-equal to the references').
- Top tokens: a tensor-parallel runner's answer to a greedy pass that asked for them
  (`ForwardPass.top`, runner/top_tokens.py), (..., 4) float64 per position: [the argmax id (the
  excluded token never), its probability, top-1 minus top-2 probability, negative entropy],
  computed from vocabulary-shard statistics without gathering the logits.

A rule reads a view with `read(column, dense)`: the named column of top tokens, or `dense(logits)`
from the logits, so each rule states its formula once and never asks which kind it holds. Decoders
move positions with the same methods either way (indexing, `gather`, `spread`, `scatter`: both kinds
keep positions in the leading dimensions). A rule that needs the whole distribution (sampling at a
temperature, a filter, classifier-free guidance) reads `logits`; a pass that needs one never asks
for top tokens (decoding/unmask.py's `top_request`), so reading `logits` of top tokens is a bug,
and says so.
"""
from collections.abc import Callable

import torch

TOP_COLUMNS = {"ids": 0, "prob": 1, "margin": 2, "neg_entropy": 3}


class PassOutput:
    __slots__ = ("values", "is_top", "excluded")

    def __init__(self, values: torch.Tensor, is_top: bool = False, excluded: int | None = None):
        self.values = values      # (..., V) logits, or (..., 4) top tokens
        self.is_top = is_top
        self.excluded = excluded  # top tokens: the id their argmax never takes

    @classmethod
    def of_logits(cls, logits: torch.Tensor) -> "PassOutput":
        return cls(logits)

    @classmethod
    def of_top_tokens(cls, top: torch.Tensor, excluded: int | None) -> "PassOutput":
        return cls(top, True, excluded)

    # --- views ----------------------------------------------------------------------------------

    @property
    def logits(self) -> torch.Tensor:
        """(..., V) the logits; top tokens have none (a pass whose rule needs them asks for logits)."""
        if self.is_top:
            raise RuntimeError("internal: a rule read the logits of a top-token pass (its pass should not have "
                               "asked for top tokens)")
        return self.values

    def read(self, column: str | tuple[str, ...], dense: Callable) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """A per-position view (...): top tokens' `column` (TOP_COLUMNS), or `dense(logits)`; with a
        tuple of columns, a tuple of views (`dense` computing them together, e.g. a sample and its score)."""
        if not self.is_top:
            return dense(self.values)
        if isinstance(column, tuple):
            return tuple(self._column(c) for c in column)
        return self._column(column)

    def _column(self, column: str) -> torch.Tensor:
        out = self.values[..., TOP_COLUMNS[column]]
        return out.long() if column == "ids" else out.float()

    def argmax(self) -> torch.Tensor:
        """(...) the most likely token of each position (top tokens: never the excluded one)."""
        return self.read("ids", lambda logits: logits.argmax(-1))

    def excluding(self, token_id: int) -> "PassOutput":
        """These outputs with `token_id` never picked (logits at -inf there); top tokens exclude it already."""
        if self.is_top:
            if self.excluded != token_id:
                raise RuntimeError(f"internal: top tokens that exclude {self.excluded} asked to exclude {token_id}")
            return self
        logits = self.values.clone()
        logits[..., token_id] = float("-inf")
        return PassOutput(logits)

    def with_logits(self, logits: torch.Tensor) -> "PassOutput":
        """Dense outputs with these logits instead (a constraint applied to them)."""
        self.logits  # noqa: B018 (top tokens have none to change)
        return PassOutput(logits)

    # --- positions ------------------------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        """The positions' shape (the leading dimensions)."""
        return self.values.shape[:-1]

    @property
    def device(self) -> torch.device:
        return self.values.device

    def _like(self, values: torch.Tensor) -> "PassOutput":
        return PassOutput(values, self.is_top, self.excluded)

    def __getitem__(self, index) -> "PassOutput":
        """Positions selected by `index` over the leading dimensions."""
        return self._like(self.values[index])

    def view(self, *shape: int) -> "PassOutput":
        return self._like(self.values.view(*shape, self.values.shape[-1]))

    def gather(self, index: torch.Tensor) -> "PassOutput":
        """(B, T) -> the outputs at positions index[b, t] of each row (B, T, ...)."""
        return self._like(self.values.gather(1, index[:, :, None].expand(-1, -1, self.values.shape[-1])))

    def spread(self, width: int, columns: torch.Tensor) -> "PassOutput":
        """Outputs of columns `columns` (t,) of a pass of `width` positions, back at those columns of
        (B, width, ...); the columns not computed hold zeros (never read)."""
        full = self.values.new_zeros(self.values.shape[0], width, self.values.shape[-1])
        return self._like(full.index_copy_(1, columns, self.values))

    def scatter(self, width: int, columns: torch.Tensor) -> "PassOutput":
        """Outputs (B, T, ...) placed at each row's own columns `columns` (B, T) of (B, width, ...); zeros elsewhere."""
        full = self.values.new_zeros(self.values.shape[0], width, self.values.shape[-1])
        return self._like(full.scatter_(1, columns[:, :, None].expand(-1, -1, self.values.shape[-1]), self.values))
