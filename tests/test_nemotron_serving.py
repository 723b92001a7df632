"""Nemotron-Labs-Diffusion's three modes at the edges: `kstep generate --mode`, and `kstep serve` with
the official `openai` client, where requests of all three modes packed into the same engine steps
each equal the request alone, streams carry the same text, and a bad mode is a 400 naming it."""
import asyncio
import re

import httpx
import openai
import pytest
from test_server import client

import kstep
from kstep.bench.server_process import running_server
from kstep.cli import main
from kstep.random_checkpoint import write_random_checkpoint

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "for i in range(10):"]
MODES = ("diffusion", "ar", "linear_spec")


@pytest.fixture(scope="module")
def nld_path(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("nld"), family="nemotron_labs_diffusion", seed=6)


@pytest.fixture(scope="module")
def nld_server(nld_path, tmp_path_factory):
    # a server-wide --threshold (the default's value) is a diffusion knob: an `ar` request goes without it
    with running_server(nld_path, "--served-model-name", "nld", "--max-batch-size", "8", "--threshold", "0.9",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


@pytest.mark.parametrize("mode", MODES)
def test_generate_takes_the_mode_flag(nld_path, mode, capsys):
    assert main(["generate", "def add(a, b):", "--model", str(nld_path), "--max-tokens", "16", "--mode", mode,
                 "--ignore-eos"]) == 0
    stats = capsys.readouterr().err.strip().splitlines()[-1]
    nfe = int(re.match(r"-- 16 tokens, finish_reason=length, nfe=(\d+)", stats).group(1))
    # diffusion: prefill + 2 blocks of 7 masks (at least one a pass) + a commit; ar: one a token;
    # linear_spec: the prefill, then a draft and a verification per round (1 to 8 tokens each)
    assert {"diffusion": nfe <= 16, "ar": nfe == 16, "linear_spec": 5 <= nfe <= 31}[mode], (mode, nfe)


def test_packed_requests_of_every_mode_equal_each_alone(nld_server, nld_path):
    llm = kstep.load(nld_path)
    expected = {(m, p): llm.generate(p, max_tokens=24, mode=m)[0] for m in MODES for p in PROMPTS}

    async def together():
        ac = openai.AsyncOpenAI(base_url=nld_server + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*[ac.completions.create(model="nld", prompt=p, max_tokens=24, temperature=0,
                                                            extra_body={"mode": m}) for m, p in expected])

    for (mode, p), out in zip(expected, asyncio.run(together()), strict=True):
        alone = expected[mode, p]
        assert out.choices[0].text == alone.text, (mode, p)
        assert out.usage.model_extra["nfe"] == alone.nfe, (mode, p)
    ar = [expected["ar", p].text for p in PROMPTS]
    assert [expected["linear_spec", p].text for p in PROMPTS] == ar  # self-speculation: the AR output


@pytest.mark.parametrize("mode", ["diffusion", "linear_spec"])
def test_a_stream_carries_the_completion(nld_server, mode):
    c = client(nld_server)
    whole = c.completions.create(model="nld", prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                 extra_body={"mode": mode}).choices[0].text
    chunks = c.completions.create(model="nld", prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True,
                                  extra_body={"mode": mode})
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole


def test_bad_mode_and_knobs_of_another_mode_are_400(nld_server):
    for body, param in (({"mode": "dlm"}, "mode"), ({"mode": "ar", "threshold": 0.5}, "threshold")):
        r = httpx.post(nld_server + "/v1/completions", json={"model": "nld", "prompt": "x", "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
