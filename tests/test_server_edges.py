"""Malformed requests against a real `kstep serve`: each gets a 4xx with an OpenAI error body
(`{"error": {message, type, param, code}}`) naming the field where the server can know it, and the
server keeps serving. Then the CLI's usage errors: a short usage line and one line naming the flag."""
import json
import subprocess
import sys

import httpx
import pytest


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "x", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


# (name, route, body: JSON value or raw bytes, headers, status, param: the field named, or None)
MALFORMED = [
    ("stream a string", COMPLETIONS, completion(stream="yes"), JSON, 400, "stream"),
    ("n a string", COMPLETIONS, completion(n="2"), JSON, 400, "n"),
    ("temperature a string", COMPLETIONS, completion(temperature="0.5"), JSON, 400, "temperature"),
    ("max_tokens a float", COMPLETIONS, completion(max_tokens=1.5), JSON, 400, "max_tokens"),
    ("prompt a number", COMPLETIONS, completion(prompt=5), JSON, 400, "prompt"),
    ("prompt a mixed token list", COMPLETIONS, completion(prompt=[[1, "a"]]), JSON, 400, "prompt"),
    ("messages a string", CHAT, chat(messages="hi"), JSON, 400, "messages"),
    ("messages empty", CHAT, chat(messages=[]), JSON, 400, "messages"),
    ("message with an unknown role", CHAT, chat(messages=[{"role": "bogus", "content": "hi"}]), JSON, 400,
     "messages"),
    ("a JSON array body", COMPLETIONS, [completion()], JSON, 400, None),
    ("a null body", COMPLETIONS, None, JSON, 400, None),
    ("truncated JSON", COMPLETIONS, b'{"model": "tiny", "prompt": "x"', JSON, 400, None),
    ("an empty body", COMPLETIONS, b"", JSON, 400, None),
    ("a lone surrogate as raw bytes", COMPLETIONS, b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', JSON, 400,
     "prompt"),
    ("a lone surrogate escaped", COMPLETIONS, b'{"model": "tiny", "prompt": ["ok", "\\ud800"]}', JSON, 400,
     "prompt"),
    ("a lone surrogate in stop", COMPLETIONS, completion(stop="\ud800"), JSON, 400, "stop"),
    ("a lone surrogate in a message", CHAT, chat(messages=[{"role": "user", "content": "\ud800"}]), JSON, 400,
     "messages"),
    ("invalid UTF-8", COMPLETIONS, b'{"model": "tiny", "prompt": "\xff"}', JSON, 400, None),
    ("a latin-1 body and charset", COMPLETIONS, json.dumps(completion(prompt="café"), ensure_ascii=False)
     .encode("latin-1"), {"content-type": "application/json; charset=latin-1"}, 400, None),
    ("JSON sent as text/plain", COMPLETIONS, json.dumps(completion()).encode(), {"content-type": "text/plain"},
     415, None),
    ("exact a string", COMPLETIONS, completion(exact="true"), JSON, 400, "exact"),
    ("threshold a string", COMPLETIONS, completion(threshold="0.9"), JSON, 400, "threshold"),
    ("steps a float", COMPLETIONS, completion(steps=2.0), JSON, 400, "steps"),
    ("an unknown remasking rule", COMPLETIONS, completion(remasking="best"), JSON, 400, "remasking"),
    ("a Dream knob to LLaDA", COMPLETIONS, completion(alg_temp=0.5), JSON, 400, "alg_temp"),
    # Python's JSON decoder takes NaN and Infinity; a NaN cfg_scale used to fail the whole engine step.
    ("cfg_scale NaN", COMPLETIONS, b'{"model": "tiny", "prompt": "x", "cfg_scale": NaN}', JSON, 400, "cfg_scale"),
    ("threshold NaN", COMPLETIONS, b'{"model": "tiny", "prompt": "x", "threshold": NaN}', JSON, 400, "threshold"),
    ("temperature Infinity", CHAT, b'{"model": "tiny", "messages": [], "temperature": Infinity}', JSON, 400,
     "temperature"),
    ("a seed beyond int64", COMPLETIONS, completion(seed=2**64), JSON, 400, "seed"),
    ("stream with a bad field", COMPLETIONS, completion(stream=True, n="2"), JSON, 400, "n"),
]


def post(url: str, route: str, body, headers: dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + route, content=content, headers=headers, timeout=30)


def assert_openai_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def assert_serving(url: str, model: str) -> None:
    assert httpx.get(url + "/health").json()["status"] == "ok"
    r = httpx.post(url + COMPLETIONS, json={"model": model, "prompt": "x", "max_tokens": 2, "temperature": 0},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


@pytest.mark.parametrize("name,route,body,headers,status,param", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request_gets_an_openai_error(llada_server, name, route, body, headers, status, param):
    assert_openai_error(post(llada_server, route, body, headers), status, param)
    assert_serving(llada_server, "tiny")


@pytest.mark.parametrize("fields,param", [
    ({"steps": 4}, "steps"),
    ({"cfg_scale": 1.0}, "cfg_scale"),
    ({"num_draft_tokens": 2}, "num_draft_tokens"),  # no draft model loaded
], ids=["steps", "cfg_scale", "num_draft_tokens"])
def test_diffusion_knob_to_an_ar_server_names_it(llama_server, fields, param):
    r = post(llama_server, COMPLETIONS, {"model": "tiny-ar", "prompt": "x", "max_tokens": 4, **fields}, JSON)
    assert_openai_error(r, 400, param)
    assert param in r.json()["error"]["message"]
    assert_serving(llama_server, "tiny-ar")


def assert_usage_error(returncode: int, stdout: str, stderr: str, usage: str, words: list[str]) -> None:
    assert returncode == 2 and stdout == "", stderr
    lines = stderr.splitlines()
    assert len(lines) == 2, stderr
    assert lines[0].startswith(usage) and len(lines[0]) < 80, stderr  # not the whole option list
    assert "error:" in lines[1] and all(w in lines[1] for w in words), stderr


def test_cli_usage_error_is_two_short_lines(llada_path):
    proc = subprocess.run([sys.executable, "-m", "kstep", "generate", "--max-tokens", "abc", "x", "--model",
                           str(llada_path)], capture_output=True, text=True, timeout=60)
    assert_usage_error(proc.returncode, proc.stdout, proc.stderr, "usage: kstep generate [options]",
                       ["--max-tokens", "abc"])


@pytest.mark.parametrize("args,usage,words", [
    (["bench", "decode", "--lengths"], "usage: kstep bench decode [options]", ["--lengths", "expected one"]),
    (["serve", "--port", "notanint"], "usage: kstep serve [options]", ["--port", "notanint"]),
], ids=["bench-decode", "serve"])
def test_subcommand_usage_errors_are_two_short_lines(capsys, args, usage, words):
    # In-process (argparse fails before anything loads): the same parser `python -m kstep` builds.
    from kstep.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    assert_usage_error(exit_info.value.code, captured.out, captured.err, usage, words)
