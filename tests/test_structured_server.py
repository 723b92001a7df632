"""Structured outputs through a real `kstep serve` and the official openai client: OpenAI's
`response_format` and vLLM's `structured_outputs` on both endpoints, on an AR, a masked-diffusion
and a block-diffusion model served together; every output validates, streamed equals not streamed,
concurrent constrained and free requests get what each gets alone, and what kstep cannot honour is
a 400 naming the field while the server goes on."""
import asyncio
import json
import re

import httpx
import jsonschema
import pytest

from kstep.bench.server_process import running_server
from kstep.random_checkpoint import write_random_checkpoint
from conftest import ar_masked_block_models
from test_server import client

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "temperature": {"type": "number"}, "unit": {"enum": ["C", "F"]}},
          "required": ["city", "temperature", "unit"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "The weather in Paris?"}]
MODELS = ("ar", "masked", "block")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(*ar_masked_block_models(tmp_path_factory),
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_chat_streamed_equals_not_streamed_and_validates(server, model):
    for temperature in (0, 1.0):
        r = client(server).chat.completions.create(model=model, messages=MESSAGES, max_tokens=80, seed=4,
                                                   temperature=temperature, response_format=RESPONSE_FORMAT)
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        chunks = client(server).chat.completions.create(model=model, messages=MESSAGES, max_tokens=80, seed=4,
                                                        temperature=temperature, response_format=RESPONSE_FORMAT,
                                                        stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.parametrize("model", MODELS)
def test_structured_outputs_on_completions(server, model):
    c = client(server)
    for fields, check in [({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
                          ({"regex": r"[A-Z][a-z]{1,6} \d{2}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{1,6} \d{2}", t)),
                          ({"choice": ["sunny", "rainy", "cloudy"]}, lambda t: t in ("sunny", "rainy", "cloudy")),
                          ({"grammar": 'start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]/'},
                           lambda t: re.fullmatch(r"\[\d(,\d)*\]", t)),
                          ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]:
        r = c.completions.create(model=model, prompt="Weather:", max_tokens=64, temperature=0,
                                 extra_body={"structured_outputs": fields})
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), (fields, r.choices[0].text)
    r = c.completions.create(model=model, prompt="Weather:", max_tokens=64, temperature=0,
                             extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_concurrent_constrained_and_free_requests_get_what_each_gets_alone(server):
    bodies = [{"model": m, "prompt": p, "max_tokens": 48, "temperature": 0, **extra}
              for m in MODELS for p, extra in (("a", {"response_format": RESPONSE_FORMAT}), ("b", {}),
                                               ("c", {"structured_outputs": {"choice": ["x", "yy"]}}))]
    alone = [httpx.post(server + "/v1/completions", json=b, timeout=60).json()["choices"][0]["text"] for b in bodies]

    async def together():
        async with httpx.AsyncClient(timeout=60) as h:
            return await asyncio.gather(*(h.post(server + "/v1/completions", json=b) for b in bodies))
    assert [r.json()["choices"][0]["text"] for r in asyncio.run(together())] == alone


@pytest.mark.parametrize("extra,param,says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}}, "response_format",
     "json_schema.schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "string",
                                                                                          "pattern": "(["}}}},
     "response_format", "the JSON schema cannot be enforced"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format",
     "give one structured output, not both"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs", "structural_tag is not supported"),
    ({"structured_outputs": {"regx": "a"}}, "structured_outputs", "did you mean 'regex'?"),
    ({"response_format": {"type": "json_object"}, "max_tokens": 1}, "max_tokens", "too small for the response_format"),
    ({"response_format": {"type": "json_object"}, "draft": "self"}, "response_format", "not kept with draft 'self'"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ends where its grammar does"),
])
def test_what_kstep_cannot_honour_is_a_400_naming_the_field(server, extra, param, says):
    r = httpx.post(server + "/v1/chat/completions", json={"model": "masked", "messages": MESSAGES, "max_tokens": 32,
                                                           "temperature": 0, **extra}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], error
    ok = client(server).chat.completions.create(model="masked", messages=MESSAGES, max_tokens=80, temperature=0,
                                                response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(ok.choices[0].message.content), SCHEMA)  # and the server goes on


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "now"}}]  # no parameters: an empty list
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
              for t in TOOLS}


def calls_and_text(server, model, stream=False, **fields):
    """(tool calls as (name, arguments text), content, finish_reason) of a chat reply, streamed or not."""
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=96, temperature=0, **fields)
    if not stream:
        choice = client(server).chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments, c.id) for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    calls, text, reason = [], "", None
    for chunk in client(server).chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            calls += [(c.function.name, c.function.arguments, c.id) for c in choice.delta.tool_calls or []]
            reason = choice.finish_reason or reason
    return calls, text or None, reason


@pytest.mark.parametrize("model", MODELS)
def test_tool_calls_validate_and_stream_as_they_answer(server, model):
    named = {"type": "function", "function": {"name": "add"}}
    for choice, allowed in (("required", set(PARAMETERS)), (named, {"add"})):
        calls, text, reason = calls_and_text(server, model, tool_choice=choice)
        assert calls and text is None and reason == "tool_calls", (choice, calls, text)
        for name, arguments, call_id in calls:
            assert name in allowed and call_id.startswith("call_")
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])
        streamed, streamed_text, streamed_reason = calls_and_text(server, model, stream=True, tool_choice=choice)
        assert [c[:2] for c in streamed] == [c[:2] for c in calls] and streamed_reason == "tool_calls"
        if choice == named:
            assert len(calls) == 1
    one, _, _ = calls_and_text(server, model, tool_choice="required", parallel_tool_calls=False)
    assert len(one) == 1
    for choice in ("auto", "none"):  # text (these models answer in code), or calls that validate
        calls, text, reason = calls_and_text(server, model, tool_choice=choice)
        streamed = calls_and_text(server, model, stream=True, tool_choice=choice)
        assert [c[:2] for c in streamed[0]] == [c[:2] for c in calls] and streamed[1:] == (text, reason)
        assert (text is None) == bool(calls) and (choice == "auto" or not calls)


