"""A decoder's KV cache that grows with its output, page by page of the model's pool
(runner/kv_pool.py): the AR decoder's, the speculative decoder's (target and draft model) and the
block-diffusion decoders'.

It starts with what the prompt and a first stretch of output need; when a pass needs more slots,
its rows take the pages those need (no copy: the pages join the rows' page tables), so a request
that stops early never held its max_tokens' slots. A request whose whole cache could never fit the
pool is refused when it is made (KVBudgetExceeded); a cache that cannot grow now raises PoolFull
with nothing changed (the engine preempts a request and asks again)."""
from kstep.layers.attention import KVCache
from kstep.runner.model_runner import ModelRunner


FIRST_GROWTH = 16  # completion slots a cache starts with (then a page at a time as it fills)


class GrowingCache:
    def __init__(self, runner: ModelRunner, batch: int, most: int):
        """`batch` rows; `most` the slots it may ever need."""
        self.runner, self.batch, self.most = runner, batch, most
        self.pool = runner.check_kv_fits(batch, most)

    def whole_pages(self, slots: int) -> int:
        """`slots` rounded up to whole pages, at most `most`."""
        return min(self.most, self.pool.pages.pages_for(slots) * self.pool.page_tokens)

    def room(self, kv: KVCache | None, slots: int) -> KVCache:
        """A cache of at least `slots` slots: `kv`, grown when it has fewer (a new one when it has
        none: after an eviction)."""
        if kv is None:
            return self.runner.allocate_kv(self.batch, self.whole_pages(slots))
        if kv.length >= slots:
            return kv
        return self.runner.grow_kv(kv, self.whole_pages(slots))
