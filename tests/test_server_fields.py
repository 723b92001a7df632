"""Which request fields a real `kstep serve` takes, through the official openai client: a field that
is neither an OpenAI field of the endpoint nor a kstep knob is a 400 naming it (and the knob one
edit away); an OpenAI field kstep does not implement is refused by name unless it holds its no-op
value; the fields with no effect on the output are accepted; a `draft` a model cannot use is a 400
naming `draft`. After each refusal the server answers as before."""
import httpx
import openai
import pytest

from test_server import client

PROMPT = "def f(x):"
MESSAGES = [{"role": "user", "content": "write a loop"}]


def refusal(url: str, model: str, chat: bool = False, **extra) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        if chat:
            client(url).chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body=extra)
        else:
            client(url).completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body=extra)
    return caught.value


def text(url: str, model: str, **extra) -> str:
    return client(url).completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                          extra_body=extra).choices[0].text


@pytest.mark.parametrize("field,value,says", [
    ("threshhold", 0.1, "did you mean 'threshold'?"),
    ("exakt", True, "did you mean 'exact'?"),
    ("block-length", 8, "did you mean 'block_length'?"),
    ("Temperature", 0.5, "did you mean 'temperature'?"),
    ("totally_unknown_field", 1, "neither an OpenAI field of /v1/completions nor a kstep knob"),
    ("messages", MESSAGES, "it is a field of /v1/chat/completions"),
])
def test_an_unknown_field_is_a_400_naming_it_and_the_knob_one_edit_away(llada_server, field, value, says):
    e = refusal(llada_server, "tiny", **{field: value})
    assert e.status_code == 400 and e.param == field and e.code == "unknown_field"
    assert f"unknown field {field!r}" in e.message and says in e.message, e.message
    assert text(llada_server, "tiny") == text(llada_server, "tiny")  # and the server goes on


def test_chat_and_nested_unknown_fields_are_named(llada_server):
    e = refusal(llada_server, "tiny", chat=True, echo=True)
    assert e.param == "echo" and "it is a field of /v1/completions" in e.message, e.message
    r = httpx.post(llada_server + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usge": True}})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "stream_options", error
    assert error["message"] == "stream_options: unknown field 'include_usge': did you mean 'include_usage'?"


@pytest.mark.parametrize("chat,field,value", [
    (False, "best_of", 3),
    (False, "logprobs", 2),
    (True, "top_logprobs", 2),
    (True, "reasoning_effort", "low"),
    (True, "modalities", ["text", "audio"]),
])
def test_an_openai_field_kstep_does_not_implement_is_refused_by_name(llada_server, chat, field, value):
    e = refusal(llada_server, "tiny", chat=chat, **{field: value})
    assert e.param == field and e.body["message"] == f"{field} is not supported by kstep", e.message


def test_no_op_values_and_fields_with_no_effect_on_the_output_are_accepted(llada_server):
    want = client(llada_server).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    got = client(llada_server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, user="u-1", metadata={"team": "a"},
        store=False, service_tier="auto", logit_bias={}, logprobs=False, presence_penalty=0, tool_choice="none",
        response_format={"type": "text"}, parallel_tool_calls=False, stream_options=None,
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s"})
    assert got.choices[0].message.content == want.choices[0].message.content
    assert text(llada_server, "tiny", user="u-1") == text(llada_server, "tiny")


@pytest.mark.parametrize("draft", ["bogus", "ngram", "default-draft"])
def test_a_draft_a_diffusion_model_cannot_use_is_a_400_naming_draft(llada_server, draft):
    e = refusal(llada_server, "tiny", draft=draft)
    assert e.status_code == 400 and e.param == "draft", e.message
    assert "draft" in e.message and repr(draft) in e.message, e.message
    assert isinstance(text(llada_server, "tiny", draft="self"), str)  # the one it can: self-speculation


def test_a_request_draft_on_an_ar_model_is_a_400_naming_draft(llama_server):
    e = refusal(llama_server, "tiny-ar", draft="ngram")
    assert e.status_code == 400 and e.param == "draft" and "'ngram'" in e.message, e.message
    assert text(llama_server, "tiny-ar")  # and it goes on serving
