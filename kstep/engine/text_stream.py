"""Progressive output disclosure: a row's committed tokens -> text deltas that are never retracted.

A position is committed when it and every position before it are unmasked: no later step can
change it. Committed text is sent, except a tail that is not yet final text: an incomplete UTF-8
character (byte-level BPE), or the start of a stop string that the next tokens may complete (the
stop string itself is never sent, as in the OpenAI API).
"""
from collections.abc import Callable

from kstep.tokenizer import Tokenizer

MASK_PLACEHOLDER = "\u2591"  # one per masked position in `include_canvas` snapshots


def _held_back(text: str, stop: list[str]) -> int:
    """How many trailing characters could still become the start of a stop string."""
    longest = 0
    for s in stop:
        for size in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:size]):
                longest = size
                break
    return longest


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, stop_ids: list[int], stop: list[str], given_back: str = "",
                 is_text: Callable[[], bool] | None = None):
        """`given_back`: text token healing took off the prompt; the first token starts with it, and it
        is not the completion's. `is_text`: whether the row is free text yet, where stop strings apply
        (a text answer beside tool calls: structured/matcher.py; a call is never cut by one)."""
        self.tokenizer, self.stop_ids, self.stop, self.given_back = tokenizer, set(stop_ids), stop, given_back
        self.is_text = is_text or (lambda: True)
        self.sent_text, self.num_sent_ids = "", 0
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.last_canvas: list[int] | None = None  # the canvas last reported (include_canvas)

    def canvas_edits(self, canvas: list[int], mask_id: int | None) -> list[int]:
        """Positions of `canvas` holding another token than when the canvas was last reported (not
        a mask filled in: an edit, which token-editing and random-start samplers make), and remember it."""
        last, self.last_canvas = self.last_canvas, list(canvas)
        if last is None:
            return []
        return [i for i, (old, new) in enumerate(zip(last, canvas)) if old != new and old != mask_id and new != mask_id]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def update(self, committed: list[int], is_last: bool) -> tuple[str, list[int]]:
        """Given the row's committed token ids so far (and whether decoding has ended), the new text
        and ids to send. Sets `finish_reason` once the row is done."""
        if self.finish_reason is not None:
            return "", []
        ids, reason = committed, None
        for i, token in enumerate(committed):
            if token in self.stop_ids:
                ids, reason = committed[:i], "stop"
                break
        text = self._decode(ids)
        if self.given_back:
            text = text[len(self.given_back):] if text.startswith(self.given_back) else ""
        stop = self.stop if self.is_text() else []
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        if reason is None and is_last:
            reason = "length"
        if reason is None:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - _held_back(text, self.stop)]  # (a call's too: it may become text)
        self.finish_reason = reason
        self.num_tokens = len(ids)
        if not text.startswith(self.sent_text):  # cannot retract: wait until the text extends what was sent
            return "", []
        delta, new_ids = text[len(self.sent_text):], ids[self.num_sent_ids:]
        self.sent_text, self.num_sent_ids = text, len(ids)
        return delta, new_ids


def canvas_pieces(tokenizer: Tokenizer | None, row: list[int], mask_id: int | None) -> list[str | None]:
    """Each canvas position's own text (None where masked), for clients that draw positions: which
    were unmasked by this pass, which are committed. A token that is part of a multi-byte character
    shows as U+FFFD on its own."""
    return [None if t == mask_id else tokenizer.token_text(t) if tokenizer is not None else str(t) for t in row]


def render_canvas(tokenizer: Tokenizer | None, row: list[int], mask_id: int | None) -> str:
    """The whole canvas as text, each masked position shown as MASK_PLACEHOLDER."""
    if tokenizer is None:
        return " ".join(MASK_PLACEHOLDER if t == mask_id else str(t) for t in row)
    parts, run = [], []
    for token in row:
        if token == mask_id:
            if run:
                parts.append(tokenizer.decode(run))
                run = []
            parts.append(MASK_PLACEHOLDER)
        else:
            run.append(token)
    if run:
        parts.append(tokenizer.decode(run))
    return "".join(parts)
