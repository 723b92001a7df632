"""A decoder batch under a grammar: how every decoder, autoregressive or diffusion, keeps each row's
committed tokens a valid, completable prefix of the language (docs/decoding.md, "Structured outputs").

The commit frontier. A row's completion is decided left to right, whatever order its sampler would
choose: the matcher (matcher.py) has taken exactly the row's leading decided run, its frontier is
the first undecided position, and a step may decide only a contiguous run from there. Two hooks,
called by every decoder at the places it already constrains and chooses:

- `mask`: on the logits a sampler proposes from, the frontier's column of each row takes only the
  tokens the grammar allows there (its state is known: everything before it is decided). Called from
  decoding/sampling.py's `constrain`, beside min_tokens and token healing. One packed bitmask per
  decoder batch and pass (token_mask.py): the rows' masks filled at once by llguidance's parallel
  filler, moved to the logits' device once, applied to the B frontier columns only.
- `step`: after the sampler proposed a candidate for each column and its policy chose some, the run
  from the frontier is walked in order. A position takes the grammar's forced token (one that no
  other text could replace: keys, braces, quotes; placed without the model choosing), else the
  model's candidate when the policy chose it (or the schedule still owes tokens), if the grammar
  admits it and a completion after it still fits the room left; the walk ends at the first position
  that does not. The frontier's own position is always decided (a refused candidate there becomes
  the known completion's next token), so every pass moves each row on. What the policy chose past
  the walk stays masked: the next pass predicts it again, against the decided text.

So every token that leaves the canvas was checked in order against the matcher, and the room never
holds less than a known completion (its end-of-sequence token included): a constrained row ends
with "stop" and valid output whenever the search found a completion that fits at the start, and
the request is refused at admission otherwise (llm.py)."""
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from kstep.structured.canvas_walk import WalkTree
from kstep.structured.grammar import Grammar
from kstep.structured.matcher import RowMatcher, fill_masks
from kstep.structured.token_mask import apply


