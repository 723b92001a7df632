"""OpenAI's Responses API (POST /v1/responses) through a real `kstep serve`, the official openai
client and openai-agents, on an AR and a masked-diffusion model: a Responses request is the chat
request it translates to (same prompt, same text); streamed equals not streamed, with the events in
OpenAI's order; text.format and function tools validate; a call and its output go back in as items;
a length limit is `incomplete`; what kstep cannot honour is a 400 naming the field; an agent runs
to its final output over Responses (the SDK's default) and over chat completions."""
import asyncio
import json
import re
import threading

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from kstep.bench.server_process import running_server
from kstep.random_checkpoint import write_random_checkpoint
from test_server import client, metric

MODELS = ("ar", "masked")
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "city": {"type": "string", "maxLength": 10},
                                           "temperature": {"type": "number"}},
          "required": ["unit", "city", "temperature"], "additionalProperties": False}
JSON_SCHEMA = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": SCHEMA,
          "strict": True},
         {"type": "function", "name": "add", "parameters": ADD, "strict": True}]
PARAMETERS = {t["name"]: t["parameters"] for t in TOOLS}
# OpenAI's order: the response opens, each output item opens, fills and closes, the response ends.
TEXT_EVENTS = re.compile(r"response\.created response\.in_progress response\.output_item\.added "
                         r"response\.content_part\.added (response\.output_text\.delta )*response\.output_text\.done "
                         r"response\.content_part\.done response\.output_item\.done response\.(completed|incomplete)")
