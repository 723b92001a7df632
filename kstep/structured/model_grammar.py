"""A model's structured outputs: its grammar engine (grammar.py, made at the first structured
request: the token tables take 10 ms to a second), the admission check of a request's spec, and
each decoder batch's constraint (constraint.py)."""
from pathlib import Path

from kstep.structured.constraint import Constraint
from kstep.structured.grammar import Grammar, GrammarCompiler
from kstep.structured.matcher import RowMatcher
from kstep.structured.spec import StructuredSpec


class ModelGrammar:
    def __init__(self, tokenizer_json: Path | None, vocab_size: int, stop_ids: list[int], mask_id: int | None):
        self.tokenizer_json, self.vocab_size, self.stop_ids, self.mask_id = tokenizer_json, vocab_size, stop_ids, mask_id
        self._compiler: GrammarCompiler | None = None

    def compile(self, spec: StructuredSpec) -> Grammar:
        if self._compiler is None:
            if self.tokenizer_json is None:
                raise ValueError(f"{spec.field}: a structured output needs the checkpoint's tokenizer.json")
            self._compiler = GrammarCompiler(self.tokenizer_json, self.vocab_size, self.stop_ids)
        return self._compiler.compile(spec)

    def check(self, spec: StructuredSpec, max_tokens: int) -> None:
        """A ValueError unless the spec compiles and a completion of it, with its end-of-sequence token,
        fits max_tokens (the row can then always finish with "stop": constraint.py)."""
        cost = RowMatcher(self.compile(spec), self.stop_ids, self.vocab_size).cost()
        if cost is None or cost > max_tokens:
            found = "no completion was found" if cost is None else f"the shortest completion found takes {cost} tokens"
            raise ValueError(f"max_tokens ({max_tokens}) is too small for the {spec.field}: {found} (its "
                             "end-of-sequence token included)")

    def constraint(self, spec: StructuredSpec, num_rows: int, max_tokens: int) -> Constraint:
        """The constraint a decoder batch of `num_rows` keeps (one matcher per row)."""
        return Constraint(self.compile(spec), num_rows, max_tokens, self.stop_ids, self.vocab_size, self.mask_id)
