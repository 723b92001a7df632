"""A JSON schema rewritten into an equal one the grammar engine can enforce, where JSON Schema
itself says the two accept the same values (no approximation: what kstep cannot enforce exactly,
it refuses):

- a `oneOf` whose branches declare pairwise disjoint `type`s becomes `anyOf`: a value has one JSON
  type, so at most one branch can hold ("integer" counts as a "number");
- a `format` the engine does not know is dropped: JSON Schema makes `format` an annotation unless a
  validator is told to assert it, and an unknown format cannot be asserted (grammar.py asks
  llguidance which formats it knows);
- the schema `true` is `{}`: any JSON value.
`prepare` does all of it, for a response_format's schema and for each tool's parameters alike.
Plain Python."""
from typing import Any

JSON_TYPES = ("null", "boolean", "object", "array", "number", "string")
# JSON as json.dumps writes it, no other whitespace: the layout is forced text (no pass spent on it,
# none wasted on runs of blanks), the values are the model's; a schema's "x-guidance" may change it
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def _types(branch: Any, root: dict) -> set[str] | None:
    """The JSON types a branch admits, when it declares them (a local $ref followed), else None."""
    seen = 0
    while isinstance(branch, dict) and "$ref" in branch and "type" not in branch and seen < 16:
        ref = branch["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return None
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        branch, seen = target, seen + 1
    if not isinstance(branch, dict):
        return None
    declared = branch.get("type")
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else None
    if types is None or not types <= set(JSON_TYPES) | {"integer"}:
        return None
    return {"number" if t == "integer" else t for t in types}


def _disjoint(branches: list, root: dict) -> bool:
    seen: set[str] = set()
    for branch in branches:
        types = _types(branch, root)
        if types is None or types & seen:
            return False
        seen |= types
    return True


def enforceable(schema: Any, root: dict | None = None) -> Any:
    """`schema` with every type-disjoint oneOf as anyOf (module note); the rest as it is."""
    root = schema if root is None and isinstance(schema, dict) else root
    if isinstance(schema, list):
        return [enforceable(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: enforceable(value, root) for key, value in schema.items()}
    if isinstance(out.get("oneOf"), list) and "anyOf" not in out and _disjoint(out["oneOf"], root):
        out["anyOf"] = out.pop("oneOf")
    return out


def without_unknown_formats(schema: Any, known: frozenset[str]) -> Any:
    """`schema` with every `"format"` not in `known` removed (an unknown format is an annotation)."""
    if isinstance(schema, list):
        return [without_unknown_formats(item, known) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: without_unknown_formats(value, known) for key, value in schema.items()
            if not (key == "format" and isinstance(value, str) and value not in known)}


def prepare(schema: Any, known_formats: frozenset[str]) -> Any:
    """The schema the engine compiles in place of `schema` (module note)."""
    return without_unknown_formats(enforceable({} if schema is True else schema), known_formats)
