"""The request fields that ask for a structured output, as OpenAI and vLLM spell them, and the
StructuredSpec each becomes (kstep/structured):

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any
  JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
  kstep enforces the schema whether `strict` is true or not (OpenAI enforces it only when true).
- vLLM's `structured_outputs`: exactly one of `json` (a schema, or its JSON text), `regex`,
  `choice` (a list of strings), `grammar` (Lark, or llama.cpp's GBNF / EBNF), `json_object`;
  `disable_fallback` is accepted (kstep has one grammar engine and never falls back to free text);
  its fields that would change the output in ways kstep does not implement are refused by name.

Both on /v1/completions and /v1/chat/completions; one of the two per request. protocol.py declares
them (pydantic); this module reads them."""
from kstep.structured import StructuredSpec

REFUSED = ("disable_additional_properties", "whitespace_pattern", "structural_tag")
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_spec(response_format, structured_outputs) -> StructuredSpec | None:
    """The spec a request's fields ask for (None: free text); a ValueError naming the field otherwise."""
    if response_format is not None and response_format.type != "text" and structured_outputs is not None:
        raise ValueError("response_format and structured_outputs: give one structured output, not both")
    if structured_outputs is not None:
        return _from_structured_outputs(structured_outputs)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredSpec.json_object("response_format")
    if response_format.json_schema is None:
        raise ValueError("response_format: type json_schema needs its json_schema (name, schema)")
    if response_format.json_schema.schema_ is None:
        raise ValueError("response_format.json_schema.schema is required: the JSON schema the output must match")
    return StructuredSpec.json_schema(response_format.json_schema.schema_, "response_format")


def _from_structured_outputs(fields) -> StructuredSpec:
    for name in REFUSED:
        value = getattr(fields, name)
        if value not in (None, False):
            raise ValueError(f"structured_outputs.{name} is not supported by kstep")
    values = {kind: getattr(fields, "json_" if kind == "json" else kind) for kind in KINDS}
    given = [k for k in KINDS if values[k] not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)} (got "
                         f"{', '.join(given) or 'none'})")
    [kind] = given
    value, where = values[kind], f"structured_outputs.{kind}"
    if kind == "json_object":
        return StructuredSpec.json_object(where)
    if kind == "json":
        return StructuredSpec.json_schema(value, where)
    if kind == "choice":
        return StructuredSpec.choice(value, where)
    return StructuredSpec(kind, value, where)
