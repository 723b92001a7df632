"""A model's structured outputs: its grammar engine (grammar.py, made at the first structured
request: the token tables take 10 ms to a second), the admission check of a request's spec, and
each decoder batch's constraint (constraint.py)."""
import threading
from pathlib import Path

from kstep.structured.constraint import Constraint
from kstep.structured.grammar import Grammar, GrammarCompiler
from kstep.structured.spec import StructuredSpec


class ModelGrammar:
    def __init__(self, tokenizer_json: Path | None, vocab_size: int, stop_ids: list[int], mask_id: int | None):
        self.tokenizer_json, self.vocab_size, self.stop_ids, self.mask_id = tokenizer_json, vocab_size, stop_ids, mask_id
        self._compiler: GrammarCompiler | None = None
        self.planner = None  # where a compile's model-independent half runs (None: here; a server's: compile_worker.py)
        self._lock = threading.Lock()  # compiles may run in several threads: one makes the tables

    def compile(self, spec: StructuredSpec) -> Grammar:
        """The spec's grammar (compiled once, cached); a ValueError naming spec.field when refused."""
        with self._lock:
            if self._compiler is None:
                if self.tokenizer_json is None:
                    raise ValueError(f"{spec.field}: a structured output needs the checkpoint's tokenizer.json")
                self._compiler = GrammarCompiler(self.tokenizer_json, self.vocab_size, self.stop_ids, self.planner)
        return self._compiler.compile(spec)

    def check(self, spec: StructuredSpec, max_tokens: int) -> Grammar:
        """The spec's grammar, once it is known to fit: a ValueError unless a completion of it, with
        its end-of-sequence token, fits max_tokens (the row can then always finish with "stop":
        constraint.py). A free-text answer beside tool calls fits any room (matcher.py)."""
        grammar = self.compile(spec)
        cost = len(grammar.start[1])
        if grammar.trigger is None and cost > max_tokens:
            raise ValueError(f"max_tokens ({max_tokens}) is too small for the {spec.field}: the shortest completion "
                             f"found takes {cost} tokens (its end-of-sequence token included)")
        return grammar

    def constraint(self, grammar: Grammar, num_rows: int, max_tokens: int) -> Constraint:
        """The constraint a decoder batch of `num_rows` keeps under `grammar` (one matcher per row)."""
        return Constraint(grammar, num_rows, max_tokens, self.stop_ids, self.vocab_size, self.mask_id)
