"""The KV pool's page bookkeeping (issue 45, its first stage): pages granted lowest first and never
the trash page, a request that does not fit changes nothing, shared pages free with their last
holder, and a row's table maps logical slots to physical ones (the trash page's past its pages; a
view where its pages are consecutive)."""
import random

import pytest
import torch

from kstep.runner.kv_pages import TRASH_PAGE, PagePool, PageTable, PoolFull


def test_pages_are_granted_lowest_first_never_the_trash_page_and_freed_again():
    pool = PagePool(6, 16)
    assert pool.num_free == 5 and pool.pages_for(33) == 3 and pool.pages_for(32) == 2
    first = pool.grant(3)
    assert first == [1, 2, 3] and TRASH_PAGE not in first and pool.num_free == 2
    with pytest.raises(PoolFull, match="3 pages asked for, 2 free of 5"):
        pool.grant(3)
    assert pool.num_free == 2  # a refused grant takes nothing
    pool.release([2])
    assert pool.grant(2) == [2, 4]
    pool.release(first[:1] + first[2:] + [2, 4])
    assert pool.num_free == 5


def test_a_shared_page_is_free_once_its_last_holder_lets_go():
    pool = PagePool(4, 8)
    [page] = pool.grant(1)
    pool.share([page])
    pool.release([page])
    assert pool.holders(page) == 1 and pool.num_free == 2
    pool.release([page])
    assert pool.holders(page) == 0 and pool.num_free == 3
    with pytest.raises(RuntimeError, match="not granted"):
        pool.release([page])
    with pytest.raises(RuntimeError, match="not granted"):
        pool.share([TRASH_PAGE])


def test_random_grants_and_releases_never_hand_out_a_held_page():
    rng, pool, held = random.Random(0), PagePool(64, 4), []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or pool.num_free == 0):
            pool.release([held.pop(rng.randrange(len(held)))])
        else:
            n = rng.randint(1, 5)
            try:
                pages = pool.grant(n)
            except PoolFull:
                assert n > pool.num_free
                continue
            assert not set(pages) & set(held) and TRASH_PAGE not in pages
            held += pages
        assert pool.num_free + len(held) == 63 and sorted(set(held)) == sorted(held)


def test_a_rows_table_maps_logical_slots_to_physical_ones():
    table = PageTable(4, [7, 2, 3])
    assert table.num_slots == 12
    assert table.slots(2, 10).tolist() == [30, 31, 8, 9, 10, 11, 12, 13]
    assert table.slots(11, 14).tolist() == [15, 0 * 4 + 0, 0 * 4 + 1]  # past its pages: the trash page
    assert table.run(4, 12) == (8, 16)  # pages 2, 3: one view
    assert table.run(2, 6) is None and table.run(10, 13) is None  # pages 7 then 2; past the pages
    storage = torch.arange(40)
    start, stop = table.run(5, 11)
    assert torch.equal(storage[start:stop], storage[table.slots(5, 11)])
