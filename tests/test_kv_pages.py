"""The KV pool's page bookkeeping (issue 45, its first stage): pages granted lowest first and never
the trash page, a request that does not fit changes nothing, shared pages free with their last
holder, and a growing row takes the pages right after its own where it can (the tables themselves:
test_kv_pool.py)."""
import random

import pytest
from kstep.runner.kv_pages import TRASH_PAGE, PagePool, PoolFull


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


def test_a_growing_row_takes_the_pages_after_its_last_when_they_are_free():
    pool = PagePool(10, 4)
    assert pool.grant_run(2) == 1 and pool.grant(1) == [3]
    assert pool.grant_after(3, 2) == [4, 5]  # right after: the row stays one run
    assert pool.grant_after(2, 2) == [6, 7]  # 3 is taken: the lowest free ones instead
    with pytest.raises(PoolFull):
        pool.grant_after(7, 3)
    assert pool.num_free == 2 and pool.grant_after(9, 1) == [8]  # past the last page: the lowest
