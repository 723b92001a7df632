"""`kstep bench structured --quality` (issue 46): the extraction set is well formed (every expected
object valid against its schema, 40+ cases), replies are parsed and scored field by field by exact
match, and a run with the schema enforced always parses, even on a tiny model."""
import json

from kstep.bench import extraction
from kstep.bench.structured import is_valid


def test_the_set_has_40_cases_each_expected_object_valid_against_its_schema():
    cases = extraction.load_cases()
    assert len(cases) >= 40 and len({c["id"] for c in cases}) == len(cases)
    assert {"person", "order", "date", "enum", "nested", "list", "tool", "boolean"} <= {c["kind"] for c in cases}
    for case in cases:
        assert is_valid(json.dumps(case["expected"]), case["schema"]), case["id"]


def test_replies_are_parsed_whole_fenced_or_embedded():
    assert extraction.parsed('{"a": 1}') == {"a": 1}
    assert extraction.parsed('Sure:\n```json\n{"a": 1}\n```') == {"a": 1}
    assert extraction.parsed('The answer is {"a": {"b": 2}} as asked.') == {"a": {"b": 2}}
    assert extraction.parsed("no json here") is None


def test_fields_are_scored_by_exact_match():
    expected = {"name": "Anna", "age": 34, "price": 4.5, "open": True, "address": {"city": "Paris"}, "tags": ["a", "b"]}
    assert extraction.fields_right(expected, expected) == 6
    got = {"name": "anna", "age": "34", "price": 4.5, "open": 1, "address": {"city": "Paris"}, "tags": ["a"]}
    assert extraction.fields_right(expected, got) == 2  # price and city; case, type and list differences count
    assert extraction.fields_right({"unit_price": 12.0}, {"unit_price": 12}) == 1  # a JSON number is a number
    assert extraction.fields_right(expected, None) == 0


def test_the_prompt_names_each_field_in_words():
    case = next(c for c in extraction.load_cases() if c["kind"] == "nested")
    assert "`address` (an object with the keys `city` (string), `country` (string))" in \
        extraction.messages(case)[0]["content"]


def test_a_run_with_the_schema_enforced_always_parses():
    result = extraction.measure("default-ar", 48, "cpu", "float32", None, limit=4)
    assert result["cases"] == 4
    assert result["constrained"]["parse_rate"] == 1.0 and result["constrained"]["valid_rate"] == 1.0
    assert "| constrained | 100% | 100% |" in extraction.format_table(result)
