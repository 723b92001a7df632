"""The keys of the JSON objects open in a stream of bytes, so that no object repeats a key.

A JSON grammar lets an object that allows additional (or pattern) properties write the same key
twice (`{"a": 1, "a": 2}`): llguidance has no way to say otherwise, and a parser keeps only the last,
so the output can fail its own schema (three properties written, one read back under
`minProperties: 3`) while the request says "stop". Each row of a JSON output or a tool call keeps a
`JsonKeys` beside its grammar state: a token (and a completion the search finds) that would close a
key its object already holds is refused. Keys compare as JSON strings (decoded: "a" equals "\\u0061").

Bytes outside any object or array (a tool call's `<tool_call>` text) pass through. The state is an
immutable value, so copying it (a trial walk, a completion search) costs nothing; it is fed on the
grammar's hot paths (every admitted token, every byte a completion search takes), so a value's text
is skipped a run at a time and only a quote can close a key (`closes_repeated_key`). Plain Python."""
import json

# One open container: an object's keys so far and whether a key comes next, or an array (keys None).
Frame = tuple[frozenset[str] | None, bool]
QUOTE, BACKSLASH = 0x22, 0x5C


class JsonKeys:
    __slots__ = ("stack", "in_string", "is_escaped", "key")

    def __init__(self, stack: tuple[Frame, ...] = (), in_string: bool = False, is_escaped: bool = False,
                 key: bytes | None = None):
        self.stack, self.in_string, self.is_escaped = stack, in_string, is_escaped
        self.key = key  # the key being read (None: not in a key)

    def closes_repeated_key(self, byte: int) -> bool:
        """Whether `byte` next would close a key its object already holds (`feed` would give None)."""
        return byte == QUOTE and self.in_string and self.key is not None and not self.is_escaped \
            and self._name() in self.stack[-1][0]

    def feed(self, data: bytes) -> "JsonKeys | None":
        """The state after `data`, or None if `data` closes a key its object already holds."""
        stack, in_string, is_escaped, key = self.stack, self.in_string, self.is_escaped, self.key
        i, n = 0, len(data)
        while i < n:
            if in_string:
                if is_escaped:
                    is_escaped = False
                else:  # a run of the string's text, up to its next quote or backslash
                    end = _next_special(data, i)
                    if key is not None:
                        key += data[i:end]
                    if end == n:
                        break
                    i = end
                    if data[i] == BACKSLASH:
                        is_escaped = True
                    else:  # the closing quote
                        in_string = False
                        if key is not None:
                            keys = stack[-1][0]
                            name = _decoded(key)
                            if name in keys:
                                return None
                            stack, key = (*stack[:-1], (keys | {name}, False)), None
                        i += 1
                        continue
                if key is not None:
                    key += data[i:i + 1]
            else:
                byte = data[i]
                if byte == QUOTE:
                    in_string = True
                    key = b"" if stack and stack[-1][0] is not None and stack[-1][1] else None
                elif byte == 0x7B:  # {
                    stack = (*stack, (frozenset(), True))
                elif byte == 0x5B:  # [
                    stack = (*stack, (None, False))
                elif byte in (0x7D, 0x5D) and stack:  # } ]
                    stack = stack[:-1]
                elif byte == 0x2C and stack and stack[-1][0] is not None:  # , in an object: a key next
                    stack = (*stack[:-1], (stack[-1][0], True))
            i += 1
        return JsonKeys(stack, in_string, is_escaped, key)

    def _name(self) -> str:
        return _decoded(self.key)


def _next_special(data: bytes, start: int) -> int:
    """The index of the next quote or backslash in `data` from `start` (len(data): none)."""
    quote, backslash = data.find(b'"', start), data.find(b"\\", start)
    found = [i for i in (quote, backslash) if i >= 0]
    return min(found) if found else len(data)


def _decoded(key: bytes) -> str:
    try:
        return json.loads(b'"' + key + b'"')
    except ValueError:  # not a JSON string (the grammar would not have let it close)
        return key.decode("utf-8", "replace")
