"""Tool calls in chat, as OpenAI spells them (`tools`, `tool_choice`, `parallel_tool_calls`; the
reply's `message.tool_calls`, `finish_reason: "tool_calls"`), kept by a grammar like any structured
output (kstep/structured), so every call's arguments validate against its function's `parameters`.

The model writes a call as `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` (the format of
Hermes / Qwen2.5 templates), several separated by a newline when `parallel_tool_calls` allows them.
`tool_choice`: "none" leaves the output free (the tools are still shown to the model, as OpenAI
does); "auto" lets it answer with text (or the response_format's JSON) or with calls; "required"
and a named function make it call (the named one, once). The prompt: a chat template that renders
tools gets them (`tools`, messages with `tool_calls` and role "tool", as transformers passes them);
one that does not gets kstep's default, a system message listing the functions and the format, the
assistant's earlier calls written in that format and each tool result as
`<tool_response>...</tool_response>`."""
import json
import re
import uuid

from kstep.structured import StructuredSpec
from kstep.structured.grammar import JSON_LAYOUT

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)
DEFAULT_SYSTEM = ("You can call functions. To call one, answer with {open}{{\"name\": <function name>, "
                  "\"arguments\": <its arguments as a JSON object>}}{close}{parallel}. The functions:\n{functions}")


def _parameters(function: dict) -> dict:
    """A function's parameters schema; none given is an empty parameter list (OpenAI)."""
    return function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def tool_spec(tools: list[dict], choice, parallel: bool, text: StructuredSpec | None) -> StructuredSpec | None:
    """The grammar a chat request's tools ask for (None with tool_choice "none"): `choice` is
    "auto", "required" or a function's name; `text`, the response_format an "auto" answer keeps."""
    if choice == "none":
        return text
    functions = [t["function"] for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    if not functions:
        raise ValueError(f"tool_choice: no tool named {choice!r} (the tools are "
                         f"{', '.join(repr(t['function']['name']) for t in tools)})")
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                       "required": ["name", "arguments"], "additionalProperties": False} for f in functions],
            "x-guidance": JSON_LAYOUT}
    calls = "call" if not parallel or choice not in ("auto", "required") else 'call ("\\n" call)*'
    rules = [f"calls: {calls}", f'call: "{CALL_OPEN}" arguments "{CALL_CLOSE}"', f"arguments: %json {json.dumps(call)}"]
    if choice != "auto":
        start = "start: calls"
    elif text is None:  # free text that does not open a call, or calls
        start = "start: TEXT | calls"
        rules.append(f"TEXT: /(?s:.+)/ & ~/{re.escape(CALL_OPEN)}(?s:.*)/")
    elif text.kind == "json":  # the response_format's JSON, or calls
        schema = {**json.loads(text.value), "x-guidance": JSON_LAYOUT}
        start = "start: answer | calls"
        rules.append(f"answer: %json {json.dumps(schema)}")
    else:
        raise ValueError(f"{text.field}: with tools, an answer can only be a JSON schema's")
    return StructuredSpec("grammar", "\n".join([start, *rules]), "tools")


def prompt_messages(messages: list[dict], tools: list[dict] | None, template: str) -> tuple[list[dict], list | None]:
    """The messages and tools a chat template renders: as they are where it renders tools, else with
    kstep's default (module note) written into the messages."""
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    if "tool" in template:  # it renders them itself (transformers' convention: arguments as objects)
        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if calls:
                m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                            "arguments": json.loads(c["function"]["arguments"])}}
                                         for c in calls]}
            out.append(m)
        return out, tools
    out = []
    if tools:
        functions = "\n".join(json.dumps(t["function"]) for t in tools)
        out.append({"role": "system", "content": DEFAULT_SYSTEM.format(
            open=CALL_OPEN, close=CALL_CLOSE, parallel=" (several: one per line)", functions=functions)})
    for m in messages:
        if m.get("tool_calls"):
            text = "\n".join(f'{CALL_OPEN}{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                             f'{c["function"]["arguments"]}}}{CALL_CLOSE}' for c in m["tool_calls"])
            m = {"role": "assistant", "content": (m.get("content") or "") + text}
        elif m["role"] == "tool":
            m = {"role": "tool", "content": f"<tool_response>{m.get('content') or ''}</tool_response>"}
        out.append({"role": m["role"], "content": m.get("content") or ""})
    return out, None


def parse_tool_calls(text: str) -> list[dict] | None:
    """The calls a completion holds (OpenAI's shape), or None when it is text."""
    if not text.startswith(CALL_OPEN):
        return None
    calls = []
    for found in CALL.finditer(text):
        call = json.loads(found.group(1))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
    return calls


def may_be_call(text: str) -> bool:
    """Whether a streamed completion's text so far may still open a call (hold it back until known)."""
    return CALL_OPEN.startswith(text) or text.startswith(CALL_OPEN)
