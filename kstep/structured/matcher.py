"""One row's grammar state: what its next token may be, what it must be, and how short a valid
completion from here can be.

Two llguidance matchers walk the row's committed tokens in step: one over the model's tokens (the
masks the sampler applies, the tokens the grammar forces) and one over bytes, for `closing`: a
valid completion from the current state, found greedily byte by byte. At each byte it takes the
first allowed one in a fixed preference (closers `} ] ) "` first, then digits and letters, then the
other punctuation, openers `, [ { (` and whitespace last) that changes what may follow (a byte that
leaves the allowed set as it was is a loop: `aaaa` in `[a-z]+@`); forced bytes go in at once. The
completion found is valid by construction but not always the shortest: its length is an upper bound,
so keeping it within the room left is safe (the row never commits a token after which the bound
does not fit), only sometimes early to close. Its cost counts the end-of-sequence token too: a
constrained row always ends with one (finish_reason "stop")."""
import copy
import time

import numpy as np
import torch

from kstep.structured.grammar import Grammar

_WHITESPACE = b" \n\t\r"
_FIRST = b'}])"\'`>0123456789' + bytes(range(97, 123)) + bytes(range(65, 91)) + b":-._"
_LAST = b",[{(\\"
# the byte preference of the closing search (module note); every byte once
PREFERENCE = [*_FIRST, *(b for b in range(33, 127) if b not in _FIRST + _LAST), *_LAST, *range(127, 256),
              *(b for b in range(33) if b not in _WHITESPACE), *_WHITESPACE]
NARROW_TRIES = 8     # options looked at for a byte that changes the state, until...
LOOPS_BEFORE_WIDE = 4  # ... this many bytes in a row changed nothing: then all of them
MAX_CLOSING_BYTES = 4096
TEXT_BYTES = 64      # printable ASCII bytes allowed at once: free text (a string's content)


def _bits(mask: bytes, width: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:width]


def closing_bytes(matcher, hints: tuple[bytes, ...] = ()) -> bytes | None:
    """A valid completion (bytes) from a byte-table matcher's state (module note), or None when the
    search finds none within MAX_CLOSING_BYTES. `hints`: texts the spec's free text must hold
    (examples.py), tried where the bytes one by one show no progress. The matcher is left as it was."""
    state, out, loops = matcher.deep_copy(), bytearray(), 0
    signature = state.compute_bitmask()
    while not state.is_accepting():
        forced = state.compute_ff_bytes()
        hinted = _hint(state, signature, hints) if not forced and (loops or _needs_text(signature)) else None
        if forced or hinted:
            state.consume_tokens(list(forced or hinted))
            out += forced or hinted
            signature = state.compute_bitmask()
        else:
            allowed = _bits(signature, 256)
            options = [b for b in PREFERENCE if allowed[b]]
            if not options:
                return None
            # in free text (a string's content: most printable bytes allowed) a quote ends it; elsewhere a
            # closing bracket always ends something, even where the allowed set after it looks the same
            in_text = int(allowed[32:127].sum()) >= TEXT_BYTES
            closing = [b for b in (b'"' if in_text else b"}])") if allowed[b]]
            tries = closing[:1] or (options if loops >= LOOPS_BEFORE_WIDE else options[:NARROW_TRIES])
            for byte in tries:
                child = state.deep_copy()
                child.consume_token(byte)
                child_signature = child.compute_bitmask()
                if child.is_accepting() or child_signature != signature or byte in closing:
                    state, signature, loops = child, child_signature, 0
                    break
            else:
                byte, loops = options[0], loops + 1
                state.consume_token(byte)
            out.append(byte)
        if len(out) > MAX_CLOSING_BYTES or state.is_error():
            return None
    return bytes(out)


def _needs_text(signature: bytes) -> bool:
    """Inside free text (most printable bytes allowed) that may not end yet (no closing quote allowed)."""
    allowed = _bits(signature, 256)
    return int(allowed[32:127].sum()) >= TEXT_BYTES and not allowed[ord('"')]


