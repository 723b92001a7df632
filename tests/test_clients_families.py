"""A tool whose parameters come from a nested pydantic model with an Enum (pydantic writes `$defs` and
`$ref`s for both) through instructor, openai-agents (its default model: the Responses API) and the
openai client's `pydantic_function_tool`, on one server holding a random model of every family
that keeps a grammar: each call's arguments validate, as the client parses them."""
import asyncio
import json
from enum import Enum

import instructor
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kstep.bench.server_process import running_server
from kstep.random_checkpoint import write_random_checkpoint
from test_structured_server import ALL_FAMILIES

MESSAGES = [{"role": "user", "content": "The weather in Paris?"}]


class Unit(str, Enum):
    CELSIUS = "C"
    FAHRENHEIT = "F"


class Place(BaseModel):
    city: str = Field(max_length=10)


class Weather(BaseModel):
    """The weather in a place."""
    place: Place
    unit: Unit


class Answer(BaseModel):
    done: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    specs = [f"{family}={write_random_checkpoint(root / family, family=family, seed=3)}" for family in ALL_FAMILIES]
    with running_server(specs[0], *(a for spec in specs[1:] for a in ("--model", spec)),
                        log=root / "serve.log") as (url, _):
        yield url


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def run_agent(url: str, family: str) -> list[Weather]:
    """An openai-agents run over the SDK's default model (the Responses API): the tool is called
    first (tool_choice "required"), its output ends the run (stop_on_first_tool)."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    seen: list[Weather] = []

    @function_tool
    def report(weather: Weather, unit: Unit) -> str:
        """Report the weather."""
        seen.append(weather)
        return f"{weather.place.city} in {unit.value}"

    async def run():
        set_tracing_disabled(True)
        set_default_openai_client(openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0),
                                  use_for_tracing=False)
        agent = Agent(name="reporter", instructions="Report the weather.", tools=[report], model=family,
                      model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=160),
                      tool_use_behavior="stop_on_first_tool")
        return await Runner.run(agent, "The weather in Paris?", max_turns=2)
    result = asyncio.run(run())
    assert isinstance(result.final_output, str) and result.final_output.endswith(("in C", "in F"))
    return seen


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_a_pydantic_tool_with_an_enum_works_in_each_client(server, family):
    tool = openai.pydantic_function_tool(Weather)
    reply = sync_client(server).chat.completions.create(
        model=family, messages=MESSAGES, tools=[tool], max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "Weather"}})
    [call] = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    Weather.model_validate_json(call.function.arguments)

    weather = instructor.from_openai(sync_client(server), mode=instructor.Mode.TOOLS).chat.completions.create(
        model=family, messages=MESSAGES, response_model=Weather, max_tokens=120, temperature=0, max_retries=0)
    assert isinstance(weather, Weather) and isinstance(weather.unit, Unit)

    [reported] = run_agent(server, family)
    assert isinstance(reported, Weather) and isinstance(reported.unit, Unit)
