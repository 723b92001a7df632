"""A model's grammar engine: llguidance (guidance-ai/llguidance), its token tables built once per
model from the checkpoint's tokenizer.json, and each request's spec compiled once and cached.

Why llguidance (measured in docs/benchmarks.md, `kstep bench structured --engines`): one wheel with
no dependencies (xgrammar pulls transformers, triton and a TVM runtime); it compiles a real-world
schema in 1.9 ms at the median with a 151,936-token vocabulary (xgrammar: 31 ms, 265 ms at the 95th
percentile: a compile is on the request path of every new schema); it refuses the schema features it
cannot enforce instead of approximating them; its masks (30 us median there, 3.5 ms at worst) are
slower than xgrammar's but stay under 6% of a 0.5B model's CPU decode step.

Two token tables per model: the model's own (the masks a sampler applies) and one of the 256 bytes
(matcher.py's search for the shortest completion walks bytes, whose masks are 257 bits wide).
Compilation is bounded by llguidance's fuel limits (a pathological regex or schema is refused with
its error, never a stuck slot), and a spec the engine refuses is a ValueError naming the request field.
A JSON schema is first rewritten into an equal one where JSON Schema allows it (schema.py)."""
import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import llguidance

from kstep.structured.examples import example, schema_hints
from kstep.structured.schema import enforceable, without_format
from kstep.structured.spec import StructuredSpec

KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
CACHE_SIZE = 256           # compiled grammars kept per model
# llguidance's defaults, stated: lexer fuel bounds a compile (~50k units/ms: ~20 ms) and a mask (~14 ms)
PARSER_LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                          max_grammar_size=500_000)
MAX_REWRITES = 8  # unknown formats dropped from one schema, at most
UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
BYTE_EOS = 256             # the byte table's end-of-sequence token
# JSON as json.dumps writes it, no other whitespace: the layout is forced text (no pass spent on it,
# none wasted on runs of blanks), the values are the model's; a schema's "x-guidance" may change it
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class _Bytes:
    """The byte table as llguidance's TokenizerWrapper reads it: token b is byte b, then an end token."""
    eos_token_id, bos_token_id = BYTE_EOS, None
    tokens = [bytes([b]) for b in range(256)] + [b"<|end|>"]
    special_token_ids = [BYTE_EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@dataclass(slots=True)
class Grammar:
    """A compiled spec for one model: llguidance's grammar text, checked against both token tables.
    `compile_seconds` is reported once (`take_compile_seconds`: the first request that uses it)."""
    spec: StructuredSpec
    text: str
    tokens: llguidance.LLTokenizer
    bytes: llguidance.LLTokenizer
    compile_seconds: float
    hints: tuple[bytes, ...] = ()  # texts its free text must hold, for the completion search (examples.py)
    is_reported: bool = False

    def take_compile_seconds(self) -> float | None:
        """Its compile time the first time it is asked for (a request that compiled it), then None."""
        if self.is_reported:
            return None
        self.is_reported = True
        return self.compile_seconds

    def matcher(self, table: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(table, self.text, log_level=0, limits=PARSER_LIMITS)


class GrammarCompiler:
    """One model's tables and its cache of compiled grammars (keyed by spec: equal schemas share one)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, stop_ids: list[int]):
        self.tokens = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=list(stop_ids))
        self.bytes = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
        self.cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()

    def compile(self, spec: StructuredSpec) -> Grammar:
        """The grammar of `spec` (cached); a ValueError naming spec.field when the engine refuses it."""
        key = (spec.kind, spec.value)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        start = time.perf_counter()
        schema = enforceable(json.loads(spec.value)) if spec.kind == "json" else None
        for _ in range(MAX_REWRITES):
            try:
                text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT) \
                    if schema is not None else llguidance.grammar_from(spec.kind, spec.value)
            except ValueError as e:
                raise ValueError(f"{spec.field}: {e}") from None
            error = next((m.get_error() for m in (llguidance.LLMatcher(t, text, log_level=0, limits=PARSER_LIMITS)
                                                  for t in (self.tokens, self.bytes)) if m.is_error()), None)
            unknown = UNKNOWN_FORMAT.search(error or "")
            if unknown is None or schema is None:
                break
            schema = without_format(schema, unknown.group(1))  # an annotation it cannot assert (schema.py)
        if error is not None:
            raise ValueError(f"{spec.field}: the {KIND_NAMES[spec.kind]} cannot be enforced: {_first_line(error)}")
        hints = schema_hints(schema) if schema is not None else \
            [found.encode()] if spec.kind == "regex" and (found := example(spec.value)) else []
        grammar = Grammar(spec, text, self.tokens, self.bytes, time.perf_counter() - start, tuple(hints))
        self.cache[key] = grammar
        if len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
        return grammar


def _first_line(error: str) -> str:
    """llguidance's error without the grammar listing it appends (the request's own text)."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return " ".join(lines[:4])[:500]