def _hint(state, signature: bytes, hints: tuple[bytes, ...]) -> bytes | None:
    """The first hint the state takes and after which something changes (its end may follow)."""
    for hint in hints:
        trial = state.deep_copy()
        if trial.consume_tokens(list(hint)) and (trial.is_accepting() or trial.compute_bitmask() != signature):
            return hint
    return None


def _completes(matcher, text: bytes) -> bool:
    """Whether `text` is a completion from a byte-table matcher's state (the matcher is left as it was)."""
    trial = matcher.deep_copy()
    return trial.consume_tokens(list(text)) and trial.is_accepting()


class RowMatcher:
    """One row's state under a grammar (module note). `num_committed`: the row's completion tokens
    it has taken, all valid, in order; `is_closed` once it took an end-of-sequence token. It always
    knows one valid completion from its state (`closing`: bytes, and their tokens then the stop
    token) whose cost fits the room its caller gave: every token is taken through `admit`, which
    refuses one after which no known completion fits, and `fallback` (the known completion's next
    token) is always admitted."""

    def __init__(self, grammar: Grammar, stop_ids: list[int], vocab_size: int):
        self.tokens, self.bytes = grammar.matcher(grammar.tokens), grammar.matcher(grammar.bytes)
        self.table, self.stop_ids, self.vocab_size, self.hints = grammar.tokens, stop_ids, vocab_size, grammar.hints
        self.stop_token = stop_ids[0]
        self.num_committed, self.is_closed = 0, False
        self._allowed: torch.Tensor | None = None   # the current state's mask, until the next commit
        self._forced: list[int] | None = None       # the current state's forced tokens, until the next commit
        self._token_bytes: dict[int, bytes] = {}
        self.counts = {"masks": 0, "mask_seconds": 0.0, "searches": 0, "search_seconds": 0.0}
        self.history: list[tuple] = []  # per token the matchers took: (its bytes (None: the stop), the completion before)
        found = self._search(self.bytes)
        self.closing = None if found is None else (found, self._tokens_after(self.tokens, found))

    def copy(self) -> "RowMatcher":
        """A row in the same state that moves on alone (a sampler's trial walk); its counts are this one's."""
        other = copy.copy(self)
        other.tokens, other.bytes, other.history = self.tokens.deep_copy(), self.bytes.deep_copy(), list(self.history)
        return other

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` committed tokens (a token editor changed one of them)."""
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
        self.closing, self.is_closed = taken[0][1], False
        self._allowed = self._forced = None

    def cost(self) -> int | None:
        """Positions the known completion takes, its end-of-sequence token included (None: none known)."""
        return None if self.closing is None else len(self.closing[1])

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens the grammar allows next (end-of-sequence once it accepts)."""
        if self._allowed is None:
            start = time.perf_counter()
            if self.is_closed:
                allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
                allowed[self.stop_token] = True
            else:
                allowed = torch.from_numpy(_bits(self.tokens.compute_bitmask(), self.vocab_size).astype(bool))
            self._allowed = allowed
            self.counts["masks"] += 1
            self.counts["mask_seconds"] += time.perf_counter() - start
        return self._allowed

    def forced(self) -> int | None:
        """The next token when the grammar allows only one text (placed without a pass), else None."""
        if self.is_closed or self.tokens.is_stopped():
            return self.stop_token
        if self._forced is None:
            self._forced = list(self.tokens.compute_ff_tokens())
        return self._forced[0] if self._forced else None

    def fallback(self) -> int:
        """The known completion's next token: always admitted where the state's own cost fitted."""
        return self.stop_token if self.is_closed else self.closing[1][0]

    def admit(self, token: int, room: int) -> bool:
        """Take `token` as the row's next one if the grammar allows it and a known completion after
        it fits in the `room` positions left from it (its own included); else change nothing."""
        if self.is_closed or token in self.stop_ids:
            if not (self.is_closed or self.tokens.is_accepting()) or token not in self.stop_ids:
                return False
            if not self.is_closed:  # the matchers need not see it: nothing follows (and it takes none back)
                self.history.append((None, self.closing))
                self.is_closed = True
            self.num_committed, self._allowed = self.num_committed + 1, None
            return True
        if self.tokens.validate_tokens([token]) != 1:
            return False
        text = self._bytes_of(token)
        after = self.bytes.deep_copy()
        if not after.consume_tokens(list(text)):
            return False
        known, _ = self.closing  # the known completion goes on (its rest, or all of it after a token inside
        rest = known[len(text):] if known.startswith(text) else known if _completes(after, known) \
            else self._search(after)  # a string or a number): a search only when it does not
        if rest is None:
            return False
        tokens = self.tokens.deep_copy()
        tokens.consume_token(token)
        rest_tokens = self._tokens_after(tokens, rest)
        if 1 + len(rest_tokens) > room:
            return False
        self.history.append((text, self.closing))
        self.tokens, self.bytes, self.closing = tokens, after, (rest, rest_tokens)
        self.num_committed += 1
        self._allowed = self._forced = None
        return True

    def admit_run(self, run: list[int], room: int) -> bool:
        """Take the tokens `run` as the row's next ones if the grammar allows them all and a known
        completion after the last fits in `room` (positions left from the first): one search, at
        the end (a state inside the run has the run's rest then that completion). Else change nothing."""
        cut = next((i for i, t in enumerate(run) if t in self.stop_ids), len(run))
        text_run, stops = run[:cut], run[cut:]
        if self.is_closed or any(t not in self.stop_ids for t in stops):
            return self.is_closed and not text_run and not [t for t in stops if t not in self.stop_ids]
        texts = [self._bytes_of(t) for t in text_run]
        tokens, after = self.tokens.deep_copy(), self.bytes.deep_copy()
        if tokens.validate_tokens(text_run) != len(text_run) or not after.consume_tokens(list(b"".join(texts))):
            return False
        tokens.consume_tokens(text_run)
        if stops and not tokens.is_accepting():
            return False
        rest = b"" if stops else self._search(after)
        if rest is None:
            return False
        rest_tokens = [self.stop_token] if stops else self._tokens_after(tokens, rest)
        if len(text_run) + len(rest_tokens) > room:
            return False
        for i, text in enumerate(texts):  # each state's known completion: the run's rest, then the end's
            self.history.append((text, (b"".join(texts[i:]) + rest, text_run[i:] + rest_tokens)))
        if stops:
            self.history.append((None, (b"", [self.stop_token])))
        self.tokens, self.bytes, self.closing = tokens, after, (rest, rest_tokens)
        self.num_committed, self.is_closed = self.num_committed + len(run), bool(stops)
        self._allowed = self._forced = None
        return True

    def _bytes_of(self, token: int) -> bytes:
        if token not in self._token_bytes:
            self._token_bytes[token] = self.table.decode_bytes([token])
        return self._token_bytes[token]

    def _tokens_after(self, tokens, text: bytes) -> list[int]:
        """`text` as model tokens the token matcher `tokens` takes from its state, then the stop token:
        the tokenizer's, or byte by byte where the grammar refuses that split."""
        ids = self.table.tokenize_bytes(text) if text else []
        if ids and tokens.validate_tokens(ids) != len(ids):
            ids = [i for b in text for i in self.table.tokenize_bytes(bytes([b]))]
        return [*ids, self.stop_token]

    def _search(self, matcher) -> bytes | None:
        start = time.perf_counter()
        found = closing_bytes(matcher, self.hints)
        self.counts["searches"] += 1
        self.counts["search_seconds"] += time.perf_counter() - start
        return found
