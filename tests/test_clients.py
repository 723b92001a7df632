"""The popular OpenAI client libraries, unmodified, against a real `kstep serve`: instructor, the
openai client's pydantic helpers, LangChain's ChatOpenAI and litellm, each on an AR, a
masked-diffusion and a block-diffusion model served together.

The models are random, so their words are noise; kstep's grammar makes every structured output and
tool call valid, and that is what is checked: the client's parsed object exists and obeys the
schema, the JSON the model wrote validates against the schema the client sent (each object's keys
in that schema's order, as OpenAI writes them), finish_reason is the one the client acts on.

The clients talk to kstep through a recording pass-through (`recording_proxy`), so a test checks
against the body a client really sent (its schema, its tool_choice). What they send, in short:
instructor's TOOLS (TOOLS_STRICT is the same request in instructor 1.17) names its tool in
tool_choice, the pydantic schema as parameters (`$defs` / `$ref` for a nested model or an Enum);
PARALLEL_TOOLS sends tool_choice "auto"; JSON_SCHEMA, openai's `parse`, litellm's response_format
and LangChain's "json_schema" send response_format json_schema (the openai helpers in strict form:
`additionalProperties: false`, every field required); `pydantic_function_tool` sends `strict: true`
tools with `$defs`; LangChain inlines the `$ref`s of its tools, sends `max_completion_tokens` and,
for with_structured_output, `parallel_tool_calls: false`. None sends stream_options unless asked.
Nothing here reaches the network (`no_network`): litellm's cost map is its bundled copy."""
import json
import os
import socket
import threading
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from functools import reduce
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from operator import add

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before litellm is imported: no cost map download

import httpx  # noqa: E402
import instructor  # noqa: E402
import jsonschema  # noqa: E402
import litellm  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from instructor.core import IncompleteOutputException  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from kstep.bench.server_process import running_server  # noqa: E402
from conftest import ar_masked_block_models  # noqa: E402

litellm.suppress_debug_info = True  # no "Give Feedback" banners; its callbacks are empty by default
pytestmark = pytest.mark.filterwarnings(  # the libraries' own noise, not kstep's
    "ignore:Mode.TOOLS_STRICT is deprecated:DeprecationWarning", "ignore:.*ReadOnly. qualifier:UserWarning")

MODELS = ("ar", "masked", "block")
MESSAGES = [{"role": "user", "content": "The weather in Paris?"}]
SEED = 7
MAX_TOKENS = 150  # the tiny models' context is 1024 tokens, and a prompt listing tools takes ~600


class Unit(str, Enum):
    CELSIUS = "C"
    FAHRENHEIT = "F"


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


class Weather(BaseModel):
    """The weather in a place."""
    place: Place                                       # nested: pydantic writes $defs and a $ref
    unit: Unit                                         # an Enum: another $ref
    temperature: float
    note: str | None = Field(default=None, max_length=24)  # Optional: anyOf string / null


class Notes(BaseModel):
    """Every field has a default: any JSON object whose keys are not these validates (json_mode)."""
    note: str | None = None
    tags: list[str] = []


@tool
def get_weather(city: str, unit: Unit = Unit.CELSIUS, days: int = 1) -> str:
    """The weather in a city for the next days."""
    return f"{days} days of sun in {city} ({unit.value})"


ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}


@dataclass
class Server:
    url: str                                        # the recorder's: clients talk to it
    sent: list[dict] = field(default_factory=list)  # each POST body, in order


