"""A canvas decided whole in one pass, walked from a row's frontier (a random-start sampler's:
DiffusionGemma; constraint.py's `walk` and `take`), with the states its walks reached kept.

Every pass over a canvas walks from the same state (the row's matcher moves only when the canvas is
committed), and the state after a prefix depends on nothing but the prefix (its tokens are admitted
at fixed positions, so with fixed rooms): a tree of the prefixes walked keeps each state reached
and each token refused, so a prefix walked again (the argmax canvas, stable pass after pass; the
next input's kept samples, which share its start) costs no grammar step, and the commit takes the
walked canvas's last state instead of admitting its tokens again. The tree keeps the nodes of its
last `KEPT_WALKS` walks (a state holds two matcher copies and a mask): measured on the
structured-output benchmark, older walks add few hits."""
from collections.abc import Callable

import numpy as np

from kstep.structured.matcher import RowMatcher

KEPT_WALKS = 4  # two passes: the argmax canvas and the next input, each


class _Node:
    __slots__ = ("state", "next", "refused", "walk")

    def __init__(self, state: RowMatcher, walk: int):
        self.state, self.next, self.refused, self.walk = state, {}, set(), walk


class WalkTree:
    """The prefixes walked from one row's state (module note); valid while that row does not move."""

    def __init__(self, row: RowMatcher, start: int):
        self.row, self.start, self.num_committed = row, start, row.num_committed
        self.root, self.num_walks = _Node(row, 0), 0

    def is_for(self, row: RowMatcher, start: int) -> bool:
        return self.row is row and self.start == start and self.num_committed == row.num_committed

    def _child(self, node: _Node, token: int, room: int) -> _Node | None:
        """The node after `token` at `node` (admitted once, on a copy of its state), or None: refused."""
        found = node.next.get(token)
        if found is None and token not in node.refused:
            trial = node.state.copy()
            if not trial.admit(token, room):
                node.refused.add(token)
                return None
            found = node.next[token] = _Node(trial, self.num_walks)
        if found is not None:
            found.walk = self.num_walks
        return found

    def walk(self, index: list[int], max_tokens: int, choose: Callable[[int, np.ndarray], int | None]) -> list[int]:
        """The row's tokens at completion indices `index` (constraint.py's `walk`): each the grammar's
        forced token, else `choose(column, packed mask)` if it is admitted (None: no choice), else
        the known completion's token."""
        self.num_walks += 1
        self.root.walk, node, tokens = self.num_walks, self.root, []
        for c, i in enumerate(index):
            state, room = node.state, max_tokens - i
            forced = state.forced() if room > 0 or state.is_closed else None
            token = forced
            after = None if forced is None else self._child(node, forced, room)
            if after is None:
                token = choose(c, state.packed())
                after = None if token is None else self._child(node, token, room)
            if after is None:
                token = state.fallback()
                after = self._child(node, token, room)
                if after is None:
                    raise RuntimeError("internal: a grammar's known completion did not fit its room")
            tokens.append(token)
            node = after
        self._prune()
        return tokens

    def _prune(self) -> None:
        """Drop the nodes no walk of the last KEPT_WALKS reached (a walk reaches a node's parent too)."""
        nodes = [self.root]
        while nodes:
            node = nodes.pop()
            for token, child in list(node.next.items()):
                if child.walk <= self.num_walks - KEPT_WALKS:
                    del node.next[token]
                else:
                    nodes.append(child)

    def end(self, tokens: list[int]) -> RowMatcher | None:
        """The state after `tokens` from the row's, if a kept walk reached it (else None)."""
        node = self.root
        for token in tokens:
            node = node.next.get(token)
            if node is None:
                return None
        return node.state