def _as_wide(allowed: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """An allowed-token mask (..., table width) as wide as the logits, on their device: ids past the
    tokenizer's table (a padded head) are never allowed."""
    allowed, width = allowed.to(logits.device), logits.shape[-1]
    if allowed.shape[-1] < width:
        allowed = torch.cat([allowed, allowed.new_zeros(*allowed.shape[:-1], width - allowed.shape[-1])], -1)
    return allowed[..., :width]


class Constraint:
    def __init__(self, grammar: Grammar, num_rows: int, max_tokens: int, stop_ids: list[int], vocab_size: int,
                 mask_id: int | None):
        # `mask_id`: what an undecided position holds in `step`'s blocks (an AR model has none: -1)
        self.grammar, self.max_tokens, self.mask_id = grammar, max_tokens, -1 if mask_id is None else mask_id
        self.rows = [RowMatcher(grammar, stop_ids, vocab_size) for _ in range(num_rows)]
        self._trees: list[WalkTree | None] = [None] * num_rows  # each row's walks of its current canvas
        self.num_forced = 0      # tokens the grammar forced, placed without the model choosing them
        self.num_fallbacks = 0   # frontier candidates refused and replaced by the known completion's token

    def frontier(self) -> list[int]:
        """Each row's first undecided completion index."""
        return [row.num_committed for row in self.rows]

    def mask(self, logits: torch.Tensor, output_index: torch.Tensor | int) -> torch.Tensor:
        """Logits (B, T, V) of completion positions `output_index` (an int, or broadcastable to (B, T),
        distinct along a row), with each row's frontier column limited to the tokens its grammar allows
        (module note): the batch's packed masks (B, W), filled at once on the host and moved once, are
        applied to the B frontier columns only, gathered and put back."""
        B, T, _ = logits.shape
        device, frontier = logits.device, self.frontier()
        packed = torch.from_numpy(fill_masks(self.rows)).to(device)  # (B, W) int32
        if isinstance(output_index, int):  # one index for every column: the rows it is the frontier of
            hit = [f == output_index for f in frontier]
            rows = None if all(hit) else torch.tensor(hit, device=device)
            if T == 1:
                return apply(logits[:, 0], packed, rows)[:, None]
            return torch.stack([apply(logits[:, t], packed, rows) for t in range(T)], 1)
        at_frontier = (torch.as_tensor(output_index, device=device) ==
                       torch.tensor(frontier, device=device)[:, None]).expand(B, T)  # (B, T)
        if T == 1:
            return apply(logits[:, 0], packed, at_frontier[:, 0])[:, None]
        column = at_frontier.to(torch.uint8).argmax(-1)  # (B,) the frontier's column (0: none, unmasked)
        every_row = torch.arange(B, device=device)
        return logits.index_put((every_row, column), apply(logits[every_row, column], packed, at_frontier.any(-1)))

    def step(self, block: torch.Tensor, candidates: torch.Tensor, chosen: torch.Tensor, index: torch.Tensor,
             count: torch.Tensor | None = None, rows: torch.Tensor | None = None,
             is_free: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The walk from each row's frontier (module note) over columns whose completion indices are
        `index` (B, T), ascending: `block` holds their tokens (the mask id where undecided), the
        sampler's `candidates` and its policy's `chosen` (B, T); `count` (B,): tokens the schedule
        owes this pass (a fixed schedule's); `rows` (B,): the rows this pass decides for; `is_free`:
        whether forced tokens count as placed without a pass (not an AR pass's own token). Returns the
        tokens and the positions decided (B, T): the decoder writes those, nothing else."""
        B, T = block.shape
        tokens, decided = candidates.tolist(), [[False] * T for _ in range(B)]
        blk, want, idx = block.tolist(), chosen.tolist(), index.tolist()
        owed = count.tolist() if count is not None else [0] * B
        live = rows.tolist() if rows is not None else [True] * B
        for b, row in enumerate(self.rows):
            if live[b] and row.is_free:  # released (matcher.py): what the policy chose, as without a grammar
                decided[b] = want[b]
                continue
            if not live[b] or row.num_committed not in idx[b]:
                continue
            c, taken, model_taken = idx[b].index(row.num_committed), 0, 0
            while c < T and blk[b][c] == self.mask_id:
                if row.is_free:  # released by the walk's last token: the rest as the policy chose
                    decided[b][c:] = [w and t == self.mask_id for w, t in zip(want[b][c:], blk[b][c:])]
                    break
                room = self.max_tokens - idx[b][c]
                forced = row.forced() if room > 0 or row.is_closed else None  # a closed row: stop tokens
                if forced is not None and row.admit(forced, room):
                    tokens[b][c] = forced
                    self.num_forced += is_free
                elif room > 0 and (model_taken == 0 or want[b][c] or model_taken < owed[b]):
                    if not row.admit(tokens[b][c], room):
                        if taken:  # moved on already: the model proposes again, against what was decided
                            break
                        tokens[b][c] = row.fallback()
                        self.num_fallbacks += 1
                        if not row.admit(tokens[b][c], room):
                            raise RuntimeError("internal: a grammar's known completion did not fit its room")
                    model_taken += 1
                else:
                    break
                decided[b][c], taken, c = True, taken + 1, c + 1
        return (torch.tensor(tokens, dtype=candidates.dtype, device=candidates.device),
                torch.tensor(decided, device=candidates.device))

    def mask_drafts(self, logits: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
        """A speculative verification pass's logits (B, g + 1, V) from each row's frontier on, each
        position limited to what the grammar allows after the drafts (B, g) before it: a draft the
        grammar refuses (or after which no completion fits) gets no mass, so the acceptance rule
        stops there and the token that follows comes from the allowed ones."""
        masked = logits.clone()
        for b, row in enumerate(self.rows):
            trial = row.copy()
            for i in range(logits.shape[1]):
                masked[b, i].masked_fill_(~_as_wide(trial.allowed(), logits), float("-inf"))
                if drafts is None or i == drafts.shape[1]:
                    break
                draft = int(drafts[b, i])
                if not trial.admit(draft, self.max_tokens - trial.num_committed):
                    masked[b, i, draft] = float("-inf")
                    break
        return masked

    def take_run(self, b: int, run: list[int]) -> list[int]:
        """Row `b`'s next tokens, each admitted in order; the first refused (it no longer fits)
        becomes the known completion's token and ends the run."""
        row, kept = self.rows[b], []
        for token in run:
            room = self.max_tokens - row.num_committed
            if not row.admit(token, room):
                token = row.fallback()
                if not row.admit(token, room):
                    raise RuntimeError("internal: a grammar's known completion did not fit its room")
                kept.append(token)
                break
            kept.append(token)
        return kept

    def edit(self, block: torch.Tensor, tokens: torch.Tensor, edits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """A token editor's replacements (`edits` (B, T): decided positions of `block` taking `tokens`)
        under the grammar, one at a time from the left: an edit stands if the row's decided run still
        parses and fits with it (taken back to the edit and taken again), else the old token stays.
        So an edit never leaves a position undecided, and editing ends as it does without a grammar.
        Returns the block as edited."""
        out, new, idx, edit = block.tolist(), tokens.tolist(), index.tolist(), edits.tolist()
        for b in range(len(self.rows)):
            if self.rows[b].is_free:  # released: every edit stands, as without a grammar
                out[b] = [n if e and o != self.mask_id else o for o, n, e in zip(out[b], new[b], edit[b])]
                continue
            for c in [c for c, e in enumerate(edit[b]) if e and out[b][c] != self.mask_id]:
                row, end = self.rows[b], self.rows[b].num_committed
                if idx[b][c] >= end or new[b][c] == out[b][c]:
                    continue
                trial = row.copy()
                trial.rollback(end - idx[b][c])
                run = [new[b][c]] + [out[b][k] for k in range(c + 1, len(out[b])) if idx[b][k] < end]
                if trial.admit_run(run, self.max_tokens - idx[b][c]):
                    self.rows[b], out[b][c] = trial, new[b][c]
        return torch.tensor(out, dtype=block.dtype, device=block.device)

    def walk(self, index: list[int], choose: Callable[[int, int, np.ndarray], int | None],
             rows: list[bool]) -> list[list[int] | None]:
        """A canvas decided whole in one pass (a random-start sampler's): for each row in `rows`, its
        tokens at completion indices `index` (ascending from the frontier), each the grammar's forced
        token or `choose(row, column, packed)` among the tokens allowed there (`packed`: the row's mask
        there, token_mask.py; None: no choice), as `step` would admit them (a refused one, or none,
        becomes the known completion's token). The rows' matchers do not move: `take` commits a walked
        canvas; until then the states walked are kept (canvas_walk.py). A released row is not walked
        (None: the decoder's own canvas, as without a grammar)."""
        walked: list[list[int] | None] = []
        for b, row in enumerate(self.rows):
            if not rows[b] or row.is_free:
                walked.append(None)
                continue
            tree = self._trees[b]
            if tree is None or not tree.is_for(row, index[0]):
                tree = self._trees[b] = WalkTree(row, index[0])
            walked.append(tree.walk(index, self.max_tokens, partial(choose, b)))
        return walked

    def take(self, tokens: list[list[int] | None], index: list[int]) -> None:
        """Commit walked canvases (`walk`'s tokens at the same indices; None: a row that takes none): a
        row takes its walk's last state where it is kept, else admits them again."""
        if len(tokens) != len(self.rows):
            raise RuntimeError("internal: a walked canvas per row")
        for b, row_tokens in enumerate(tokens):
            tree, self._trees[b], row = self._trees[b], None, self.rows[b]
            end = tree.end(row_tokens) if row_tokens and tree is not None and tree.is_for(row, index[0]) else None
            if end is not None:
                self.rows[b] = end
                continue
            for token, i in zip(row_tokens or [], index):
                if not row.admit(token, self.max_tokens - i):
                    raise RuntimeError("internal: a walked canvas was refused when committed")

    def stats(self) -> dict[str, float]:
        """The grammar's figures for a result's timings: its compile time (the request that compiled it),
        masks and their time, closing searches, tokens placed without the model choosing them."""
        masks = sum(row.counts["masks"] for row in self.rows)
        seconds = sum(row.counts["mask_seconds"] for row in self.rows)
        compiled = self.grammar.take_compile_seconds()
        return {**({} if compiled is None else {"grammar_compile_seconds": compiled}), "grammar_masks": masks,
                "grammar_mask_seconds": seconds,
                "grammar_searches": sum(row.counts["searches"] for row in self.rows),
                "grammar_search_seconds": sum(row.counts["search_seconds"] for row in self.rows),
                "grammar_forced_tokens": self.num_forced, "grammar_fallbacks": self.num_fallbacks}