@contextmanager
def recording_proxy(upstream: str):
    """A local pass-through to `upstream` that keeps each request body a client sends."""
    server = Server("")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            server.sent.append(json.loads(body))
            self._answer(httpx.post(upstream + self.path, content=body, timeout=300,
                                    headers={"content-type": "application/json"}))

        def do_GET(self):
            self._answer(httpx.get(upstream + self.path, timeout=60))

        def _answer(self, r: httpx.Response):  # whole (a stream's events too): the clients read it as it came
            self.send_response(r.status_code)
            self.send_header("content-type", r.headers.get("content-type", "application/json"))
            self.send_header("content-length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.url = f"http://127.0.0.1:{httpd.server_port}"
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module", autouse=True)
def no_network():
    """The clients may talk to this machine only (litellm, LangChain and the openai client can all
    be told to phone home): any other connection fails."""
    connect = socket.socket.connect

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise OSError(f"test_clients: no network, refused a connection to {address}")
        return connect(sock, address)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", local_only)
        yield


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(*ar_masked_block_models(tmp_path_factory),
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        with recording_proxy(url) as recorder:
            yield recorder


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def chat_openai(server: Server, model: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.url + "/v1", api_key="x", model=model, temperature=0, seed=SEED,
                      max_tokens=MAX_TOKENS, max_retries=0)


def check_weather(weather) -> None:
    """A Weather the client built, that obeys its schema."""
    assert isinstance(weather, Weather) and isinstance(weather.place, Place) and isinstance(weather.unit, Unit)
    Weather.model_validate(weather.model_dump())  # a field that breaks its constraint raises


class _Object(list):
    """A JSON object as its (key, value) pairs, in the order written."""


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:  # "#/$defs/Place"
        schema = reduce(lambda node, key: node[key], schema["$ref"].lstrip("#/").split("/"), root)
    return schema


def _key_orders(value, schema: dict, root: dict) -> list[tuple[list[str], list[str]]]:
    """(keys as written, the same keys in the schema's order) for each object in `value`."""
    schema = _resolve(schema, root)
    orders = []
    for branch in schema.get("anyOf", []):
        orders += _key_orders(value, branch, root) if "properties" in _resolve(branch, root) else []
    if isinstance(value, _Object) and "properties" in schema:
        properties = list(schema["properties"])
        written = [k for k, _ in value if k in properties]
        orders.append((written, [k for k in properties if k in written]))
        for k, v in value:
            orders += _key_orders(v, schema["properties"][k], root) if k in properties else []
    return orders


def check_json(text: str, schema: dict) -> None:
    """`text` is JSON that validates against `schema` (what the client sent), each object's keys in
    its schema's order (OpenAI's structured outputs keep it; a reader may rely on it)."""
    jsonschema.validate(json.loads(text), schema)
    orders = _key_orders(json.loads(text, object_pairs_hook=_Object), schema, schema)
    assert all(written == ordered for written, ordered in orders), (text, orders)


def sent_parameters(body: dict) -> dict[str, dict]:
    """A chat request's tools: name -> its parameters schema."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}


# instructor ----------------------------------------------------------------------------------------

INSTRUCTOR_MODES = [instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT, instructor.Mode.JSON_SCHEMA]


@pytest.mark.parametrize("mode", INSTRUCTOR_MODES, ids=[m.name for m in INSTRUCTOR_MODES])
@pytest.mark.parametrize("model", MODELS)
def test_instructor_gives_a_valid_model(server, model, mode):
    """TOOLS (TOOLS_STRICT is the same request in instructor 1.17) names the tool in tool_choice;
    JSON_SCHEMA sends response_format. max_retries=0: a validation failure shows, not retried away."""
    client = instructor.from_openai(openai_client(server), mode=mode)
    weather, completion = client.chat.completions.create_with_completion(
        model=model, response_model=Weather, messages=MESSAGES, max_retries=0, temperature=0, seed=SEED,
        max_tokens=MAX_TOKENS)
    check_weather(weather)
    sent, choice = server.sent[-1], completion.choices[0]
    if mode == instructor.Mode.JSON_SCHEMA:
        assert choice.finish_reason == "stop" and "tools" not in sent
        check_json(choice.message.content, sent["response_format"]["json_schema"]["schema"])
    else:
        assert sent["tool_choice"] == {"type": "function", "function": {"name": "Weather"}}
        assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == \
            ["Weather"] and choice.message.content is None
        check_json(choice.message.tool_calls[0].function.arguments, sent_parameters(sent)["Weather"])


@pytest.mark.parametrize("model", MODELS)
def test_instructor_parallel_tools_as_sent_lets_the_model_answer_text(server, model):
    """PARALLEL_TOOLS sends tool_choice "auto" (it overrides one given): the model chooses. These random
    models never open a call on their own (none did over 4 prompts x 5 seeds each, nor the bundled
    coders with calls shown in context), so the answer is text; cut at max_tokens, it must say
    "length", which instructor reports as IncompleteOutputException, not as a reply without calls."""
    client = instructor.from_openai(openai_client(server), mode=instructor.Mode.PARALLEL_TOOLS)
    with pytest.raises(IncompleteOutputException) as raised:
        client.chat.completions.create(model=model, response_model=Iterable[Weather], messages=MESSAGES,
                                       max_retries=0, temperature=0, seed=SEED, max_tokens=8)
    assert server.sent[-1]["tool_choice"] == "auto"
    completion = raised.value.last_completion  # text, max_tokens of it: the model did not end it
    assert completion.choices[0].message.tool_calls is None and completion.usage.completion_tokens == 8


@pytest.mark.parametrize("model", MODELS)
def test_instructor_parallel_tools_give_a_list_of_models(server, model):
    """The same request, with tool_choice "required" put over instructor's "auto" (the openai
    client's extra_body wins): one or more calls, each a valid Weather."""
    client = instructor.from_openai(openai_client(server), mode=instructor.Mode.PARALLEL_TOOLS)
    weathers = list(client.chat.completions.create(
        model=model, response_model=Iterable[Weather], messages=MESSAGES, max_retries=0, temperature=0, seed=SEED,
        max_tokens=MAX_TOKENS, extra_body={"tool_choice": "required"}))
    assert server.sent[-1]["tool_choice"] == "required" and weathers
    for weather in weathers:
        check_weather(weather)


# the openai client -------------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_openai_parse_with_a_pydantic_response_format(server, model):
    client = openai_client(server)
    completion = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Weather,
                                               temperature=0, seed=SEED, max_tokens=MAX_TOKENS)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and server.sent[-1]["response_format"]["json_schema"]["strict"] is True
    check_weather(choice.message.parsed)
    with client.chat.completions.stream(model=model, messages=MESSAGES, response_format=Weather, temperature=0,
                                        seed=SEED, max_tokens=MAX_TOKENS) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert server.sent[-1]["stream"] is True
    assert streamed.message.parsed == choice.message.parsed and streamed.finish_reason == "stop"
    check_json(choice.message.content, server.sent[-1]["response_format"]["json_schema"]["schema"])


@pytest.mark.parametrize("model", MODELS)
def test_openai_pydantic_function_tool_arguments_parse(server, model):
    weather_tool = openai.pydantic_function_tool(Weather)
    completion = openai_client(server).chat.completions.parse(
        model=model, messages=MESSAGES, tools=[weather_tool], tool_choice={"type": "function", "function": {
            "name": "Weather"}}, temperature=0, seed=SEED, max_tokens=MAX_TOKENS)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    check_weather(call.function.parsed_arguments)
    check_json(call.function.arguments, sent_parameters(server.sent[-1])["Weather"])


# LangChain ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
@pytest.mark.parametrize("model", MODELS)
def test_langchain_structured_output(server, model, method):
    out = chat_openai(server, model).with_structured_output(Weather, method=method, include_raw=True).invoke(MESSAGES)
    assert out["parsing_error"] is None
    check_weather(out["parsed"])
    sent, raw = server.sent[-1], out["raw"]
    if method == "function_calling":
        assert sent["tool_choice"] == {"type": "function", "function": {"name": "Weather"}}
        assert raw.response_metadata["finish_reason"] == "tool_calls" and len(raw.tool_calls) == 1
        check_json(json.dumps(raw.tool_calls[0]["args"]), sent_parameters(sent)["Weather"])  # (keys as written)
    else:
        assert raw.response_metadata["finish_reason"] == "stop"
        check_json(raw.content, sent["response_format"]["json_schema"]["schema"])


@pytest.mark.parametrize("model", MODELS)
def test_langchain_json_mode_gives_a_json_object(server, model):
    """json_mode sends only response_format json_object, the schema nowhere (the prompt must ask for
    JSON): kstep keeps a JSON object, not the model's fields, so the model here is one any object
    without its keys validates."""
    messages = [{"role": "user", "content": "The weather in Paris, as a JSON object."}]
    out = chat_openai(server, model).with_structured_output(Notes, method="json_mode", include_raw=True) \
        .invoke(messages)
    assert server.sent[-1]["response_format"] == {"type": "json_object"}
    assert isinstance(json.loads(out["raw"].content), dict) and out["raw"].response_metadata["finish_reason"] == "stop"
    assert out["parsing_error"] is None and isinstance(out["parsed"], Notes)


@pytest.mark.parametrize("model", MODELS)
def test_langchain_bind_tools_calls_validate_streamed_or_not(server, model):
    llm = chat_openai(server, model)
    for tools, choice, sent_choice in (([get_weather], "get_weather", {"type": "function", "function": {
            "name": "get_weather"}}), ([get_weather, Weather], "any", "required")):
        bound = llm.bind_tools(tools, tool_choice=choice)
        message = bound.invoke(MESSAGES)
        sent = server.sent[-1]
        assert sent["tool_choice"] == sent_choice and message.response_metadata["finish_reason"] == "tool_calls"
        assert message.tool_calls and message.content == ""
        parameters = sent_parameters(sent)
        for call in message.tool_calls:
            jsonschema.validate(call["args"], parameters[call["name"]])
            if call["name"] == "get_weather":  # the tool runs on them
                assert get_weather.invoke(call).content.endswith(")")
        streamed = reduce(add, bound.stream(MESSAGES))
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == \
            [(c["name"], c["args"]) for c in message.tool_calls]
        assert streamed.response_metadata["finish_reason"] == "tool_calls"
        for call in message.tool_calls:  # `args` keeps the keys as written
            check_json(json.dumps(call["args"]), parameters[call["name"]])


@pytest.mark.parametrize("model", MODELS)
def test_langchain_stop_with_tools_never_leaks_call_markup(server, model):
    """A stop string that a call's JSON holds ("}" ends every object): the reply is calls that
    validate, or text without kstep's call markup, or a 400 naming `stop`; never the cut markup."""
    for choice in ("any", "auto"):
        bound = chat_openai(server, model).bind_tools([ADD_TOOL], tool_choice=choice)
        try:
            message = bound.invoke([{"role": "user", "content": "1 + 2?"}], stop=["}"])
        except openai.BadRequestError as e:
            assert e.body["param"] == "stop", e.body
            continue
        assert server.sent[-1]["stop"] == ["}"]
        assert "<tool_call>" not in message.content and "</tool_call>" not in message.content, message.content
        for call in message.tool_calls:
            jsonschema.validate(call["args"], ADD_TOOL["function"]["parameters"])


# litellm -----------------------------------------------------------------------------------------

def litellm_completion(server: Server, model: str, **kwargs):
    return litellm.completion(model=f"openai/{model}", api_base=server.url + "/v1", api_key="x", messages=MESSAGES,
                              temperature=0, seed=SEED, max_tokens=MAX_TOKENS, **kwargs)


@pytest.mark.parametrize("model", MODELS)
def test_litellm_response_format(server, model):
    schema_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": Weather.model_json_schema(),
                                                            "strict": True}}
    for response_format in (Weather, schema_format):
        choice = litellm_completion(server, model, response_format=response_format).choices[0]
        assert choice.finish_reason == "stop"
        check_weather(Weather.model_validate_json(choice.message.content))
        check_json(choice.message.content, server.sent[-1]["response_format"]["json_schema"]["schema"])


LITELLM_TOOLS = {"pydantic": ([openai.pydantic_function_tool(Weather)], {"type": "function", "function": {
    "name": "Weather"}}), "flat": ([ADD_TOOL], "required")}


@pytest.mark.parametrize("tools", LITELLM_TOOLS)
@pytest.mark.parametrize("model", MODELS)
def test_litellm_tool_calls_validate_streamed_or_not(server, model, tools):
    tool_list, choice = LITELLM_TOOLS[tools]
    reply = litellm_completion(server, model, tools=tool_list, tool_choice=choice).choices[0]
    parameters = sent_parameters(server.sent[-1])
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
    for call in reply.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    chunks = list(litellm_completion(server, model, tools=tool_list, tool_choice=choice, stream=True))
    assert server.sent[-1]["stream"] is True
    streamed = litellm.stream_chunk_builder(chunks).choices[0]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert streamed.finish_reason == "tool_calls"
    for call in reply.message.tool_calls:
        check_json(call.function.arguments, parameters[call.function.name])
