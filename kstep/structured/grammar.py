"""A model's grammar engine: llguidance (guidance-ai/llguidance), its token tables built once per
model from the checkpoint's tokenizer.json, and each request's spec compiled once: its grammar
text, checked against both token tables, and the completion the search finds from its start
(search.py), or the reason it is refused. Both outcomes are cached per spec (a refused spec sent again
costs nothing), and a spec that several requests bring at once is compiled once: the others wait for
it. A compile may take up to a search's bound (search.py). Nearly all of that is `plan`, which needs
no model: a server runs it in a worker process (compile_worker.py), the rest in a worker thread,
never on its event loop (server/routes.py).

Why llguidance (measured in docs/benchmarks.md, `kstep bench structured --engines`): one wheel with
no dependencies (xgrammar pulls transformers, triton and a TVM runtime); it compiles a real-world
schema in 1.9 ms at the median with a 151,936-token vocabulary (xgrammar: 31 ms, 265 ms at the 95th
percentile: a compile is on the request path of every new schema); it refuses the schema features it
cannot enforce instead of approximating them; its masks (30 us median there, 3.5 ms at worst) are
slower than xgrammar's but stay under 6% of a 0.5B model's CPU decode step.

Two token tables per model: the model's own (the masks a sampler applies) and one of the 256 bytes
(the completion search walks bytes, whose masks are 257 bits wide). Compilation is bounded by
llguidance's fuel limits (a pathological regex or schema is refused with its error, never a stuck
slot). A JSON schema, and each tool's parameters, are first rewritten into equal ones where JSON
Schema allows it (schema.py); tool calls are built by tool_grammar.py."""
import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import llguidance

from kstep.structured.examples import FORMAT_EXAMPLES, example, schema_hints
from kstep.structured.json_keys import JsonKeys
from kstep.structured.schema import JSON_LAYOUT, prepare
from kstep.structured.search import MAX_CLOSING_BYTES, MAX_SEARCH_STEPS, closing_bytes, tokens_after
from kstep.structured.spec import StructuredSpec
from kstep.structured.tool_grammar import tool_grammar

KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "tools": "tools"}
CACHE_SIZE = 256           # compiled (or refused) specs kept per model
# llguidance's defaults, stated: lexer fuel bounds a compile (~50k units/ms: ~20 ms) and a mask (~14 ms)
PARSER_LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                          max_grammar_size=500_000)
BYTE_EOS = 256             # the byte table's end-of-sequence token


