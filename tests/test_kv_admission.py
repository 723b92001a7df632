"""Admission by KV pages through a real `kstep serve` (issue 45): with a pool that holds about two
requests, a burst of eight runs at most two at a time though the batch could take sixteen, every
output equal to the request alone; a request whose caches exceed the whole pool is a 400 naming the
budget, streamed or not, and the server goes on; /health and /metrics show the pool."""
import asyncio

import httpx
import openai
import pytest
from test_server import client, metric

import kstep
from kstep.bench.server_process import running_server
from kstep.random_checkpoint import write_random_checkpoint
from kstep.runner.kv_pool import bytes_per_token

PROMPTS = [[3 + i, 40 + i, 7, 9 + 2 * i] for i in range(8)]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: write_random_checkpoint(tmp_path_factory.mktemp(name), family=family, seed=11)
            for name, family in (("ar", "qwen2"), ("block", "sdar"))}


@pytest.fixture(scope="module")
def alone(models):
    return {name: kstep.load(path) for name, path in models.items()}


@pytest.fixture(scope="module")
def tight_server(models, alone, tmp_path_factory):
    """Both models, each with a pool of 5 pages of 16 tokens (the sdar block model's are its blocks: 4 per
    page of its own); one request needs 2 pages (4 + 20 tokens) on the AR model."""
    ar = alone["ar"].runner
    budget = 6 * 16 * bytes_per_token(ar.model.kv_geometry(), ar.dtype)  # 5 pages and the trash page
    args = ["--model", f"block={models['block']}", "--max-batch-size", "16", "--kv-cache-memory", str(budget)]
    with running_server(f"ar={models['ar']}", *args, log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


def _burst(url: str, model: str) -> list[str]:
    async def run():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        jobs = [c.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0) for p in PROMPTS]
        return [r.choices[0].text for r in await asyncio.gather(*jobs)]
    return asyncio.run(run())


def test_a_burst_runs_as_the_pool_allows_each_output_as_alone(tight_server, alone):
    got = _burst(tight_server, "ar")
    assert got == [r.text for r in alone["ar"].generate(PROMPTS, max_tokens=MAX_TOKENS)]
    steps = metric(tight_server, "kstep_batch_size_count", 'model="ar"')
    assert steps >= 4 * MAX_TOKENS  # eight requests, at most two at a time: four rounds of their passes at least
    assert metric(tight_server, "kstep_batch_size_bucket", 'model="ar",le="2.0"') == steps
    assert metric(tight_server, "kstep_queue_seconds_count", 'model="ar"') == len(PROMPTS)
    health = httpx.get(tight_server + "/health").json()["models"]["ar"]["kv_pool"]["model"]
    assert health["pages"] == {"total": 5, "used": 0, "cached": 0, "free": 5} and health["page_tokens"] == 16
    assert metric(tight_server, "kstep_kv_pool_pages", 'model="ar",state="total"') == 5


def test_a_block_model_waits_for_pages_too(tight_server, alone):
    got = _burst(tight_server, "block")
    assert got == [r.text for r in alone["block"].generate(PROMPTS, max_tokens=MAX_TOKENS)]
    assert metric(tight_server, "kstep_kv_pool_pages", 'model="block",state="used"') == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_larger_than_the_whole_pool_is_a_400_naming_the_budget(tight_server, stream):
    c = client(tight_server)
    with pytest.raises(openai.BadRequestError) as e:
        out = c.completions.create(model="ar", prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=stream)
        list(out) if stream else None
    assert "--kv-cache-memory" in str(e.value) and e.value.body["code"] == "kv_budget_exceeded"
    with pytest.raises(openai.BadRequestError, match="KV pool"):  # n rows of it: the same
        c.completions.create(model="ar", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, n=4, temperature=0)
    fine = c.completions.create(model="ar", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert fine.choices[0].finish_reason in ("stop", "length")
