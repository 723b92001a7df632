"""One row's grammar state: what its next token may be, what it must be, and how short a valid
completion from here can be.

Two llguidance matchers walk the row's committed tokens in step: one over the model's tokens (the
masks the sampler applies, the tokens the grammar forces) and one over bytes, for `closing`: a valid
completion from the current state, found by the completion search (search.py). Its length is an
upper bound, so keeping it within the room left is safe (the row never commits a token after which
the bound does not fit), only sometimes early to close. Its cost counts the end-of-sequence token
too: a constrained row always ends with one (finish_reason "stop"), with one exception:

A free-text answer beside tool calls (tool_grammar.py: the grammar's `trigger`) is constrained only
while its text may still become a call (a prefix of the call's opening, or nothing yet). The first
token that leaves that prefix releases the row (`is_free`): from then on it takes any token, keeps
no room for a completion and ends as free text does (max_tokens: "length"). A stop token before that
ends it as text too.

A JSON output (or tool call) also keeps its open objects' keys (json_keys.py): a token that would
repeat a key in one object is refused, and the completions found repeat none."""
import copy
import time

import numpy as np
import torch

from kstep.structured.grammar import Grammar
from kstep.structured.json_keys import JsonKeys
from kstep.structured.search import closing_bytes, completes, tokens_after
from kstep.structured.token_mask import allow, every, fill, fill_one, num_words, only, trim, unpack


