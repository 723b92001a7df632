"""What a request asks its output to be: a JSON schema, any JSON object, a regular expression, one of
several strings, or a grammar (Lark, or llama.cpp's GBNF / EBNF), as `StructuredSpec`. The edges
build it (the OpenAI `response_format`, vLLM's `structured_outputs`, `kstep generate --json-schema /
--regex / --choice / --grammar`, `GenerationParams(structured=...)`); grammar.py compiles it. Plain
Python: no torch, no grammar engine."""
import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """One constraint on a completion. `value`: the JSON schema as canonical JSON text (sorted keys,
    so equal schemas share a compiled grammar), the regex, the JSON list of choices, or the grammar's
    text. `field`: the request field that asked for it, named in every refusal."""
    kind: str
    value: str
    field: str = "structured"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.field}: {self.kind!r} is not a kind of structured output (choose from "
                             f"{', '.join(KINDS)})")
        if not isinstance(self.value, str) or not self.value.strip():
            raise ValueError(f"{self.field}: the {self.kind} is empty")

    @classmethod
    def json_schema(cls, schema: dict | bool | str, field: str = "structured") -> "StructuredSpec":
        """A JSON schema (a dict, or its JSON text); `True` or `{}` is any JSON value."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"{field}: the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{field}: a JSON schema is an object (or true), got {type(schema).__name__}")
        return cls("json", json.dumps(schema, sort_keys=True, separators=(",", ":")), field)

    @classmethod
    def json_object(cls, field: str = "response_format") -> "StructuredSpec":
        """OpenAI's JSON mode: any JSON object."""
        return cls.json_schema({"type": "object"}, field)

    @classmethod
    def choice(cls, options: list[str], field: str = "structured") -> "StructuredSpec":
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError(f"{field}: choice is a non-empty list of non-empty strings, got {options!r}")
        return cls("choice", json.dumps(options), field)

    def describe(self) -> str:
        """A short name for logs and usage: the kind and the first characters of its text."""
        text = self.value if len(self.value) <= 60 else self.value[:57] + "..."
        return f"{self.kind} {text}"
