"""The keys of the JSON objects open in a stream of bytes, so that no object repeats a key.

A JSON grammar lets an object that allows additional (or pattern) properties write the same key
twice (`{"a": 1, "a": 2}`): llguidance has no way to say otherwise, and a parser keeps only the last,
so the output can fail its own schema (three properties written, one read back under
`minProperties: 3`) while the request says "stop". Each row of a JSON output or a tool call keeps a
`JsonKeys` beside its grammar state: a token (and a completion the search finds) that would close a
key its object already holds is refused. Keys compare as JSON strings (decoded: "a" equals "\\u0061").

Bytes outside any object or array (a tool call's `<tool_call>` text) pass through. The state is an
immutable value, so copying it (a trial walk, a completion search) costs nothing. Plain Python."""
import json
from dataclasses import dataclass, replace

# One open container: an object's keys so far and whether a key comes next, or an array (keys None).
Frame = tuple[frozenset[str] | None, bool]


@dataclass(frozen=True, slots=True)
class JsonKeys:
    stack: tuple[Frame, ...] = ()
    in_string: bool = False
    is_escaped: bool = False
    key: bytes | None = None   # the key being read (None: not in a key)

    def feed(self, data: bytes) -> "JsonKeys | None":
        """The state after `data`, or None if `data` closes a key its object already holds."""
        state = self
        for byte in data:
            state = state._step(byte)
            if state is None:
                return None
        return state

    def _step(self, byte: int) -> "JsonKeys | None":
        if self.in_string:
            if self.is_escaped or byte == 0x5C:  # a backslash, or the byte it escapes
                return replace(self, is_escaped=not self.is_escaped, key=self._more(byte))
            if byte != 0x22:
                return replace(self, key=self._more(byte))
            if self.key is None:  # a value's closing quote
                return replace(self, in_string=False)
            keys, _ = self.stack[-1]
            try:
                name = json.loads(b'"' + self.key + b'"')
            except ValueError:  # not a JSON string (the grammar would not have let it close)
                name = self.key.decode("utf-8", "replace")
            if name in keys:
                return None
            return JsonKeys((*self.stack[:-1], (keys | {name}, False)))
        if byte == 0x22:
            is_key = bool(self.stack) and self.stack[-1][0] is not None and self.stack[-1][1]
            return replace(self, in_string=True, key=b"" if is_key else None)
        if byte == 0x7B:  # {
            return replace(self, stack=(*self.stack, (frozenset(), True)))
        if byte == 0x5B:  # [
            return replace(self, stack=(*self.stack, (None, False)))
        if byte in (0x7D, 0x5D) and self.stack:  # } ]
            return replace(self, stack=self.stack[:-1])
        if byte == 0x2C and self.stack and self.stack[-1][0] is not None:  # , in an object: a key next
            return replace(self, stack=(*self.stack[:-1], (self.stack[-1][0], True)))
        return self

    def _more(self, byte: int) -> bytes | None:
        return None if self.key is None else self.key + bytes([byte])
