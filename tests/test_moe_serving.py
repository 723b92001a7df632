"""The MoE families in `kstep serve`, beside a dense AR model: concurrent requests packed into one
step equal each request alone, and LLaDA2.1's token editing streams as the contract says (committed
text is never retracted; the canvas channel reports edits as edits)."""
import asyncio
import json

import httpx
import openai
import pytest
from test_server import client

import kstep
from kstep.bench.server_process import running_server
from kstep.random_checkpoint import write_random_checkpoint

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "for i in range(10):", "x = ["]
EDITING = {"editing_threshold": 0.1, "block_length": 8}  # low: edits happen on random weights


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    return {"l2": write_random_checkpoint(tmp_path_factory.mktemp("l2"), family="llada2_moe", seed=11, n_layers=3),
            "lm": write_random_checkpoint(tmp_path_factory.mktemp("lm"), family="llada_moe", seed=12)}


@pytest.fixture(scope="module")
def moe_server(moe_paths, llama_path, tmp_path_factory):
    with running_server(f"l2={moe_paths['l2']}", "--model", f"lm={moe_paths['lm']}", "--model", f"ar={llama_path}",
                        "--max-batch-size", "8", log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


def test_packed_requests_of_both_moe_families_equal_each_alone(moe_server, moe_paths):
    local = {name: kstep.load(path) for name, path in moe_paths.items()}
    settings = {"l2": {"block_length": 8}, "lm": {}, "ar": {}}
    expected = {(name, p): local[name].generate(p, max_tokens=16, **settings[name])[0].text
                for name in ("l2", "lm") for p in PROMPTS}

    async def together():
        ac = openai.AsyncOpenAI(base_url=moe_server + "/v1", api_key="unused", max_retries=0)
        jobs = [ac.completions.create(model=name, prompt=p, max_tokens=16, temperature=0, extra_body=settings[name])
                for p in PROMPTS for name in ("l2", "lm", "ar")]
        return await asyncio.gather(*jobs)

    results = asyncio.run(together())
    got = {(name, p): r.choices[0].text for (p, name), r in
           zip([(p, n) for p in PROMPTS for n in ("l2", "lm", "ar")], results)}
    for key, text in expected.items():
        assert got[key] == text, key
    batch = httpx.get(moe_server + "/metrics").text
    assert 'kstep_batch_size_bucket{le="1.0",model="l2"}' in batch or "model=\"l2\"" in batch


def stream(url, **body):
    with httpx.stream("POST", url + "/v1/completions", json={"stream": True, **body}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_token_editing_streams_only_settled_text_and_marks_edits(moe_server, moe_paths):
    llm = kstep.load(moe_paths["l2"])
    prompt = PROMPTS[1]
    [alone] = llm.generate(prompt, max_tokens=24, **EDITING)
    chunks = stream(moe_server, model="l2", prompt=prompt, max_tokens=24, temperature=0,
                    stream_options={"include_canvas": True}, **EDITING)
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == alone.text  # the streamed text is the final text
    edits = [c["canvas_edits"] for c in choices if c.get("canvas_edits")]
    assert edits, "no edit was reported: lower the editing threshold of this test"
    # an edited position was visible before with another token: the canvas shows the change
    for before, after in zip(choices, choices[1:]):
        for position in after.get("canvas_edits") or []:
            assert before["canvas_pieces"][position] is not None
    # committed text only grows: what was streamed is a prefix of the final completion at every chunk
    sent = ""
    for c in choices:
        sent += c["text"]
        assert alone.text.startswith(sent)


def test_editing_knobs_are_refused_on_other_families_and_with_exact(moe_server):
    for model, body, field in (("lm", {"editing_threshold": 0.5}, "editing_threshold"),
                               ("l2", {"editing_threshold": 0.5, "exact": True}, "editing_threshold"),
                               ("l2", {"max_post_steps": 3}, "max_post_steps"),
                               # bounded: 4 passes per position of a block of 32
                               ("l2", {"editing_threshold": 0.001, "max_post_steps": 10**9}, "limit of 128")):
        r = httpx.post(moe_server + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 4, **body})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (model, body, r.text)
        assert r.json()["error"]["param"] in body, r.text
    assert client(moe_server).completions.create(model="l2", prompt="x", max_tokens=4).choices[0].finish_reason
