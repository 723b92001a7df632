"""What a request asks its output to be: a JSON schema, any JSON object, a regular expression, one of
several strings, a grammar (Lark, or llama.cpp's GBNF / EBNF), or calls of the tools it offers, as
`StructuredSpec`. The edges build it (the OpenAI `response_format` and `tools`, vLLM's
`structured_outputs`, `kstep generate --json-schema / --regex / --choice / --grammar`,
`GenerationParams(structured=...)`); grammar.py compiles it. Plain Python: no torch, no grammar engine."""
import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "tools")
TOOL_CHOICES = ("auto", "required")  # "auto": text (or the answer's JSON) or calls; "required": calls


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """One constraint on a completion. `value`: the JSON schema as compact JSON text (its keys in the
    order given: an object's properties are written in the order the schema declares them, as OpenAI
    and vLLM do), the regex, the JSON list of choices, the grammar's text, or the tools' JSON
    (`tool_calls`). `field`: the request field that asked for it, named in every refusal."""
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
        """A JSON schema (a dict, or its JSON text); `True` or `{}` is any JSON value, `False` none
        (refused: nothing could be written)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"{field}: the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{field}: a JSON schema is an object (or true), got {type(schema).__name__}")
        if schema is False:
            raise ValueError(f"{field}: the JSON schema is false, which no value satisfies (unsatisfiable)")
        return cls("json", _compact({} if schema is True else schema), field)

    @classmethod
    def json_object(cls, field: str = "response_format") -> "StructuredSpec":
        """OpenAI's JSON mode: any JSON object."""
        return cls.json_schema({"type": "object"}, field)

    @classmethod
    def choice(cls, options: list[str], field: str = "structured") -> "StructuredSpec":
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError(f"{field}: choice is a non-empty list of non-empty strings, got {options!r}")
        return cls("choice", json.dumps(options), field)

    @classmethod
    def tool_calls(cls, functions: list[tuple[str, dict]], choice: str, parallel: bool,
                   answer: "StructuredSpec | None" = None, field: str = "tools") -> "StructuredSpec":
        """Calls of `functions` ((name, parameters schema) each), written as structured/tool_grammar.py
        says: `choice` "required" (calls only) or "auto" (calls, or else free text, or else the
        `answer` spec's JSON when one is given); `parallel`: several calls, one per line."""
        if choice not in TOOL_CHOICES:
            raise ValueError(f"{field}: tool choice {choice!r} is not one of {', '.join(TOOL_CHOICES)}")
        if not functions:
            raise ValueError(f"{field}: no function to call")
        if answer is not None and answer.kind != "json":
            raise ValueError(f"{answer.field}: with tools, an answer can only be a JSON schema's")
        return cls("tools", _compact({"functions": [{"name": name, "parameters": parameters}
                                                    for name, parameters in functions],
                                      "choice": choice, "parallel": parallel,
                                      "answer": None if answer is None else json.loads(answer.value)}), field)

    def describe(self) -> str:
        """A short name for logs and usage: the kind and the first characters of its text."""
        text = self.value if len(self.value) <= 60 else self.value[:57] + "..."
        return f"{self.kind} {text}"


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))
