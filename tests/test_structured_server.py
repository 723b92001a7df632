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
from test_server import client

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "temperature": {"type": "number"}, "unit": {"enum": ["C", "F"]}},
          "required": ["city", "temperature", "unit"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "The weather in Paris?"}]
MODELS = ("ar", "masked", "block")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    paths = {name: write_random_checkpoint(tmp_path_factory.mktemp(name), family=family, seed=3)
             for name, family in (("ar", "qwen2"), ("masked", "llada"), ("block", "sdar"))}
    with running_server(f"ar={paths['ar']}", "--model", f"masked={paths['masked']}", "--model",
                        f"block={paths['block']}", log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
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