def test_a_tool_result_goes_back_into_the_prompt(server):
    """An assistant's call and the tool's answer, in the conversation: rendered by kstep's default
    (these templates render no tools) and answered."""
    from kstep.server.tools import prompt_messages
    history = [{"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    rendered, tools = prompt_messages([{k: v for k, v in m.items()} for m in history], TOOLS, "{{ messages }}")
    assert tools is None and "get_weather" in rendered[0]["content"] and rendered[0]["role"] == "system"
    assert rendered[2]["content"] == '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert rendered[3]["content"] == "<tool_response>3</tool_response>"
    own, tools = prompt_messages(history, TOOLS, "{% for t in tools %}{{ t }}{% endfor %}")  # a template with tools
    assert tools == TOOLS and own[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    reply = client(server).chat.completions.create(model="ar", messages=history, tools=TOOLS, max_tokens=16,
                                                   temperature=0)
    choice = reply.choices[0]  # calls, or a text answer (cut at max_tokens like any text: "length")
    assert choice.finish_reason in ("stop", "tool_calls") or (choice.finish_reason == "length"
                                                              and choice.message.tool_calls is None)


@pytest.mark.parametrize("fields,param,says", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "no tool named 'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "with tools"),
    ({"functions": [{"name": "f"}]}, "functions", "functions is not supported by kstep"),
])
def test_bad_tool_fields_are_400s_naming_them(server, fields, param, says):
    r = httpx.post(server + "/v1/chat/completions", json={"model": "ar", "messages": MESSAGES, "max_tokens": 32,
                                                           **fields}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("model", MODELS)
def test_logit_bias_is_honoured(server, model):
    c = client(server)
    plain = c.completions.create(model=model, prompt="def f(x):", max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True})
    forced = c.completions.create(model=model, prompt="def f(x):", max_tokens=4, temperature=0,
                                  logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    again = c.completions.create(model=model, prompt="def f(x):", max_tokens=4, temperature=0,
                                 logit_bias={"43": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text != again.choices[0].text and forced.choices[0].text != plain.choices[0].text[:4]
    for bias, says in (({"99999999": 1}, "outside the vocabulary"), ({"a": 1}, "keys are token ids"),
                       ({"5": 200}, "must be >= -100 and <= 100")):
        r = httpx.post(server + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 4,
                                                         "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and says in r.text, r.text


def test_metrics_count_grammars_masks_forced_tokens_and_outcomes(server):
    from test_server import metric
    before = {o: metric(server, "kstep_constrained_requests_total", f'model="block",outcome="{o}"')
              for o in ("stop", "tool_calls", "refused")}
    forced = metric(server, "kstep_grammar_forced_tokens_total", 'model="block"')
    schema = {"type": "object", "properties": {"metric_test": {"type": "boolean"}}, "required": ["metric_test"]}
    c = client(server)
    c.chat.completions.create(model="block", messages=MESSAGES, max_tokens=32, temperature=0,
                              response_format={"type": "json_schema", "json_schema": {"name": "m", "schema": schema}})
    c.chat.completions.create(model="block", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=96,
                              temperature=0)
    httpx.post(server + "/v1/completions", json={"model": "block", "prompt": "x", "max_tokens": 1,
                                                 "response_format": {"type": "json_object"}})
    after = {o: metric(server, "kstep_constrained_requests_total", f'model="block",outcome="{o}"')
             for o in ("stop", "tool_calls", "refused")}
    assert {o: after[o] - before[o] for o in after} == {"stop": 1, "tool_calls": 1, "refused": 1}
    assert metric(server, "kstep_grammar_forced_tokens_total", 'model="block"') > forced
    assert metric(server, "kstep_grammar_compile_seconds_count", 'model="block"') >= 1
    assert metric(server, "kstep_grammar_mask_microseconds_count", 'model="block"') >= 2


ALL_FAMILIES = ("llama", "qwen2", "llada", "llada_moe", "dream", "fast_dllm_v2", "sdar", "llada2_moe", "diffusion_gemma",
                "nemotron_labs_diffusion")


def test_every_family_serves_a_json_schema_and_a_named_tool_call(tmp_path):
    """One server with a model of every family: through the openai client, a json_schema reply and a
    named tool call from each validate, streamed as not streamed."""
    specs = [f"{family}={write_random_checkpoint(tmp_path / family, family=family, seed=3)}" for family in ALL_FAMILIES]
    with running_server(specs[0], *(a for spec in specs[1:] for a in ("--model", spec)),
                        log=tmp_path / "serve.log") as (url, _):
        for family in ALL_FAMILIES:
            reply = client(url).chat.completions.create(model=family, messages=MESSAGES, max_tokens=80,
                                                        temperature=0, response_format=RESPONSE_FORMAT)
            jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
            chunks = client(url).chat.completions.create(model=family, messages=MESSAGES, max_tokens=80,
                                                         temperature=0, response_format=RESPONSE_FORMAT, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
                reply.choices[0].message.content, family
            calls, text, reason = calls_and_text(url, family, tool_choice={"type": "function",
                                                                           "function": {"name": "add"}})
            assert reason == "tool_calls" and text is None and [c[0] for c in calls] == ["add"], family
            jsonschema.validate(json.loads(calls[0][1]), PARAMETERS["add"])
            assert [c[:2] for c in calls_and_text(url, family, stream=True, tool_choice={
                "type": "function", "function": {"name": "add"}})[0]] == [c[:2] for c in calls], family
