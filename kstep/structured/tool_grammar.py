"""Tool calls as a grammar (a `StructuredSpec.tool_calls`), in the format of Hermes / Qwen2.5 chat
templates: `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`, several one per line when
the request allows parallel calls.

Each function is a rule of its own: the call's fixed text is literal grammar (its name included), and
its parameters are one `%json` root (llguidance's docs/toolcalls.md builds calls the same way). So a
`$ref` in them ("#/$defs/Unit", which pydantic writes for every nested model and Enum, or "#")
resolves against the parameters themselves, as the client that wrote them meant, and each schema
goes through the same preparation as a response_format's (schema.py).

"required" is calls only. "auto" is calls or an answer: free text that does not open a call, or the
response_format's JSON. A free-text answer is the spec's `trigger` case: once its text is no longer
a prefix of the call's opening, nothing constrains it (matcher.py releases the row), so it is cut by
max_tokens and stop strings as any free text is."""
import json
import re
from collections.abc import Callable
from typing import Any

from kstep.structured.schema import JSON_LAYOUT

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def _literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def _json_rule(name: str, schema: Any) -> str:
    return f"{name}: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"


def tool_grammar(tools: dict, prepare: Callable[[Any], Any]) -> tuple[str, bytes | None, list[Any]]:
    """The Lark grammar of a tools spec's JSON value (spec.py), with `prepare` applied to every
    schema in it; the trigger (module note: the opening a free-text answer must not start with, or
    None); and the prepared schemas (for the completion search's hints)."""
    rules, schemas = [], []
    for i, function in enumerate(tools["functions"]):
        parameters = prepare(function["parameters"])
        if not isinstance(parameters, dict):
            raise ValueError(f"the parameters of {function['name']!r} are not a JSON schema object")
        head = f'{CALL_OPEN}{{"name": {json.dumps(function["name"])}, "arguments": '
        rules += [f"call_{i}: {_literal(head)} arguments_{i} {_literal('}' + CALL_CLOSE)}",
                  _json_rule(f"arguments_{i}", parameters)]
        schemas.append(parameters)
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(tools["functions"])))
    calls = 'calls: call ("\\n" call)*' if tools["parallel"] else "calls: call"
    trigger = None
    if tools["choice"] == "required":
        start = "start: calls"
    elif tools["answer"] is None:
        start, trigger = "start: TEXT | calls", CALL_OPEN.encode()
        rules.append(f"TEXT: /(?s:.+)/ & ~/{re.escape(CALL_OPEN)}(?s:.*)/")
    else:
        answer = prepare(tools["answer"])
        start = "start: answer | calls"
        rules.append(_json_rule("answer", answer))
        schemas.append(answer)
    return "\n".join([start, calls, call, *rules]), trigger, schemas