CALL_EVENTS = re.compile(r"response\.created response\.in_progress (response\.output_item\.added "
                         r"response\.function_call_arguments\.delta response\.function_call_arguments\.done "
                         r"response\.output_item\.done )+response\.completed")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    paths = {name: write_random_checkpoint(tmp_path_factory.mktemp(name), family=family, seed=3)
             for name, family in (("ar", "qwen2"), ("masked", "llada"))}
    with running_server(f"ar={paths['ar']}", "--model", f"masked={paths['masked']}",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


def events(url: str, **fields) -> list:
    return list(client(url).responses.create(stream=True, **fields))


@pytest.mark.parametrize("model", MODELS)
def test_a_response_is_its_chat_completion(server, model):
    """A string input, the same as items, with instructions: the chat reply to the same messages."""
    c = client(server)
    r = c.responses.create(model=model, input="The weather?", instructions="Be brief.", max_output_tokens=16,
                           temperature=0)
    chat = c.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "The weather?"}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model and r.instructions == "Be brief."
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [(p.type, p.annotations) for p in item.content] == [("output_text", [])]
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    items = c.responses.create(model=model, max_output_tokens=16, temperature=0, input=[
        {"role": "system", "content": [{"type": "input_text", "text": "Be "}, {"type": "input_text", "text": "brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "The weather?"}]}])
    assert items.output_text == r.output_text and items.usage.input_tokens == r.usage.input_tokens
    bare = c.responses.create(model=model, input="The weather?", max_output_tokens=16, temperature=0)
    assert bare.usage.input_tokens < r.usage.input_tokens and bare.instructions is None


@pytest.mark.parametrize("model", MODELS)
def test_streamed_equals_not_streamed_in_openai_order(server, model):
    fields = dict(model=model, input="def f(x):", max_output_tokens=24, temperature=0, extra_body={"seed": 1})
    whole = client(server).responses.create(**fields)
    streamed = events(server, **fields)
    assert TEXT_EVENTS.fullmatch(" ".join(e.type for e in streamed)), [e.type for e in streamed]
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == whole.output_text
    done = streamed[-1].response
    assert done.output_text == whole.output_text and done.status == whole.status and done.usage == whole.usage
    assert {e.item_id for e in streamed if hasattr(e, "item_id")} == {done.output[0].id}
    assert streamed[0].response.status == "in_progress" and streamed[0].response.output == []
    with client(server).responses.stream(text=JSON_SCHEMA, **{**fields, "max_output_tokens": 64}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == \
        client(server).responses.create(text=JSON_SCHEMA, **{**fields, "max_output_tokens": 64}).output_text


@pytest.mark.parametrize("model", MODELS)
def test_max_output_tokens_ends_incomplete(server, model):
    fields = dict(model=model, input="x =", max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    r = client(server).responses.create(**fields)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[0].status == "incomplete" and r.max_output_tokens == 4
    streamed = events(server, **fields)
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.output_text == r.output_text


@pytest.mark.parametrize("model", MODELS)
def test_text_format_json_schema_validates_in_the_schemas_key_order(server, model):
    fields = dict(model=model, input="The weather in Paris?", max_output_tokens=80, temperature=0, text=JSON_SCHEMA)
    r = client(server).responses.create(**fields)
    answer = json.loads(r.output_text)
    jsonschema.validate(answer, SCHEMA)
    assert list(answer) == list(SCHEMA["properties"]) and r.status == "completed"
    assert r.text.format.type == "json_schema" and r.text.format.name == "weather"
    streamed = events(server, **fields)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == r.output_text
    loose = client(server).responses.create(model=model, input="x", max_output_tokens=48, temperature=0,
                                            text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(loose.output_text), dict)


@pytest.mark.parametrize("fields", [{}, {"tools": TOOLS, "tool_choice": "required"}, {"text": JSON_SCHEMA},
                                    {"max_output_tokens": 4, "ignore_eos": True}])
def test_bodies_and_events_validate_against_the_openai_types(server, fields):
    """Strictly (the client itself parses leniently): the JSON body, and each event as an `event:`
    line naming its type over a `data:` line."""
    body = {"model": "ar", "input": "hi", "max_output_tokens": 64, "temperature": 0, **fields}
    Response.model_validate(httpx.post(server + "/v1/responses", json=body, timeout=60).json())
    with httpx.stream("POST", server + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names, data = lines[0::2], [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert names == [f"event: {e['type']}" for e in data] and all(line.startswith("data: ") for line in lines[1::2])
    for event in data:
        TypeAdapter(ResponseStreamEvent).validate_python(event)


def test_a_client_that_hangs_up_mid_stream_frees_its_slot(server):
    cancelled = metric(server, "kstep_requests_total", 'model="masked",status="499"')
    with httpx.stream("POST", server + "/v1/responses", json={
            "model": "masked", "input": "x", "max_output_tokens": 960, "temperature": 0, "stream": True,
            "ignore_eos": True, "exact": True}, timeout=60) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream, and the server sees a hang-up
        assert next(line for line in lines if "output_text.delta" in line)  # running; now hang up
    for _ in range(100):
        if metric(server, "kstep_requests_total", 'model="masked",status="499"') > cancelled and \
                httpx.get(server + "/health").json()["running"] == 0:
            break
        threading.Event().wait(0.1)
    else:
        pytest.fail("the disconnected request was not cancelled")


def calls(response) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("model", MODELS)
def test_function_calls_validate_streamed_and_not(server, model):
    for choice, allowed in (("required", set(PARAMETERS)), ({"type": "function", "name": "add"}, {"add"})):
        fields = dict(model=model, input="What is 2 + 3?", tools=TOOLS, tool_choice=choice, max_output_tokens=96,
                      temperature=0)
        r = client(server).responses.create(**fields)
        assert r.status == "completed" and calls(r) and r.output_text == ""
        for item in r.output:
            assert item.type == "function_call" and item.status == "completed" and item.name in allowed
            assert item.call_id.startswith("call_") and item.id.startswith("fc_")
            jsonschema.validate(json.loads(item.arguments), PARAMETERS[item.name])
        streamed = events(server, **fields)
        assert CALL_EVENTS.fullmatch(" ".join(e.type for e in streamed)), [e.type for e in streamed]
        assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
        assert calls(streamed[-1].response) == calls(r)
        deltas = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
        assert deltas == [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"] \
            == [arguments for _, arguments in calls(r)]
        added = [e.item for e in streamed if e.type == "response.output_item.added"]
        assert all(i.status == "in_progress" and i.arguments == "" for i in added)
        with client(server).responses.stream(**fields) as stream:
            assert calls(stream.get_final_response()) == calls(r)
    one = client(server).responses.create(model=model, input="2 + 3?", tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=96, temperature=0)
    assert len(calls(one)) == 1 and one.parallel_tool_calls is False


def test_a_call_and_its_output_go_back_in_as_items(server):
    """A second turn: the call the model made and the tool's answer, as the chat endpoint takes them."""
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}',
            "status": "completed"}
    items = [{"role": "user", "content": "What is 2 + 3?"}, call,
             {"type": "function_call_output", "call_id": "call_1", "output": "5"}]
    r = client(server).responses.create(model="ar", input=items, tools=TOOLS, max_output_tokens=16, temperature=0)
    chat = client(server).chat.completions.create(
        model="ar", max_tokens=16, temperature=0, tools=[{"type": "function", "function": {
            k: v for k, v in t.items() if k != "type"}} for t in TOOLS],
        messages=[items[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert calls(r) == [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls or []]
    assert r.output_text == (chat.choices[0].message.content or "")


def refusal(url: str, **fields) -> dict:
    r = httpx.post(url + "/v1/responses", json={"model": "ar", "input": "x", "max_output_tokens": 4, **fields},
                   timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("fields,param,says", [
    ({"store": True}, "store", "keeps no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the earlier turns' items"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"background": True}, "background", "background is not supported by kstep"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include is not supported by kstep"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning is not supported by kstep"),
    ({"truncation": "auto"}, "truncation", "never drops input"),
    ({"top_logprobs": 2}, "top_logprobs", "returns no logprobs"),
    ({"text": {"verbosity": "low"}}, "text", "text.verbosity is not supported"),
    ({"tools": [{"type": "web_search", "search_context_size": "low"}]}, "tools",
     "tool type 'web_search' is not supported by kstep"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice type 'file_search' is not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input item type 'reasoning' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "content part type 'input_image' is not supported"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages", "it is a field of /v1/chat/completions"),
    ({"max_output_token": 4}, "max_output_token", "did you mean 'max_output_tokens'?"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "no tool named 'nope'"),
    ({"text": {"format": {"type": "json_schema", "name": "w"}}}, "text", "needs its name and schema"),
    ({"text": {"format": {"type": "json_object"}}, "max_output_tokens": 1}, "max_output_tokens",
     "too small for the text.format"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens", "exceeds the model's context"),
    ({"input": []}, "input", "give at least one item"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "{"}]}, "input",
     "input[0].arguments: a call's arguments are a JSON object's text"),
    ({"threshhold": 0.5}, "threshhold", "did you mean 'threshold'?"),
])
def test_what_kstep_cannot_honour_is_a_400_naming_the_field(server, fields, param, says):
    error = refusal(server, **fields)
    assert error["param"] == param and says in error["message"], error
    ok = client(server).responses.create(model="ar", input="x", max_output_tokens=4, temperature=0)
    assert ok.usage.output_tokens > 0  # and the server goes on


def test_no_op_values_and_fields_with_no_effect_are_accepted(server):
    plain = client(server).responses.create(model="masked", input="x", max_output_tokens=8, temperature=0)
    same = client(server).responses.create(
        model="masked", input="x", max_output_tokens=8, temperature=0, store=False, include=[], background=False,
        truncation="disabled", metadata={"team": "a"}, user="u-1", service_tier="auto", prompt_cache_key="k",
        safety_identifier="s", parallel_tool_calls=True, tool_choice="none", text={"format": {"type": "text"}},
        extra_body={"reasoning": None, "max_tool_calls": 3, "steps": None})
    assert same.output_text == plain.output_text and same.metadata == {"team": "a"} and same.store is False
    knob = client(server).responses.create(model="masked", input="x", max_output_tokens=8, temperature=0,
                                           extra_body={"steps": 2})  # kstep's knobs are extra fields here too
    assert knob.usage.model_extra["nfe"] == 2 < plain.usage.model_extra["nfe"]


class Answer(BaseModel):
    result: int


def run_agent(url: str, api: str, streamed: bool = False):
    """An agent with a tool: made to call it first, then (the tool gone once it ran) to answer in
    its output type, so that random weights still end the run: the tool's arguments and the answer
    validate."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_default_openai_client, set_tracing_disabled)
    ran = []

    @function_tool(is_enabled=lambda ctx, agent: not ran)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    async def run():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        set_tracing_disabled(True)
        if api == "responses":  # the SDK's default model: OpenAIResponsesModel over the default client
            set_default_openai_client(c, use_for_tracing=False)
            model = "ar"
        else:
            model = OpenAIChatCompletionsModel(model="ar", openai_client=c)
        agent = Agent(name="adder", instructions="Add the numbers with the tool, then answer.", tools=[add],
                      model=model, model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=96),
                      output_type=Answer)
        if not streamed:
            return await Runner.run(agent, "What is 2 + 3?", max_turns=3)
        result = Runner.run_streamed(agent, "What is 2 + 3?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result
    result = asyncio.run(run())
    assert len(ran) == 1 and all(type(x) is int for x in ran[0]), ran
    assert isinstance(result.final_output, Answer)
    return result


@pytest.mark.parametrize("api,streamed", [("responses", False), ("responses", True), ("chat", False)])
def test_an_agent_runs_to_its_final_output(server, api, streamed):
    result = run_agent(server, api, streamed)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
