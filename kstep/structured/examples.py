"""Short texts a spec's free-text parts must contain, as hints for the completion search
(matcher.py): inside a string whose `pattern` or `format` says what it must hold, the search cannot
see its progress byte by byte (an unanchored `\\d+\\.\\d+\\.\\d+` allows every byte until it has
matched), so it tries these first. A hint is only tried: the grammar still decides what is valid.

`example(pattern)`: a shortest string a regular expression matches, read from Python's own regex
parser (re._parser): literals, classes (a digit or a letter first), repeats at their minimum,
alternatives at their shortest; None for what it does not follow (back-references, lookarounds)."""
import json
import re
import re._constants as sre  # noqa: PLC2701 (the parser's node names: part of the regex module)
import re._parser as parser  # noqa: PLC2701
from typing import Any

# a value of each format llguidance knows, for strings that must hold one
FORMAT_EXAMPLES = {"date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z",
                   "duration": "P1D", "email": "a@a.aa", "hostname": "a", "ipv4": "0.0.0.0", "ipv6": "::1",
                   "uuid": "00000000-0000-0000-0000-000000000000", "uri": "a:a", "uri-reference": "a",
                   "iri": "a:a", "iri-reference": "a", "idn-email": "a@a.aa", "idn-hostname": "a",
                   "json-pointer": "", "relative-json-pointer": "0", "regex": "a", "uri-template": "a"}
PREFERRED = "0aA_ -./:@"
MAX_REPEAT = 64


def _one_of(items) -> str | None:
    """A character a class (an IN node's items) matches: a preferred one, else its first."""
    ranges, negated = [], False
    for op, arg in items:
        if op == sre.NEGATE:
            negated = True
        elif op == sre.LITERAL:
            ranges.append((arg, arg))
        elif op == sre.RANGE:
            ranges.append(arg)
        elif op == sre.CATEGORY:
            ranges += {sre.CATEGORY_DIGIT: [(48, 57)], sre.CATEGORY_WORD: [(97, 122)],
                       sre.CATEGORY_SPACE: [(32, 32)]}.get(arg, [(97, 97)] if "NOT" in str(arg) else [])
    inside = [c for c in PREFERRED if any(lo <= ord(c) <= hi for lo, hi in ranges)]
    if negated:
        outside = [c for c in PREFERRED if not any(lo <= ord(c) <= hi for lo, hi in ranges)]
        return outside[0] if outside else None
    return inside[0] if inside else (chr(ranges[0][0]) if ranges else None)


def _shortest(nodes) -> str | None:
    out = []
    for op, arg in nodes:
        if op == sre.LITERAL:
            piece = chr(arg)
        elif op == sre.NOT_LITERAL:
            piece = next(c for c in PREFERRED if ord(c) != arg)
        elif op == sre.ANY:
            piece = "a"
        elif op == sre.IN:
            piece = _one_of(arg)
        elif op == sre.CATEGORY:
            piece = _one_of([(op, arg)])
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            low, _, body = arg
            one = _shortest(body)
            piece = None if one is None or low > MAX_REPEAT else one * low
        elif op == sre.SUBPATTERN:
            piece = _shortest(arg[-1])
        elif op == sre.BRANCH:
            options = [o for o in (_shortest(b) for b in arg[1]) if o is not None]
            piece = min(options, key=len) if options else None
        elif op == sre.AT:
            piece = ""
        else:  # back-references, lookarounds, conditionals: not followed
            return None
        if piece is None:
            return None
        out.append(piece)
    return "".join(out)


def example(pattern: str) -> str | None:
    """A shortest string `pattern` matches (module note), or None."""
    try:
        return _shortest(parser.parse(pattern))
    except (re.error, RecursionError, OverflowError, StopIteration):
        return None


def schema_hints(schema: Any) -> list[bytes]:
    """The JSON string contents (escaped) that a schema's patterns and formats ask for."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str) and (text := example(node["pattern"])) is not None:
                found.append(text)
            if isinstance(node.get("format"), str) and node["format"] in FORMAT_EXAMPLES:
                found.append(FORMAT_EXAMPLES[node["format"]])
            for value in node.values():
                walk(value)
    walk(schema)
    return [json.dumps(text)[1:-1].encode() for text in dict.fromkeys(found) if text]
