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
from kstep.layers.paged_kv import PagedKV
from kstep.random_checkpoint import write_random_checkpoint
from kstep.runner.kv_pages import PoolFull
from kstep.runner.kv_pool import KVBudgetExceeded, KVPool, bytes_per_token
from kstep.runner.memory_budget import kv_budget, memory_left, parse_size

GEOMETRY = [(2, 4), (1, 8)]  # two layers of their own shapes, as DiffusionGemma's


def _written(kv, layer: int, seed: int):
    """Writes random keys/values into every slot of kv's layer (through its tables); returns them."""
    g = torch.Generator().manual_seed(seed)
    h, d = GEOMETRY[layer]
    k, v = (torch.randn(kv.batch, h, kv.length, d, generator=g) for _ in range(2))
    kv.write(layer, k, v, 0)
    return k, v


def test_a_cache_is_a_view_of_the_pool_and_its_pages_come_back_when_dropped():
    pool = KVPool(GEOMETRY, num_pages=9, page_tokens=4, device=torch.device("cpu"), dtype=torch.float32)
    assert pool.nbytes == 9 * 4 * bytes_per_token(GEOMETRY, torch.float32) == 9 * 4 * 2 * (8 + 8) * 4
    a = pool.allocate(2, 6)  # 2 rows x 2 pages, granted at once: one run, read as views
    assert a.is_view and a.tables == [[1, 2], [3, 4]]
    assert [tuple(a.layer(i)[0].shape) for i in range(2)] == [(2, 2, 6, 4), (2, 1, 6, 8)]
    assert all(bool((t == 0).all()) for i in range(2) for t in a.read(i, 0, 6))  # fresh pages are zeroed
    a.layer(0)[0][1, 1, 5] = 7.0  # written through the view: lands in the pool's storage
    assert int((pool.storage[0][0] == 7.0).sum()) == 4
    b = pool.allocate(1, 16)
    assert pool.usage() == {"total": 8, "used": 8, "cached": 0, "free": 0}
    _written(b, 1, seed=0)
    assert int((a.read(1, 0, 6)[1] != 0).sum()) == 0  # caches never share a slot
    with pytest.raises(PoolFull, match="has not the pages for 1 rows of 1 slots"):
        pool.allocate(1, 1)
    del a
    gc.collect()
    assert pool.usage()["free"] == 4
    c = pool.allocate(1, 16)  # the freed pages again, with the last holder's values still in them
    assert int((c.read(0, 0, 16)[0][0, 1, 13] == 7.0).sum()) == 4


def test_a_fragmented_pool_still_grants_and_a_cache_reads_its_tables_as_a_view_would():
    pool = KVPool(GEOMETRY, num_pages=11, page_tokens=2, device=torch.device("cpu"), dtype=torch.float32)
    held = [pool.allocate(1, 4) for _ in range(5)]  # pages 1-2, 3-4, ..., 9-10
    del held[1], held[2]
    gc.collect()
    kv = pool.allocate(1, 7)  # 4 pages free, none 4 in a run: granted anyway, through its table
    assert not kv.is_view and kv.tables == [[3, 4, 7, 8]]
    for layer in range(2):
        k, v = _written(kv, layer, seed=layer)
        got_k, got_v = kv.read(layer, 1, 6)
        assert torch.equal(got_k, k[:, :, 1:6]) and torch.equal(got_v, v[:, :, 1:6])
        kv.write_at(layer, k[:, :, :2] + 1, v[:, :, :2] + 1, torch.tensor([[5, 0]]))  # a row's own slots
        assert torch.equal(kv.read(layer, 5, 6)[0], k[:, :, :1] + 1)
        assert torch.equal(kv.read(layer, 0, 1)[1], v[:, :, 1:2] + 1)
    del kv
    gc.collect()
    rows = pool.allocate(2, 3)  # rows in runs equally far apart ([3, 4], [7, 8]) are one strided view
    assert rows.is_view and rows.tables == [[3, 4], [7, 8]]
    k, v = _written(rows, 0, seed=2)
    assert torch.equal(pool.storage[0][0][:, 14:17], k[1])
    kv = rows
    with pytest.raises(PoolFull):
        pool.allocate(1, 1)
    for _ in range(200):  # many grants and drops (a dropped cache's pages go back at once: no cycle holds it)
        try:
            held.append(pool.allocate(1, 2 * (len(held) % 3 + 1)))
        except PoolFull:
            held.pop(0)
        assert pool.usage()["used"] == sum(c.num_pages for c in held) + kv.num_pages


def test_a_cache_grows_by_taking_pages_without_moving_and_shared_pages_are_read_only():
    pool = KVPool(GEOMETRY, num_pages=12, page_tokens=2, device=torch.device("cpu"), dtype=torch.float32)
    kv = pool.allocate(1, 3)
    k, _ = _written(kv, 0, seed=1)
    pool.grow(kv, 6)  # the pages right after its last are free: it stays one run
    assert kv.tables == [[1, 2, 3]] and kv.is_view and torch.equal(kv.read(0, 0, 3)[0], k)
    blocker = pool.allocate(1, 2)  # page 4
    pool.grow(kv, 9)  # page 4 taken: the next free ones, read through the tables
    assert kv.tables == [[1, 2, 3, 5, 6]] and not kv.is_view and torch.equal(kv.read(0, 0, 3)[0], k)
    with pytest.raises(PoolFull):
        pool.grow(kv, 40)
    assert kv.length == 9 and pool.usage()["used"] == 6  # nothing changed
    other = pool.allocate(1, 6)
    pool.hold([1, 2])  # a prefix cache keeps the first 4 slots' pages...
    pool.map_shared(other, [1, 2])  # ...and another cache maps them: its own first pages go back
    assert other.tables[0][:2] == [1, 2] and torch.equal(other.read(0, 0, 3)[0], k)
    with pytest.raises(RuntimeError, match="shared pages"):
        other.write(0, k[:, :, :1], k[:, :, :1], 3)
    del kv, other, blocker
    gc.collect()
    assert pool.usage()["used"] == 2 and pool.pages.holders(1) == 1  # the prefix cache's hold remains
    pool.release([1, 2])
    assert pool.usage()["free"] == 11


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


@pytest.mark.parametrize("family,knobs", CASES, ids=[f"{f}-{'-'.join(k.values()) or 'default'}" for f, k in CASES])
def test_a_fragmented_pool_changes_no_token(checkpoints, family, knobs, monkeypatch):
    """Every other page of the pool held elsewhere: the caches are granted scattered pages, read
    through their tables (gathered, not views), and give the tokens of a roomy pool."""
    roomy = kstep.load(checkpoints[family], kv_cache_memory="64MiB")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    want = [r.token_ids for r in roomy.generate(prompts, max_tokens=24, seed=3, **knobs)]
    llm = kstep.load(checkpoints[family], kv_cache_memory="4MiB")
    pool = llm.runner.kv_pool
    singles = [pool.allocate(1, 1) for _ in range(pool.pages.capacity)]
    del singles[::2]
    gathered = []
    read = PagedKV.read
    monkeypatch.setattr(PagedKV, "read", lambda kv, *a: gathered.append(not kv.is_view) or read(kv, *a))
    assert [r.token_ids for r in llm.generate(prompts, max_tokens=24, seed=3, **knobs)] == want
    assert any(gathered)


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
