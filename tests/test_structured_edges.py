"""The ways real clients use structured outputs and tools, through a real `kstep serve` and the official
openai client, on an AR, a block-diffusion and a masked-diffusion model: tool parameters with `$ref`
(pydantic writes them for every nested model and Enum), a free-text answer beside tools cut as free
text is, JSON keys in the schema's order, `stop` where a grammar decides the end, no repeated keys,
thousands of choices, the schemas `true` and `false`, unsatisfiable specs named as such, earlier
calls whose arguments are not JSON, and OpenAI's include_usage chunk. Each of these failed once."""
import json

import httpx
import jsonschema
import pytest

from kstep.bench.server_process import running_server
from test_server import client

MODELS = ("ar", "block", "masked")
UNIT = {"type": "string", "enum": ["C", "F"]}
# what pydantic writes for `class Weather(BaseModel): city: City; unit: Unit; note: str | None = None`
PYDANTIC_PARAMETERS = {
    "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12,
                                                                 "format": "city-name"}},  # unknown: an annotation
                       "required": ["name"], "additionalProperties": False},
              "Unit": UNIT},
    "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}, "unit": {"$ref": "#/$defs/Unit"},
                                     "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
    "required": ["city", "unit", "note"], "additionalProperties": False}
RECURSIVE_PARAMETERS = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["name", "child"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": PYDANTIC_PARAMETERS}},
         {"type": "function", "function": {"name": "tree", "parameters": RECURSIVE_PARAMETERS}}]
FLAT_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
MESSAGES = [{"role": "user", "content": "The weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server("ar=default-ar", "--model", "block=default", "--model", "masked=llada-coder",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


def chat(server, **fields):
    return httpx.post(server + "/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, **fields},
                      timeout=120)


def streamed_calls(server, **fields) -> tuple[list[tuple[str, str]], str | None]:
    calls, reason = [], None
    for chunk in client(server).chat.completions.create(stream=True, messages=MESSAGES, temperature=0, **fields):
        for choice in chunk.choices:
            calls += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
            reason = choice.finish_reason or reason
    return calls, reason


@pytest.mark.parametrize("model", MODELS)
def test_tool_parameters_with_refs_resolve_against_the_parameters(server, model):
    for name, parameters in (("weather", PYDANTIC_PARAMETERS), ("tree", RECURSIVE_PARAMETERS)):
        fields = dict(model=model, tools=TOOLS, max_tokens=120, tool_choice={"type": "function",
                                                                              "function": {"name": name}})
        reply = client(server).chat.completions.create(messages=MESSAGES, temperature=0, **fields)
        [call] = reply.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, parameters)  # the function's own schema, $defs and "#" included
        assert list(arguments) == list(parameters["properties"])  # in the order the schema declares
        assert reply.choices[0].finish_reason == "tool_calls"
        assert streamed_calls(server, **fields) == ([(name, call.function.arguments)], "tool_calls")


@pytest.mark.parametrize("model", MODELS)
def test_a_text_answer_beside_tools_is_cut_as_free_text(server, model):
    """tool_choice "auto": a text answer is free text once it cannot open a call; at max_tokens it is
    cut ("length", every token the model's: on an AR model, exactly the text it writes with
    tool_choice "none"; a diffusion model decides its first token first, to know it is text)."""
    fields = dict(model=model, tools=FLAT_TOOLS, max_tokens=12, seed=1)
    auto = chat(server, tool_choice="auto", **fields).json()
    assert "tool_calls" not in auto["choices"][0]["message"] and auto["choices"][0]["message"]["content"]
    assert auto["choices"][0]["finish_reason"] == "length" and auto["usage"]["completion_tokens"] == 12
    if model == "ar":
        free = chat(server, tool_choice="none", **fields).json()
        assert auto["choices"][0]["message"]["content"] == free["choices"][0]["message"]["content"]
    streamed = "".join(c.choices[0].delta.content or "" for c in client(server).chat.completions.create(
        stream=True, messages=MESSAGES, temperature=0, tool_choice="auto", **fields) if c.choices)
    assert streamed == auto["choices"][0]["message"]["content"]
    # a stop string ends a text answer (a call, never: below)
    text = auto["choices"][0]["message"]["content"]
    stop = text[3:5]
    cut = chat(server, tool_choice="auto", stop=[stop], **fields).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == text[:text.index(stop)]


@pytest.mark.parametrize("model", MODELS)
def test_json_keys_come_in_the_schema_s_order(server, model):
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 16},
                                               "answer": {"type": "integer"}, "confidence": {"type": "number"}},
              "required": ["reasoning", "answer", "confidence"], "additionalProperties": False}
    reply = chat(server, model=model, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).json()
    assert list(json.loads(reply["choices"][0]["message"]["content"])) == ["reasoning", "answer", "confidence"]


