"""The KV pool (issue 45): a model's caches are views of storage made once inside a budget; a cache's
pages go back when it is dropped and are handed out again (holding an earlier request's values, which
nothing may read as its own); a request larger than the whole pool is refused by name, one that does
not fit now gets PoolFull (the engine admits it later). Generating on a pool so small that every
request reuses the last one's pages gives the same tokens as a large pool, for every kind of cache."""
import gc
import subprocess
import sys

import pytest
import torch

import kstep
from kstep.random_checkpoint import write_random_checkpoint
from kstep.runner.kv_pages import PoolFull
from kstep.runner.kv_pool import KVBudgetExceeded, KVPool, bytes_per_token
from kstep.runner.memory_budget import kv_budget, memory_left, parse_size

GEOMETRY = [(2, 4), (1, 8)]  # two layers of their own shapes, as DiffusionGemma's


def test_a_cache_is_a_view_of_the_pool_and_its_pages_come_back_when_dropped():
    pool = KVPool(GEOMETRY, num_pages=9, page_tokens=4, device=torch.device("cpu"), dtype=torch.float32)
    assert pool.nbytes == 9 * 4 * bytes_per_token(GEOMETRY, torch.float32) == 9 * 4 * 2 * (8 + 8) * 4
    a = pool.allocate(2, 6)  # 2 rows x 2 pages
    assert [tuple(k.shape) for k, _ in a] == [(2, 2, 6, 4), (2, 1, 6, 8)]
    assert all(bool((t == 0).all()) for layer in a for t in layer)  # fresh pages are zeroed
    a[0][0][1, 1, 5] = 7.0  # written through the view: lands in the pool's storage
    assert int((pool.storage[0][0] == 7.0).sum()) == 4
    b = pool.allocate(1, 16)
    assert pool.usage() == {"total": 8, "used": 8, "cached": 0, "free": 0}
    b[1][1].fill_(1.0)
    assert int((a[1][1] == 1.0).sum()) == 0  # caches never share a slot
    with pytest.raises(PoolFull, match="has not the pages for 1 rows of 1 slots"):
        pool.allocate(1, 1)
    del a
    gc.collect()
    assert pool.usage()["free"] == 4
    c = pool.allocate(1, 16)  # the freed pages again, with the last holder's values still in them
    assert int((c[0][0][0, 1, 13] == 7.0).sum()) == 4


def test_a_run_of_free_pages_is_needed_and_the_pool_stays_consistent_under_churn():
    pool = KVPool(GEOMETRY, num_pages=11, page_tokens=2, device=torch.device("cpu"), dtype=torch.float32)
    held = [pool.allocate(1, 4) for _ in range(5)]  # pages 1-2, 3-4, ..., 9-10
    del held[1], held[3]
    gc.collect()
    assert pool.usage()["free"] == 4
    with pytest.raises(PoolFull, match="not consecutive"):
        pool.allocate(1, 8)
    for _ in range(200):  # many grants and drops (a dropped cache's pages go back at once: no cycle holds it)
        try:
            held.append(pool.allocate(1, 2 * (len(held) % 3 + 1)))
        except PoolFull:
            held.pop(0)
        assert pool.usage()["used"] == sum(kv.num_pages for kv in held)


def test_a_budget_is_parsed_and_kept(tmp_path):
    assert parse_size("2GiB") == 2 << 30 and parse_size("512 MiB") == 512 << 20 and parse_size("1e9") == 10 ** 9
    for bad in ("", "2x", "-1GiB", "0"):
        with pytest.raises(ValueError, match="--kv-cache-memory"):
            parse_size(bad)
    pool = KVPool.within(100_000, GEOMETRY, 4, torch.device("cpu"), torch.float32)
    assert pool.nbytes <= 100_000 < pool.nbytes + 4 * bytes_per_token(GEOMETRY, torch.float32)
    with pytest.raises(ValueError, match="at least 2"):
        KVPool.within(1000, GEOMETRY, 4, torch.device("cpu"), torch.float32)
    cpu = torch.device("cpu")
    assert kv_budget(cpu, 1000, 64) <= 32 * 64 * 1000  # the default: a few whole contexts of a tiny model
    assert kv_budget(cpu, 1000, 10 ** 9, memory_utilization=0.25) <= memory_left(cpu) * 0.25 + 1
    with pytest.raises(ValueError, match="give one"):
        kv_budget(cpu, 1000, 64, "1GiB", 0.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: write_random_checkpoint(tmp_path_factory.mktemp(family), family=family, seed=7)
            for family in ("qwen2", "llada", "sdar", "diffusion_gemma")}


CASES = [("qwen2", {}), ("llada", {"cache": "dual"}), ("llada", {"cache": "prefix", "draft": "self"}),
         ("sdar", {}), ("diffusion_gemma", {})]


@pytest.mark.parametrize("family,knobs", CASES, ids=[f"{f}-{'-'.join(k.values()) or 'default'}" for f, k in CASES])
def test_pages_reused_from_earlier_requests_change_no_token(checkpoints, family, knobs):
    roomy = kstep.load(checkpoints[family], kv_cache_memory="64MiB")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    want = [r.token_ids for r in roomy.generate(prompts, max_tokens=24, seed=3, **knobs)]
    slot = bytes_per_token(roomy.model.kv_geometry(), roomy.runner.dtype)
    # a small pool: the second call reuses the (dirty) pages the first one wrote
    tight = kstep.load(checkpoints[family], kv_cache_memory=slot * 8 * 64)
    for _ in range(2):
        assert [r.token_ids for r in tight.generate(prompts, max_tokens=24, seed=3, **knobs)] == want
    with pytest.raises(KVBudgetExceeded, match="KV pool holds"):
        tight.generate([[5, 6]] * 64, max_tokens=24, **knobs)


def test_an_address_space_limit_bounds_the_default_budget():
    """`ulimit -v` (RLIMIT_AS), set for real in a child process, caps what the default pool may take."""
    code = """
import resource, torch
from kstep.runner import memory_budget
mapped = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
left = memory_budget.memory_left(torch.device('cpu'))
budget = memory_budget.kv_budget(torch.device('cpu'), 1000, 10 ** 9)
print(left, budget)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    left, budget = map(int, run.stdout.split())
    assert 0 < left <= 1 << 30 and budget <= left // 2
