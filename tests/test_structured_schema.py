"""The JSON-schema rewrites that keep a schema's meaning (kstep/structured/schema.py): a oneOf of
type-disjoint branches is an anyOf, an unknown format an annotation; anything else is refused."""
import json

import jsonschema
import pytest

import kstep
from kstep.random_checkpoint import write_random_checkpoint
from kstep.structured import StructuredSpec
from kstep.structured.schema import enforceable, prepare, without_unknown_formats


def test_only_type_disjoint_one_ofs_become_any_ofs():
    disjoint = {"oneOf": [{"type": ["string", "null"]}, {"$ref": "#/$defs/obj"}], "$defs": {"obj": {"type": "object"}}}
    assert "anyOf" in enforceable(disjoint) and "oneOf" not in enforceable(disjoint)
    for overlapping in ({"oneOf": [{"type": "integer"}, {"type": "number"}]},
                        {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
                        {"oneOf": [{"type": "string"}, {"$ref": "https://example.com/s.json"}]}):
        assert enforceable(overlapping) == overlapping
    nested = {"properties": {"x": {"oneOf": [{"type": "string"}, {"type": "boolean"}]}}}
    assert enforceable(nested) == {"properties": {"x": {"anyOf": [{"type": "string"}, {"type": "boolean"}]}}}
    assert without_unknown_formats({"type": "string", "format": "semver", "properties": {"format": {"type": "string"}},
                                    "items": {"format": "date"}}, frozenset({"date"})) == \
        {"type": "string", "properties": {"format": {"type": "string"}}, "items": {"format": "date"}}
    assert prepare(True, frozenset()) == {}


def test_rewritten_schemas_compile_and_their_outputs_validate_against_the_original(tmp_path):
    llm = kstep.load(write_random_checkpoint(tmp_path, family="llama", seed=5))
    schema = {"type": "object", "properties": {
        "id": {"oneOf": [{"type": "string", "format": "non-blank"}, {"type": "integer"}]},
        "tags": {"type": "array", "items": {"type": "string", "format": "semver"}, "maxItems": 2}},
        "required": ["id", "tags"], "additionalProperties": False}
    for temperature in (0, 1.0):
        [r] = llm.generate("x", max_tokens=96, structured=StructuredSpec.json_schema(schema), temperature=temperature,
                           seed=3)
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), schema)  # the original, oneOf included
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    with pytest.raises(ValueError, match="oneOf constraints are not supported"):
        llm.generate("x", max_tokens=16, structured=StructuredSpec.json_schema(overlapping))


@pytest.mark.parametrize("pattern,matches", [
    (r"\d+\.\d+\.\d+-?.*", True), (r"^[0-9a-f]{8}-[0-9a-f]{4}-[1-5][0-9a-f]{3}$", True),
    (r"[a-z]+@[a-z]+\.(com|org)", True), (r"[^\"]+", True), (r"\w{3,}", True), (r"^\S+$", True),
    (r"(a)\1", None), (r"^(?!x)a", None)])
def test_a_pattern_s_shortest_example_matches_it(pattern, matches):
    from kstep.structured.examples import example
    found = example(pattern)
    if matches is None:
        assert found is None  # not followed: no hint, the search goes on without one
    else:
        assert found is not None and __import__("re").search(pattern, found), (pattern, found)


def test_strings_that_must_hold_a_pattern_still_get_a_completion(tmp_path):
    """An unanchored pattern shows no progress byte by byte: without its example, no completion was
    found, and the request was refused."""
    llm = kstep.load(write_random_checkpoint(tmp_path, family="llada", seed=5))
    schema = {"type": "object", "properties": {"version": {"type": "string", "pattern": r"\d+\.\d+\.\d+-?.*"},
                                               "at": {"type": "string", "format": "date-time"}},
              "required": ["version", "at"], "additionalProperties": False}
    [r] = llm.generate("x", max_tokens=64, structured=StructuredSpec.json_schema(schema))
    assert r.finish_reason == "stop"
    value = json.loads(r.text)
    jsonschema.validate(value, schema)  # the pattern
    rfc3339 = r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})"
    assert __import__("re").fullmatch(rfc3339, value["at"]), value  # and the format (RFC 3339's syntax)
