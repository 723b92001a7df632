"""Tool calls in chat, as OpenAI spells them (`tools`, `tool_choice`, `parallel_tool_calls`; the
reply's `message.tool_calls`, `finish_reason: "tool_calls"`), kept by a grammar like any structured
output (kstep/structured/tool_grammar.py builds it), so every call's arguments validate against its
function's `parameters`.

The model writes a call as `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` (the format of
Hermes / Qwen2.5 templates), several separated by a newline when `parallel_tool_calls` allows them.
`tool_choice`: "none" leaves the output free (the tools are still shown to the model, as OpenAI
does); "auto" lets it answer with text (free text: cut by max_tokens and stop strings as any) or
the response_format's JSON, or with calls; "required" and a named function make it call (the named
one, once). The prompt: a chat template that renders
tools gets them (`tools`, messages with `tool_calls` and role "tool", as transformers passes them);
one that does not gets kstep's default, a system message listing the functions and the format, the
assistant's earlier calls written in that format and each tool result as
`<tool_response>...</tool_response>`."""
import json
import uuid

from kstep.structured import StructuredSpec
from kstep.structured.tool_grammar import CALL_CLOSE, CALL_OPEN

DEFAULT_SYSTEM = ("You can call functions. To call one, answer with {open}{{\"name\": <function name>, "
                  "\"arguments\": <its arguments as a JSON object>}}{close}{parallel}. The functions:\n{functions}")


def _parameters(function: dict) -> dict:
    """A function's parameters schema; none given is an empty parameter list (OpenAI)."""
    return function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def tool_spec(tools: list[dict], choice, parallel: bool, text: StructuredSpec | None) -> StructuredSpec | None:
    """The structured output a chat request's tools ask for (None with tool_choice "none": its own
    format, if any): `choice` is "auto", "required" or a function's name; `text`, the
    response_format an "auto" answer keeps."""
    if choice == "none":
        return text
    functions = [(t["function"]["name"], _parameters(t["function"])) for t in tools
                 if choice in ("auto", "required") or t["function"]["name"] == choice]
    if not functions:
        raise ValueError(f"tool_choice: no tool named {choice!r} (the tools are "
                         f"{', '.join(repr(t['function']['name']) for t in tools)})")
    is_named = choice not in ("auto", "required")
    return StructuredSpec.tool_calls(functions, "required" if is_named else choice, parallel and not is_named,
                                     text if choice == "auto" else None)


def prompt_messages(messages: list[dict], tools: list[dict] | None, template: str) -> tuple[list[dict], list | None]:
    """The messages and tools a chat template renders: as they are where it renders tools, else with
    kstep's default (module note) written into the messages. OpenAI's "developer" role is "system"
    to a template that does not know it (the Responses API sends it often)."""
    if "developer" not in template:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    if "tool" in template:  # it renders them itself (transformers' convention: arguments as objects)
        out = []
        for i, m in enumerate(messages):
            calls = m.get("tool_calls")
            if calls:
                m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(i, j, c)}}
                                         for j, c in enumerate(calls)]}
            out.append(m)
        return out, tools
    out = []
    if tools:
        functions = "\n".join(json.dumps(t["function"]) for t in tools)
        out.append({"role": "system", "content": DEFAULT_SYSTEM.format(
            open=CALL_OPEN, close=CALL_CLOSE, parallel=" (several: one per line)", functions=functions)})
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            text = "\n".join(f'{CALL_OPEN}{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                             f'{json.dumps(_arguments(i, j, c))}}}{CALL_CLOSE}' for j, c in enumerate(m["tool_calls"]))
            m = {"role": "assistant", "content": (m.get("content") or "") + text}
        elif m["role"] == "tool":
            m = {"role": "tool", "content": f"<tool_response>{m.get('content') or ''}</tool_response>"}
        out.append({"role": m["role"], "content": m.get("content") or ""})
    return out, None


def _arguments(message: int, call: int, tool_call: dict) -> object:
    """An earlier call's arguments (JSON text, as OpenAI sends them) as the value they hold."""
    try:
        return json.loads(tool_call["function"]["arguments"])
    except json.JSONDecodeError as e:
        raise ValueError(f"messages[{message}].tool_calls[{call}].function.arguments is not JSON ({e}): a call's "
                         "arguments are a JSON object's text") from None


def parse_tool_calls(text: str) -> list[dict] | None:
    """The calls a completion holds (OpenAI's shape), or None when it is text (a text answer never
    starts with a call's opening: the grammar keeps it so; a call cut short by a server limit is text)."""
    calls, at, decoder = [], 0, json.JSONDecoder()
    while text.startswith(CALL_OPEN, at):
        try:
            call, at = decoder.raw_decode(text, at + len(CALL_OPEN))
        except json.JSONDecodeError:
            return None
        if not text.startswith(CALL_CLOSE, at) or not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            return None
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
        at += len(CALL_CLOSE) + text.startswith("\n", at + len(CALL_CLOSE))
    return calls if calls and at == len(text) else None


def may_be_call(text: str) -> bool:
    """Whether a streamed completion's text so far may still open a call (hold it back until known)."""
    return CALL_OPEN.startswith(text) or text.startswith(CALL_OPEN)
