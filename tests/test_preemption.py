"""Preemption without loss through a real `kstep serve` (issue 45). An AR request's cache grows with its
completion; on a pool of 8 pages, a burst of requests that start small and grow cannot all grow, so
the newest are preempted (their pages taken back) and resume by recomputing what they had committed:
every output, greedy, seeded sampling and a JSON schema's, streamed or not, equals the same request
run alone on the same server, nothing is sent twice, and usage and /metrics count the preemptions."""
import asyncio
import json

import httpx
import openai
import pytest
import torch
from test_server import client, metric

import kstep
from kstep.bench.server_process import running_server
from kstep.random_checkpoint import write_random_checkpoint
from kstep.runner.kv_pool import bytes_per_token

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def _bodies() -> list[dict]:
    plain = [{"prompt": [3 + i, 40 + i, 7], "max_tokens": 44, "temperature": 0.9 * (i % 2), "seed": 100 + i,
              "ignore_eos": True} for i in range(6)]
    chat = [{"messages": [{"role": "user", "content": f"item {i}"}], "max_tokens": 40, "temperature": 0.7, "seed": i,
             "response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}}
            for i in range(2)]
    return plain + chat


def _tight_server(tmp_path_factory, family: str, seed: int, pages: int, page_tokens: int):
    """A server of a random `family` model (served as "ar") on a pool of `pages` pages."""
    path = write_random_checkpoint(tmp_path_factory.mktemp(family), family=family, seed=seed)
    runner = kstep.load(path).runner
    budget = (pages + 1) * page_tokens * bytes_per_token(runner.model.kv_geometry(), runner.dtype)  # + the trash page
    return running_server(path, "--served-model-name", "ar", "--kv-cache-memory", str(budget), "--max-batch-size", "8",
                          log=tmp_path_factory.mktemp("log") / "serve.log")


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    with _tight_server(tmp_path_factory, "qwen2", 12, pages=8, page_tokens=16) as (url, _):
        yield url


async def _send(http: httpx.AsyncClient, url: str, body: dict, stream: bool) -> tuple[str, dict]:
    """(the text, the usage) of one request, its chunks joined when streamed."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {"model": "ar", **body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    if not stream:
        r = (await http.post(url + path, json=body)).json()
        choice = r["choices"][0]
        return choice.get("text", (choice.get("message") or {}).get("content")), r["usage"]
    text, usage = "", {}
    async with http.stream("POST", url + path, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                usage = chunk.get("usage") or usage
    return text, usage


def _run(url: str, bodies: list[dict], stream: bool, together: bool) -> list[tuple[str, dict]]:
    async def go():
        async with httpx.AsyncClient(timeout=600) as http:
            if together:
                return await asyncio.gather(*(_send(http, url, b, stream) for b in bodies))
            return [await _send(http, url, b, stream) for b in bodies]
    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_preempted_requests_resume_to_the_output_they_get_alone(tight_server, stream):
    bodies = _bodies()
    alone = _run(tight_server, bodies, stream, together=False)
    before = metric(tight_server, "kstep_preemptions_total", 'model="ar"')
    burst = _run(tight_server, bodies, stream, together=True)
    assert [text for text, _ in burst] == [text for text, _ in alone]
    assert all(usage.get("preemptions") is None for _, usage in alone)
    preempted = sum(usage.get("preemptions", 0) for _, usage in burst)
    assert preempted > 0 and metric(tight_server, "kstep_preemptions_total", 'model="ar"') - before == preempted
    assert all(json.loads(text).keys() == {"name", "n"} for text, _ in burst[6:])
    health = httpx.get(tight_server + "/health").json()["models"]["ar"]["kv_pool"]["model"]["pages"]
    assert health["used"] == 0 and health["total"] == 8  # (the prompts' cached prefix blocks: `cached`)
    assert health["cached"] + health["free"] == 8
    assert metric(tight_server, "kstep_kv_pool_pages", 'model="ar",state="cached"') == health["cached"]


def test_a_request_whose_completion_cannot_fit_the_pool_is_refused_at_once(tight_server):
    with pytest.raises(openai.BadRequestError, match="--kv-cache-memory"):
        client(tight_server).completions.create(model="ar", prompt=[5, 6], max_tokens=200)


@pytest.fixture(scope="module")
def tight_block_server(tmp_path_factory):
    """A block-diffusion model (SDAR, blocks of 4: a page each) on a pool of 30 pages: a request's cache
    starts at its prompt and first blocks (3 pages) and grows block by block to 13."""
    with _tight_server(tmp_path_factory, "sdar", 13, pages=30, page_tokens=4) as (url, _):
        yield url


def test_a_block_models_caches_grow_and_its_preempted_requests_resume_as_alone(tight_block_server):
    bodies = [{"prompt": [3 + i, 40 + i, 7], "max_tokens": 40, "temperature": 0.8 * (i % 2), "seed": 200 + i,
               "ignore_eos": True} for i in range(6)]
    alone = _run(tight_block_server, bodies, False, together=False)
    burst = _run(tight_block_server, bodies, True, together=True)
    assert [text for text, _ in burst] == [text for text, _ in alone]
    assert sum(usage.get("preemptions", 0) for _, usage in burst) > 0
    health = httpx.get(tight_block_server + "/health").json()["models"]["ar"]["kv_pool"]["model"]
    assert health["pages"]["used"] == 0 and health["page_tokens"] == 4


def test_speculative_caches_grow_and_preempted_requests_resume_as_alone(tmp_path_factory):
    """A target and its draft model, each cache starting at the prompt and a first stretch and growing
    round by round (the draft model's beside the target's): on a pool of 8 pages each, requests that
    grow are preempted and resume to the output they get alone."""
    target = write_random_checkpoint(tmp_path_factory.mktemp("target"), family="qwen2", seed=12)
    draft = write_random_checkpoint(tmp_path_factory.mktemp("draft"), family="qwen2", seed=5, d_model=32,
                                    n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64)
    per_token = sum(bytes_per_token(kstep.load(p).model.kv_geometry(), torch.float32) for p in (target, draft))
    budget = (8 + 1) * 16 * per_token  # 8 pages of 16 (and the trash page) in each pool
    bodies = [{"prompt": [3 + i, 40 + i, 7], "max_tokens": 40, "temperature": 0.8 * (i % 2), "seed": 300 + i,
               "ignore_eos": True, "num_draft_tokens": 3} for i in range(6)]
    with running_server(target, "--draft", str(draft), "--served-model-name", "ar", "--kv-cache-memory", str(budget),
                        "--max-batch-size", "8", log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        alone = _run(url, bodies, False, together=False)
        burst = _run(url, bodies, True, together=True)
        assert [text for text, _ in burst] == [text for text, _ in alone]
        assert sum(usage.get("preemptions", 0) for _, usage in burst) > 0
        health = httpx.get(url + "/health").json()["models"]["ar"]["kv_pool"]
        assert all(pool["pages"]["used"] == 0 for pool in health.values())


def test_a_causal_context_models_caches_grow_and_its_preempted_requests_resume_as_alone(tmp_path_factory):
    """Nemotron-Labs-Diffusion's causal context (blocks of 8: a page each) on a pool of 12 pages: a
    request's cache starts at its prompt and first block (2 pages) and grows block by block to 6."""
    bodies = [{"prompt": [3 + i, 40 + i, 7], "max_tokens": 40, "temperature": 0.8 * (i % 2), "seed": 400 + i,
               "ignore_eos": True} for i in range(6)]
    with _tight_server(tmp_path_factory, "nemotron_labs_diffusion", 14, pages=12, page_tokens=8) as (url, _):
        alone = _run(url, bodies, False, together=False)
        burst = _run(url, bodies, True, together=True)
        assert [text for text, _ in burst] == [text for text, _ in alone]
        assert sum(usage.get("preemptions", 0) for _, usage in burst) > 0
