"""Which request fields the server knows, and what it does with each one that is not honoured:
an OpenAI field with no effect on the output is accepted and ignored (logged, as vLLM does); an
OpenAI field that would change the output is refused by name unless it holds its no-op value;
any other field (a misspelt knob, another endpoint's field, a made-up one) is a 400 naming it,
with the known field one edit away when there is one. protocol.py declares the fields; this
module says how they are treated. No pydantic here."""
from collections.abc import Callable


def _empty(value) -> bool:
    return value is None or value == [] or value == {} or value == 0 or value is False


# OpenAI fields kstep does not implement that change the output, each with the test that a value is
# its no-op (what OpenAI does when the field is left out): any other value is refused by name.
NOT_SUPPORTED: dict[str, Callable[[object], bool]] = {
    "presence_penalty": _empty,
    "frequency_penalty": _empty,
    "logprobs": _empty,
    "top_logprobs": _empty,
    "best_of": lambda v: v is None or v == 1,
    "functions": _empty,
    "function_call": lambda v: v is None or v == "none",
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "reasoning_effort": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "moderation": lambda v: v is None,
}

# OpenAI fields with no effect on the tokens: bookkeeping, billing, caching and latency hints.
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_options",
           "prompt_cache_retention", "safety_identifier", "prediction")


def first_unsupported(values: dict[str, object]) -> str | None:
    """The first field of `values` (name -> value, as given) kstep refuses: not supported, not its no-op."""
    return next((name for name, value in values.items() if name in NOT_SUPPORTED and not NOT_SUPPORTED[name](value)),
                None)


def _one_edit_apart(a: str, b: str) -> bool:
    """One insertion, deletion, substitution or swap of neighbours (Damerau-Levenshtein distance 1)."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def unknown_field_message(name: str, known: set[str], where: str, elsewhere: dict[str, set[str]]) -> str:
    """Why `name` is refused at `where` (an endpoint, or a nested object's path): the known field one
    edit away, or the other endpoint it belongs to, or neither."""
    near = sorted(k for k in known if name.lower() == k or _one_edit_apart(name.lower(), k))
    if near:
        return f"unknown field {name!r}: did you mean {near[0]!r}?"
    other = [endpoint for endpoint, fields in elsewhere.items() if name in fields]
    if other:
        return f"unknown field {name!r} for {where}: it is a field of {other[0]}"
    return (f"unknown field {name!r}: it is neither an OpenAI field of {where} nor a kstep knob "
            "(docs/serving.md lists them)")