class RowMatcher:
    """One row's state under a grammar (module note). `num_committed`: the row's completion tokens
    it has taken, all valid, in order; `is_closed` once it took an end-of-sequence token. It always
    knows one valid completion from its state (`closing`: bytes, and their tokens then the stop
    token) whose cost fits the room its caller gave: every token is taken through `admit`, which
    refuses one after which no known completion fits, and `fallback` (the known completion's next
    token) is always admitted. A released row (`is_free`) takes every token."""

    def __init__(self, grammar: Grammar, stop_ids: list[int], vocab_size: int):
        self.tokens, self.bytes = grammar.matcher(grammar.tokens), grammar.matcher(grammar.bytes)
        self.table, self.stop_ids, self.vocab_size, self.hints = grammar.tokens, stop_ids, vocab_size, grammar.hints
        self.stop_token, self.num_words = stop_ids[0], num_words(grammar.tokens.vocab_size)  # a packed mask's width
        self.num_committed, self.is_closed, self.is_free = 0, False, False
        self.trigger, self.prefix = grammar.trigger, b""  # while undecided: the opening it may still become
        self.keys = JsonKeys() if grammar.tracks_keys else None
        self._allowed: np.ndarray | None = None     # the current state's packed mask, until the next commit
        self._forced: list[int] | None = None       # the current state's forced tokens, until the next commit
        self._token_bytes: dict[int, bytes] = {}
        self.counts = {"masks": 0, "mask_seconds": 0.0, "searches": 0, "search_seconds": 0.0}
        # per token the matchers took: (its bytes (None: the stop), the state before: completion, keys, prefix)
        self.history: list[tuple] = []
        self.closing = grammar.start  # found once, when the grammar was compiled

    def copy(self) -> "RowMatcher":
        """A row in the same state that moves on alone (a sampler's trial walk); its counts are this one's."""
        other = copy.copy(self)
        other.tokens, other.bytes, other.history = self.tokens.deep_copy(), self.bytes.deep_copy(), list(self.history)
        return other

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` committed tokens (a token editor changed one of them)."""
        if self.is_free:
            raise RuntimeError("internal: a released row keeps no grammar state to take back")
        self.num_committed -= num_tokens
        # the matchers saw the tokens in `history`; stop tokens past the one that closed the row they never saw
        num_tokens = max(0, len(self.history) - self.num_committed)
        if num_tokens == 0:
            return
        taken, self.history = self.history[-num_tokens:], self.history[:-num_tokens]
        texts = [text for text, _ in taken if text is not None]  # the closing stop token: the matchers never saw it
        if not self.tokens.rollback(len(texts)):
            raise RuntimeError(f"internal: the grammar could not take back {len(texts)} tokens")
        self.bytes.rollback(sum(len(text) for text in texts))
        (self.closing, self.keys, self.trigger, self.prefix), self.is_closed = taken[0][1], False
        self._allowed = self._forced = None

    def cost(self) -> int | None:
        """Positions the known completion takes, its end-of-sequence token included (None: none known)."""
        return None if self.closing is None else len(self.closing[1])

    @property
    def needs_mask(self) -> bool:
        """Whether its next mask is llguidance's to compute: not known yet, and neither closed nor released."""
        return self._allowed is None and not (self.is_free or self.is_closed)

    def packed(self) -> np.ndarray:
        """(W,) int32: the tokens the grammar allows next, packed (token_mask.py): end-of-sequence once it
        accepts; a closed row only its stop token, a released row every token (`fill_masks`: a batch's)."""
        if self._allowed is None:
            start = time.perf_counter()
            words = every(self.vocab_size, self.num_words) if self.is_free else \
                only([self.stop_token], self.num_words) if self.is_closed else fill_one(self.tokens, self.num_words)
            self.take_mask(words, time.perf_counter() - start)
        return self._allowed

    def take_mask(self, words: np.ndarray, seconds: float) -> None:
        """Keep `words` (W,) int32, the current state's mask (`packed`'s, or llguidance's computed with
        other rows' at once), as the row's; it may change them in place."""
        if self.trigger is not None and not (self.is_free or self.is_closed):
            allow(words, self.stop_ids)  # ending as text is always allowed while undecided
        self._allowed = trim(words, self.vocab_size)
        self.counts["masks"] += 1
        self.counts["mask_seconds"] += seconds

    def allowed(self) -> torch.Tensor:
        """(V,) bool: `packed`, a byte per token (a walk's or a speculative verification's)."""
        return torch.from_numpy(unpack(self.packed(), self.vocab_size))

    def forced(self) -> int | None:
        """The next token when the grammar allows only one text (placed without a pass), else None."""
        if self.is_free:
            return None
        if self.is_closed or self.tokens.is_stopped():
            return self.stop_token
        if self._forced is None:
            self._forced = list(self.tokens.compute_ff_tokens())
        return self._forced[0] if self._forced else None

    def fallback(self) -> int:
        """The known completion's next token: always admitted where the state's own cost fitted."""
        return self.stop_token if self.is_closed else self.closing[1][0]

    def _state(self) -> tuple:
        return self.closing, self.keys, self.trigger, self.prefix

    def _release(self, token: int) -> bool:
        """Whether `token` releases an undecided row (module note): it ends the text, or the text no
        longer starts like a call. Then the row takes it and every token after it."""
        if token in self.stop_ids:
            self.is_closed = True
        else:
            text = self.prefix + self._bytes_of(token)
            if self.trigger.startswith(text) or text.startswith(self.trigger):
                return False
        self.is_free, self.num_committed, self._allowed, self._forced = True, self.num_committed + 1, None, None
        return True

    def admit(self, token: int, room: int) -> bool:
        """Take `token` as the row's next one if the grammar allows it and a known completion after
        it fits in the `room` positions left from it (its own included); else change nothing."""
        if self.is_free:
            self.is_closed |= token in self.stop_ids
            self.num_committed += 1
            return True
        if self.trigger is not None and not self.is_closed and self._release(token):
            return True
        if self.is_closed or token in self.stop_ids:
            if not (self.is_closed or self.tokens.is_accepting()) or token not in self.stop_ids:
                return False
            if not self.is_closed:  # the matchers need not see it: nothing follows (and it takes none back)
                self.history.append((None, self._state()))
                self.is_closed = True
            self.num_committed, self._allowed = self.num_committed + 1, None
            return True
        if self.tokens.validate_tokens([token]) != 1:
            return False
        text = self._bytes_of(token)
        keys = None if self.keys is None else self.keys.feed(text)
        after = self.bytes.deep_copy()
        if (self.keys is not None and keys is None) or not after.consume_tokens(list(text)):
            return False
        known, _ = self.closing  # the known completion goes on (its rest, or all of it after a token inside
        rest = known[len(text):] if known.startswith(text) else known if completes(after, known, keys) \
            else self._search(after, keys)  # a string or a number): a search only when it does not
        if rest is None:
            return False
        tokens = self.tokens.deep_copy()
        tokens.consume_token(token)
        rest_tokens = self._tokens_after(tokens, rest)
        if 1 + len(rest_tokens) > room:
            return False
        self.history.append((text, self._state()))
        self.tokens, self.bytes, self.closing, self.keys = tokens, after, (rest, rest_tokens), keys
        self._advance(text)
        self.num_committed += 1
        self._allowed = self._forced = None
        return True

    def _advance(self, text: bytes) -> None:
        """An undecided row's text grew by `text` (a call's opening so far): once it holds the whole
        opening the row is a call, kept by the grammar to its end."""
        if self.trigger is not None:
            self.prefix += text
            if self.prefix.startswith(self.trigger):
                self.trigger, self.prefix = None, b""

    def admit_run(self, run: list[int], room: int) -> bool:
        """Take the tokens `run` as the row's next ones if the grammar allows them all and a known
        completion after the last fits in `room` (positions left from the first): one search, at
        the end (a state inside the run has the run's rest then that completion). Else change nothing.
        (Token editing's: a row it edits is never undecided, its text is decided from the left.)"""
        if self.is_free:
            self.is_closed |= any(t in self.stop_ids for t in run)
            self.num_committed += len(run)
            return True
        cut = next((i for i, t in enumerate(run) if t in self.stop_ids), len(run))
        text_run, stops = run[:cut], run[cut:]
        if self.is_closed or any(t not in self.stop_ids for t in stops):
            return self.is_closed and not text_run and not [t for t in stops if t not in self.stop_ids]
        texts = [self._bytes_of(t) for t in text_run]
        tokens, after = self.tokens.deep_copy(), self.bytes.deep_copy()
        joined = b"".join(texts)
        keys = None if self.keys is None else self.keys.feed(joined)
        if tokens.validate_tokens(text_run) != len(text_run) or not after.consume_tokens(list(joined)) \
                or (self.keys is not None and keys is None):
            return False
        tokens.consume_tokens(text_run)
        if stops and not tokens.is_accepting():
            return False
        rest = b"" if stops else self._search(after, keys)
        if rest is None:
            return False
        rest_tokens = [self.stop_token] if stops else self._tokens_after(tokens, rest)
        if len(text_run) + len(rest_tokens) > room:
            return False
        state = self.keys
        for i, text in enumerate(texts):  # each state's known completion: the run's rest, then the end's
            self.history.append((text, ((b"".join(texts[i:]) + rest, text_run[i:] + rest_tokens), state,
                                        self.trigger, self.prefix)))
            state = None if state is None else state.feed(text)
            self._advance(text)
        if stops:
            self.history.append((None, ((b"", [self.stop_token]), state, self.trigger, self.prefix)))
        self.tokens, self.bytes, self.closing, self.keys = tokens, after, (rest, rest_tokens), keys
        self.num_committed, self.is_closed = self.num_committed + len(run), bool(stops)
        self._allowed = self._forced = None
        return True

    def _bytes_of(self, token: int) -> bytes:
        if token not in self._token_bytes:
            self._token_bytes[token] = self.table.decode_bytes([token])
        return self._token_bytes[token]

    def _tokens_after(self, tokens, text: bytes) -> list[int]:
        return tokens_after(self.table, tokens, text, self.stop_token)

    def _search(self, matcher, keys: JsonKeys | None) -> bytes | None:
        start = time.perf_counter()
        found = closing_bytes(matcher, self.hints, keys)
        self.counts["searches"] += 1
        self.counts["search_seconds"] += time.perf_counter() - start
        return found


def fill_masks(rows: list[RowMatcher]) -> np.ndarray:
    """(B, W) int32: each row's `packed` mask; those llguidance must compute, computed at once by its
    parallel filler (token_mask.py) and kept by their rows."""
    width = rows[0].num_words
    if any(row.num_words != width for row in rows):
        raise RuntimeError("internal: the rows of one packed mask batch have one token table")
    out = np.empty((len(rows), width), dtype=np.int32)
    todo = [(row.tokens, b) for b, row in enumerate(rows) if row.needs_mask]
    if todo:
        start = time.perf_counter()
        fill(todo, out)
        seconds = (time.perf_counter() - start) / len(todo)
        for _, b in todo:
            rows[b].take_mask(out[b], seconds)  # a view: the row's mask is this array's row, changed in place
    filled = {b for _, b in todo}
    for b, row in enumerate(rows):
        if b not in filled:
            out[b] = row.packed()
    return out