class _Bytes:
    """The byte table as llguidance's TokenizerWrapper reads it: token b is byte b, then an end token."""
    eos_token_id, bos_token_id = BYTE_EOS, None
    tokens = [bytes([b]) for b in range(256)] + [b"<|end|>"]
    special_token_ids = [BYTE_EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def byte_table() -> llguidance.LLTokenizer:
    """The byte table (one per process: it depends on no model)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


@functools.cache
def known_formats() -> frozenset[str]:
    """The JSON Schema formats this llguidance asserts (the others are annotations: schema.py)."""
    def known(name: str) -> bool:
        text = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "format": name})
        return not llguidance.LLMatcher(byte_table(), text, log_level=0).is_error()
    return frozenset(name for name in FORMAT_EXAMPLES if known(name))


@dataclass(slots=True)
class Grammar:
    """A compiled spec for one model: llguidance's grammar text, checked against both token tables.
    `start`: a completion from its start (bytes, and their tokens then the stop token), found once;
    `trigger`: the opening a free-text answer beside tool calls must not start with (matcher.py);
    `tracks_keys`: its JSON objects repeat no key (json_keys.py). `compile_seconds` is reported once
    (`take_compile_seconds`: the first request that uses it)."""
    text: str
    tokens: llguidance.LLTokenizer
    bytes: llguidance.LLTokenizer
    start: tuple[bytes, list[int]]
    compile_seconds: float
    hints: tuple[bytes, ...] = ()  # texts its free text must hold, for the completion search (examples.py)
    trigger: bytes | None = None
    tracks_keys: bool = False
    is_reported: bool = False

    def take_compile_seconds(self) -> float | None:
        """Its compile time the first time it is asked for (a request that compiled it), then None."""
        if self.is_reported:
            return None
        self.is_reported = True
        return self.compile_seconds

    def matcher(self, table: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(table, self.text, log_level=0, limits=PARSER_LIMITS)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a spec cannot be kept (cached like a grammar: the same spec is refused at once)."""
    reason: str


class GrammarCompiler:
    """One model's token table and its cache of compiled (or refused) specs, safe to use from several
    threads (module note)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, stop_ids: list[int],
                 planner: Callable[[StructuredSpec], "Plan | Refusal"] | None = None):
        self.planner = planner or plan
        self.tokens = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=list(stop_ids))
        self.bytes, self.stop_token = byte_table(), stop_ids[0]
        self.cache: OrderedDict[tuple[str, str], Grammar | Refusal] = OrderedDict()
        self._pending: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def compile(self, spec: StructuredSpec) -> Grammar:
        """The grammar of `spec` (cached); a ValueError naming spec.field when it is refused."""
        key = (spec.kind, spec.value)
        with self._lock:
            found = self.cache.get(key)
            if found is not None:
                self.cache.move_to_end(key)
            elif (pending := self._pending.get(key)) is None:
                pending = self._pending[key] = Future()
                is_mine = True
            else:
                is_mine = False
        if found is None and not is_mine:
            found = pending.result()  # another request is compiling it: its outcome is this one's
        elif found is None:
            try:
                found = self._build(spec)
            except BaseException as e:  # an internal failure: the waiting requests fail with it, nothing is cached
                with self._lock:
                    self._pending.pop(key)
                pending.set_exception(e)
                raise
            with self._lock:
                self.cache[key] = found
                self._pending.pop(key)
                if len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
            pending.set_result(found)
        if isinstance(found, Refusal):
            raise ValueError(f"{spec.field}: {found.reason}")
        return found

    def _build(self, spec: StructuredSpec) -> Grammar | Refusal:
        """The model's half of a compile, after `planner`'s (`plan`, or the same in a worker process:
        compile_worker.py): the grammar checked against the model's tokens, its start as tokens."""
        start = time.perf_counter()
        planned = self.planner(spec)
        if isinstance(planned, Refusal):
            return planned
        on_tokens = llguidance.LLMatcher(self.tokens, planned.text, log_level=0, limits=PARSER_LIMITS)
        if on_tokens.is_error():
            return Refusal(f"the {KIND_NAMES[spec.kind]} cannot be enforced: {_first_line(on_tokens.get_error())}")
        found = planned.start
        return Grammar(planned.text, self.tokens, self.bytes,
                       (found, tokens_after(self.tokens, on_tokens, found, self.stop_token)),
                       time.perf_counter() - start, planned.hints, planned.trigger, planned.tracks_keys)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a compile finds without the model: the grammar text, its trigger, hints and whether it
    tracks keys (Grammar's fields), and the completion from its start, as bytes."""
    text: str
    trigger: bytes | None
    hints: tuple[bytes, ...]
    tracks_keys: bool
    start: bytes


def plan(spec: StructuredSpec) -> Plan | Refusal:
    """The model-independent half of a compile, where nearly all of its time goes: the grammar text,
    checked against the byte table, and the completion search from its start (a hostile spec's cost,
    up to the search's bound). It needs no model, so a worker process can do it (compile_worker.py)."""
    what = KIND_NAMES[spec.kind]
    try:
        text, trigger, schemas = _grammar_text(spec)
    except ValueError as e:
        return Refusal(f"the {what} cannot be enforced: {e}")
    on_bytes = llguidance.LLMatcher(byte_table(), text, log_level=0, limits=PARSER_LIMITS)
    if on_bytes.is_error():
        return Refusal(f"the {what} cannot be enforced: {_first_line(on_bytes.get_error())}")
    hints = [h for schema in schemas for h in schema_hints(schema)] if schemas else \
        [found.encode()] if spec.kind == "regex" and (found := example(spec.value)) else []
    hints = tuple(dict.fromkeys(hints))
    tracks_keys = spec.kind in ("json", "tools")
    found = closing_bytes(on_bytes, hints, JsonKeys() if tracks_keys else None)
    if found is None:
        return Refusal(f"no output satisfies the {what}, or none the completion search reaches (it stops "
                       f"at {MAX_CLOSING_BYTES} bytes or {MAX_SEARCH_STEPS} steps): it cannot be kept")
    return Plan(text, trigger, hints, tracks_keys, found)


def _grammar_text(spec: StructuredSpec) -> tuple[str, bytes | None, list]:
    """llguidance's grammar for a spec, its trigger (tool_grammar.py) and the JSON schemas in it;
    a ValueError when the spec is malformed."""
    if spec.kind == "json":
        schema = prepare(json.loads(spec.value), known_formats())
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT), None, [schema]
    if spec.kind == "tools":
        lark, trigger, schemas = tool_grammar(json.loads(spec.value), lambda s: prepare(s, known_formats()))
        return llguidance.grammar_from("lark", lark), trigger, schemas
    if spec.kind == "choice":  # one terminal (a lexer automaton), not thousands of parser alternatives
        options = " | ".join(json.dumps(option) for option in json.loads(spec.value))
        return llguidance.grammar_from("lark", f"start: CHOICE\nCHOICE: {options}"), None, []
    return llguidance.grammar_from(spec.kind, spec.value), None, []


def _first_line(error: str) -> str:
    """llguidance's error without the grammar listing it appends (the request's own text)."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return " ".join(lines[:4])[:500]
