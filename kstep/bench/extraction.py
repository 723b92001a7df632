"""`kstep bench structured --quality`: how well a model takes what a text says into JSON, with the schema
enforced (a structured output) and without it (the same chat prompt; the JSON taken from the reply):
kstep's extraction set (bench/data/extraction_set.json: 50 short texts, each with the schema of what
to take from it and the object expected: names, numbers, dates, enums, nested objects, lists, tool
arguments, booleans), every expected field scored by exact match. Greedy, one request at a time."""
import json
from pathlib import Path

import kstep
from kstep.bench.structured import is_valid
from kstep.structured import StructuredSpec

SET = Path(__file__).with_name("data") / "extraction_set.json"


def load_cases(limit: int | None = None) -> list[dict]:
    cases = json.loads(SET.read_text())["cases"]
    return cases if limit is None else cases[::max(1, len(cases) // limit)][:limit]


def messages(case: dict) -> list[dict]:
    """The request, the schema's fields in words (a small model given the schema itself tends to echo it)."""
    return [{"role": "user", "content": f"Text: {case['text']}\n\nExtract from the text a JSON object with the "
             f"keys {describe(case['schema'])}. Answer with the JSON object only."}]


def describe(schema: dict) -> str:
    """`name` (string), `age` (integer), `address` (an object with the keys `city` (string), ...)."""
    words = []
    for key, field in schema["properties"].items():
        kind = field.get("type")
        what = (f"one of {', '.join(field['enum'])}" if "enum" in field else
                f"an object with the keys {describe(field)}" if kind == "object" else
                f"a list of {field['items']['type']}s" if kind == "array" else
                "a date, YYYY-MM-DD" if field.get("format") == "date" else kind)
        words.append(f"`{key}` ({what})")
    return ", ".join(words)


def parsed(text: str):
    """The reply's JSON: the whole text, else inside a ``` fence, else its first balanced {...}; None if none."""
    candidates = [text.strip()]
    if "```" in text:
        candidates.append(text.split("```")[1].removeprefix("json").strip())
    start = text.find("{")
    if start >= 0:
        depth = 0
        for end, char in enumerate(text[start:], start):
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0:
                candidates.append(text[start:end + 1])
                break
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None


def leaves(value, prefix: str = "") -> dict:
    """Each field's path and value (nested objects walked; a list is one field, compared whole)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out = {}
    for key, item in value.items():
        out.update(leaves(item, f"{prefix}.{key}" if prefix else key))
    return out


def fields_right(expected: dict, got) -> int:
    """How many of the expected fields the reply holds exactly (a bool is not a number, 34 is not "34")."""
    have = leaves(got) if isinstance(got, dict) else {}
    return sum(path in have and type(have[path]) is type(want) and have[path] == want or
               (path in have and isinstance(want, float) and type(have[path]) in (int, float) and have[path] == want)
               for path, want in leaves(expected).items())


def run_case(llm: kstep.LLM, case: dict, max_tokens: int) -> dict:
    prompt = llm.chat_prompt(messages(case))
    spec = StructuredSpec.json_schema(case["schema"], "response_format")
    row = {"id": case["id"], "kind": case["kind"], "fields": len(leaves(case["expected"]))}
    for mode, extra in (("constrained", {"structured": spec}), ("free", {})):
        [out] = llm.generate([prompt], max_tokens=max_tokens, temperature=0.0, **extra)
        value = parsed(out.text)
        row[mode] = {"text": out.text, "parses": value is not None,
                     "valid": value is not None and is_valid(json.dumps(value), case["schema"]),
                     "right": fields_right(case["expected"], value)}
    return row


def measure(model: str, max_tokens: int, device: str, dtype: str, quantize: str | None, limit: int | None = None,
            progress=None) -> dict:
    llm = kstep.load(model, device=device, dtype=dtype, quantize=quantize)
    rows = []
    for case in load_cases(limit):
        rows.append(run_case(llm, case, max_tokens))
        if progress:
            progress(f"{case['id']}: constrained {rows[-1]['constrained']['right']}/{rows[-1]['fields']}, "
                     f"free {rows[-1]['free']['right']}/{rows[-1]['fields']}")
    fields = sum(r["fields"] for r in rows)
    summary = {mode: {"parse_rate": sum(r[mode]["parses"] for r in rows) / len(rows),
                      "valid_rate": sum(r[mode]["valid"] for r in rows) / len(rows),
                      "field_accuracy": sum(r[mode]["right"] for r in rows) / fields,
                      "by_kind": {kind: sum(r[mode]["right"] for r in rows if r["kind"] == kind) /
                                  sum(r["fields"] for r in rows if r["kind"] == kind)
                                  for kind in dict.fromkeys(r["kind"] for r in rows)}}
               for mode in ("constrained", "free")}
    return {"model": model, "quantize": quantize, "dtype": dtype, "max_tokens": max_tokens, "cases": len(rows),
            "fields": fields, **summary, "rows": rows}


def format_table(result: dict) -> str:
    kinds = list(result["constrained"]["by_kind"])
    head = ("| mode | parses | valid (schema) | field accuracy | " + " | ".join(kinds) + " |\n"
            "|---|---:|---:|---:|" + "---:|" * len(kinds))
    lines = [f"| {mode} | {r['parse_rate']:.0%} | {r['valid_rate']:.0%} | **{r['field_accuracy']:.0%}** | "
             + " | ".join(f"{r['by_kind'][k]:.0%}" for k in kinds) + " |"
             for mode, r in (("constrained", result["constrained"]), ("unconstrained", result["free"]))]
    return "\n".join([head, *lines])
