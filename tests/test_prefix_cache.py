"""Prefix caching: shared prompt prefixes are served from cached keys/values, the output is the
same as without the cache, and the cache stays within its budget, evicting leaves LRU."""
import httpx
import torch

import kstep
from kstep.bench.server_process import running_server
from kstep.engine.engine import Engine
from kstep.runner.prefix_cache import PrefixCache
from kstep.engine.request import Request
from kstep.params import GenerationParams

HEADER = "# A shared header that many requests start with.\nimport os\nimport sys\n\n" * 3


def run_all(engine: Engine, prompts: list[list[int]], **params) -> list[list[int]]:
    requests = [Request([p], GenerationParams(max_tokens=12, **params)) for p in prompts]
    texts = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        outputs, _ = engine.step()
        for out in outputs:
            for c in out.choices:
                texts[out.request_id] += c.token_ids
    return [texts[r.request_id] for r in requests]


def test_shared_prefix_is_reused_and_output_unchanged(llama_path):
    llm = kstep.load(llama_path)
    prompts = [llm.encode_prompt(HEADER + tail) for tail in ("def a():", "def b(x):", "class C:", "x = 1")]
    plain = run_all(Engine(llm), prompts)
    cached_engine = Engine(llm, prefix_cache_bytes=64 << 20)
    first = run_all(cached_engine, prompts[:1])
    rest = run_all(cached_engine, prompts[1:])
    assert first + rest == plain
    cache = cached_engine.prefix_cache
    shared = len(llm.encode_prompt(HEADER)) // cache.block_size * cache.block_size
    assert cache.hit_tokens >= 3 * (shared - cache.block_size)  # the later requests found the header
    again = run_all(cached_engine, prompts[:1])
    assert again == plain[:1]  # a full hit still recomputes the last token for its logits


def test_budget_evicts_least_recently_used_leaves_and_blocks_are_pages_mapped_not_copied(llama_path):
    llm = kstep.load(llama_path)
    kv = llm.runner.allocate_kv(1, 64)
    for layer in range(kv.num_layers):
        k, v = kv.read(layer, 0, 64)
        kv.write(layer, torch.randn_like(k), torch.randn_like(v), 0)
    pool = llm.runner.kv_pool
    cache = PrefixCache(budget_bytes=10**9, block_size=16, pool=pool)
    cache.store(list(range(48)), kv)  # 3 blocks in a chain: kv's first 3 pages, one more holder each
    assert [pool.pages.holders(p) for p in kv.tables[0]] == [2, 2, 2, 1] and cache.only_held_pages() == 0
    cache.budget = 2 * pool.page_bytes
    cache.store(list(range(100, 116)), llm.runner.allocate_kv(1, 16))  # a new root block: over budget -> a leaf goes
    assert cache.nbytes <= cache.budget and len(cache.blocks) == 2
    target = llm.runner.allocate_kv(1, 64)
    assert cache.load(list(range(48)), target, 48) == 16  # the chain's first block survived (it was a parent)
    assert target.tables[0][0] == kv.tables[0][0] and target.shared_until == 16  # its page, mapped
    assert torch.equal(target.read(1, 0, 16)[0], kv.read(1, 0, 16)[0])


def test_server_reports_prefix_hits(llama_path):
    with running_server(llama_path, "--served-model-name", "tiny") as (url, _):
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
        a = httpx.post(url + "/v1/completions", json={**body, "prompt": HEADER + "def a():"}).json()
        b = httpx.post(url + "/v1/completions", json={**body, "prompt": HEADER + "def b():"}).json()
        assert a["choices"] and b["choices"]
        metrics = httpx.get(url + "/metrics").text
        hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith('kstep_prefix_cache_hit_tokens{model="tiny"} '))
        assert hits > 0


def test_cached_blocks_are_pages_of_the_pool_that_requests_take_back(llama_path):
    """The prefix cache keeps its blocks in the model's KV pool (one budget): they hold pages while no
    request needs them, and a request that finds the pool short evicts them (least recently used
    first) instead of waiting; outputs are as without the cache."""
    from kstep.runner.kv_pool import bytes_per_token
    probe = kstep.load(llama_path)
    slot = bytes_per_token(probe.model.kv_geometry(), probe.runner.dtype)
    llm = kstep.load(llama_path, kv_cache_memory=15 * 16 * slot)  # 14 pages of 16 and the trash page
    pool = llm.runner.kv_pool
    header = llm.encode_prompt(HEADER)[:96]  # 6 blocks of 16
    engine = Engine(llm, prefix_cache_bytes=64 << 20)
    run_all(engine, [header + [5]])
    cache = engine.prefix_cache
    assert len(cache.blocks) == 6 and pool.pages.capacity - pool.pages.num_free == 6  # the blocks' pages, held
    long_prompt = [7 + i % 50 for i in range(150)]  # 150 + 12 slots: 11 pages, only 8 of them free
    header_blocks = set(cache.blocks)
    [got] = run_all(engine, [long_prompt])
    kept = len(header_blocks & set(cache.blocks))
    assert kept < 6  # evicted to make room, the request admitted at once
    assert len(cache.blocks) - kept == 150 // 16  # and its own prompt's blocks kept: its pages, held on
    assert got == run_all(Engine(probe), [long_prompt])[0]