def test_stop_where_a_grammar_decides_the_end_is_a_400_naming_it(server):
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    for fields in ({"response_format": schema}, {"tools": FLAT_TOOLS, "tool_choice": "required"},
                   {"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
                   {"structured_outputs": {"regex": "[a-z]+"}}):
        r = chat(server, model="ar", max_tokens=128, stop=["!"], **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.json()
    ok = chat(server, model="ar", max_tokens=128, tools=FLAT_TOOLS, tool_choice="required")  # and without stop, calls
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "tool_calls"


def _pairs(text: str) -> list[list]:
    """Every object's key list in a JSON text (a repeated key shows, which json.loads would hide)."""
    objects = []
    json.loads(text, object_pairs_hook=lambda pairs: objects.append([k for k, _ in pairs]) or dict(pairs))
    return objects


@pytest.mark.parametrize("model", MODELS)
def test_objects_never_repeat_a_key(server, model):
    schema = {"type": "object", "minProperties": 3, "additionalProperties": {"type": "string", "maxLength": 3}}
    for seed in range(3):
        reply = chat(server, model=model, max_tokens=60, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).json()
        text = reply["choices"][0]["message"]["content"]
        assert all(len(keys) == len(set(keys)) for keys in _pairs(text)), text
        jsonschema.validate(json.loads(text), schema)
        assert reply["choices"][0]["finish_reason"] == "stop"


def test_thousands_of_choices_and_the_schemas_true_and_false(server):
    options = [f"option {i}" for i in range(5000)]
    reply = chat(server, model="block", max_tokens=16, structured_outputs={"choice": options}).json()
    assert reply["choices"][0]["message"]["content"] in options
    anything = chat(server, model="ar", max_tokens=32, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": True}}).json()
    json.loads(anything["choices"][0]["message"]["content"])  # any JSON value
    nothing = chat(server, model="ar", max_tokens=32, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": False}})
    assert nothing.status_code == 400 and "unsatisfiable" in nothing.json()["error"]["message"]


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                                   "required": ["next"]}}}}}}, "response_format"),
    ({"structured_outputs": {"grammar": 'start: "a" start'}}, "structured_outputs"),
])
def test_an_unsatisfiable_spec_is_named_not_blamed_on_max_tokens(server, fields, param):
    r = chat(server, model="masked", max_tokens=4096, **fields)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and "max_tokens" not in error["message"], error
    again = chat(server, model="masked", max_tokens=4096, **fields)  # refused again, from the cache
    assert again.status_code == 400 and again.json()["error"]["message"] == error["message"]


def test_earlier_calls_whose_arguments_are_not_json_are_a_400_naming_them(server):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{a: 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    r = httpx.post(server + "/v1/chat/completions", json={"model": "ar", "messages": history, "tools": FLAT_TOOLS},
                   timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and "messages[1].tool_calls[0].function.arguments is not JSON" in error["message"]


def test_include_usage_adds_a_last_chunk_with_no_choices(server):
    chunks = list(client(server).chat.completions.create(
        model="ar", messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-2].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks[:-1])
