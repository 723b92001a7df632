"""The completion search: a valid completion (bytes) from a byte-table matcher's state, found greedily
byte by byte. At each byte it takes the first allowed one in a fixed preference (closers `} ] ) "`
first, then digits and letters, then the other punctuation, openers `, [ { (` and whitespace last)
that changes what may follow (a byte that leaves the allowed set as it was is a loop: `aaaa` in
`[a-z]+@`); forced bytes go in at once. The completion found is valid by construction but not always
the shortest: its length is an upper bound (matcher.py keeps it within the room left).

With a JSON key tracker (json_keys.py), no byte that would close a key its object already holds is
taken, so the completion repeats no key either. The search is bounded in bytes and in steps (a byte
taken or tried: each costs a matcher copy and a mask), so a spec whose completion is out of reach
(`minLength: 1000000`) is refused after a bounded amount of work, the same on every machine (a
bound in seconds would refuse a spec on a busy machine that an idle one admits). No torch."""
import numpy as np

from kstep.structured.json_keys import JsonKeys

_WHITESPACE = b" \n\t\r"
_FIRST = b'}])"\'`>0123456789' + bytes(range(97, 123)) + bytes(range(65, 91)) + b":-._"
_LAST = b",[{(\\"
# the byte preference of the search (module note); every byte once
PREFERENCE = [*_FIRST, *(b for b in range(33, 127) if b not in _FIRST + _LAST), *_LAST, *range(127, 256),
              *(b for b in range(33) if b not in _WHITESPACE), *_WHITESPACE]
NARROW_TRIES = 8     # options looked at for a byte that changes the state, until...
LOOPS_BEFORE_WIDE = 4  # ... this many bytes in a row changed nothing: then all of them
MAX_CLOSING_BYTES = 4096
# bytes taken and tried in one search, at most: every schema of the bench's sample needs under 420 (at
# most 25 ms), `minLength: 1000000` would need millions (5,000 take about 0.1 s)
MAX_SEARCH_STEPS = 5_000
TEXT_BYTES = 64      # printable ASCII bytes allowed at once: free text (a string's content)


def bits(mask: bytes, width: int) -> np.ndarray:
    """llguidance's packed mask (little-endian bits) as one 0/1 byte per id, `width` of them."""
    return np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:width]


def closing_bytes(matcher, hints: tuple[bytes, ...] = (), keys: JsonKeys | None = None) -> bytes | None:
    """A valid completion from a byte-table matcher's state (module note), or None when the search
    finds none within its bounds. `hints`: texts the spec's free text must hold (examples.py), tried
    where the bytes one by one show no progress; `keys`: the JSON keys open at the state (None: not
    tracked). The matcher is left as it was."""
    state, out, loops, steps = matcher.deep_copy(), bytearray(), 0, 0
    signature = state.compute_bitmask()
    while not state.is_accepting():
        steps += 1
        forced = state.compute_ff_bytes()
        hinted = _hint(state, signature, hints, keys) if not forced and (loops or _needs_text(signature)) else None
        if forced or hinted:
            text = forced or hinted
            if len(out) + len(text) > MAX_CLOSING_BYTES:
                return None  # before taking them: a regex may force a million bytes
            if keys is not None and (keys := keys.feed(text)) is None:
                return None  # the grammar forces a key the object holds already
            state.consume_tokens(list(text))
            out += text
            signature = state.compute_bitmask()
        else:
            allowed = bits(signature, 256)
            options = [b for b in PREFERENCE if allowed[b] and (keys is None or not keys.closes_repeated_key(b))]
            if not options:
                return None
            # in free text (a string's content: most printable bytes allowed) a quote ends it; elsewhere a
            # closing bracket always ends something, even where the allowed set after it looks the same
            in_text = int(allowed[32:127].sum()) >= TEXT_BYTES
            closing = [b for b in (b'"' if in_text else b"}])") if b in options]
            tries = closing[:1] or (options if loops >= LOOPS_BEFORE_WIDE else options[:NARROW_TRIES])
            for byte in tries:
                steps += 1
                child = state.deep_copy()
                child.consume_token(byte)
                child_signature = child.compute_bitmask()
                if child.is_accepting() or child_signature != signature or byte in closing:
                    state, signature, loops = child, child_signature, 0
                    break
            else:
                byte, loops = options[0], loops + 1
                state.consume_token(byte)
            keys = None if keys is None else keys.feed(bytes([byte]))
            out.append(byte)
        if len(out) > MAX_CLOSING_BYTES or state.is_error() or steps > MAX_SEARCH_STEPS:
            return None
    return bytes(out)


def _needs_text(signature: bytes) -> bool:
    """Inside free text (most printable bytes allowed) that may not end yet (no closing quote allowed)."""
    allowed = bits(signature, 256)
    return int(allowed[32:127].sum()) >= TEXT_BYTES and not allowed[ord('"')]


def _hint(state, signature: bytes, hints: tuple[bytes, ...], keys: JsonKeys | None) -> bytes | None:
    """The first hint the state takes and after which something changes (its end may follow)."""
    for hint in hints:
        trial = state.deep_copy()
        if trial.consume_tokens(list(hint)) and (trial.is_accepting() or trial.compute_bitmask() != signature) \
                and (keys is None or keys.feed(hint) is not None):
            return hint
    return None


def completes(matcher, text: bytes, keys: JsonKeys | None = None) -> bool:
    """Whether `text` is a completion from a byte-table matcher's state (and repeats no key after
    `keys`); the matcher is left as it was."""
    trial = matcher.deep_copy()
    return trial.consume_tokens(list(text)) and trial.is_accepting() and (keys is None or keys.feed(text) is not None)


def tokens_after(table, tokens, text: bytes, stop_token: int) -> list[int]:
    """`text` as model tokens the token matcher `tokens` takes from its state, then the stop token:
    the tokenizer's, or byte by byte where the grammar refuses that split."""
    ids = table.tokenize_bytes(text) if text else []
    if ids and tokens.validate_tokens(ids) != len(ids):
        ids = [i for b in text for i in table.tokenize_bytes(bytes([b]))]
    return [*ids, stop_token]
