"""A model's KV pool (issue 45): every decoder's cache lives in storage allocated once, when the model
loads, inside a memory budget (memory_budget.py), so what a busy server holds for its caches is
bounded by construction and a request joins only when its pages are free.

Storage: per layer, keys and values of shape (Hkv_l, slots, hd_l), head-major as a contiguous cache
is, cut into pages of `page_tokens` slots (kv_pages.py keeps the books). A cache of `batch` rows of
`length` slots holds a page table per row (paged_kv.py reads and writes through them): any free
pages will do, so a fragmented pool never makes a request wait while enough pages are free. Pages
are granted as one run where the pool has one and a growing row takes the pages right after its
last where they are free, so most caches are plain strided views; the rest are gathered.
A cache grows by taking pages (no copy); a prefix-cache hit maps the cached pages into its tables.

The pages go back when the cache object is collected (its last holder drops it): nothing can still
read a page that is handed out again. Pages are zeroed the first time they are granted (a masked
slot never written still meets attention's matmul with weight 0, and 0 x NaN would be NaN); after
that they hold an earlier cache's finite values."""
import threading
import weakref

import torch

from kstep.runner import memory_budget
from kstep.runner.kv_pages import PagePool, PoolFull
from kstep.layers.paged_kv import PagedKV

DEFAULT_PAGE_TOKENS = 16


class KVBudgetExceeded(ValueError):
    """A request whose caches are larger than the whole KV pool: it could never run (a 400, not a wait)."""


class KVPool:
    """`num_pages` pages of `page_tokens` slots for layers of `geometry` [(kv heads, head dim), ...]."""

    def __init__(self, geometry: list[tuple[int, int]], num_pages: int, page_tokens: int, device: torch.device,
                 dtype: torch.dtype):
        self.pages = PagePool(num_pages, page_tokens)
        self.geometry, self.device, self.dtype = geometry, device, dtype
        slots = num_pages * page_tokens
        self.storage = [(torch.empty(h, slots, d, device=device, dtype=dtype),
                         torch.empty(h, slots, d, device=device, dtype=dtype)) for h, d in geometry]
        self._zeroed = bytearray(num_pages)  # 1 = zeroed once already
        self.lock = threading.RLock()  # a cache may be collected (its pages released) on another thread
        memory_budget.reserve(self, self.nbytes)
        weakref.finalize(self, memory_budget.release, id(self))

    @classmethod
    def within(cls, budget_bytes: int, geometry: list[tuple[int, int]], page_tokens: int, device: torch.device,
               dtype: torch.dtype, what: str = "the KV pool") -> "KVPool":
        """The largest pool that fits `budget_bytes` (ValueError when not even one page does)."""
        per_page = page_tokens * bytes_per_token(geometry, dtype)
        num_pages = budget_bytes // per_page
        if num_pages < 2:
            raise ValueError(f"{what}: a budget of {budget_bytes} bytes holds {num_pages} pages of {page_tokens} "
                             f"tokens ({per_page} bytes each); it needs at least 2 (--kv-cache-memory)")
        return cls(geometry, num_pages, page_tokens, device, dtype)

    @property
    def page_tokens(self) -> int:
        return self.pages.page_tokens

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * bytes_per_token(self.geometry, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.pages.num_pages * self.page_bytes

    @property
    def capacity_tokens(self) -> int:
        """Slots that can ever be granted (the trash page's are not)."""
        return self.pages.capacity * self.page_tokens

    def usage(self, cached: int = 0) -> dict[str, int]:
        """Pages by state, for metrics and /health: `cached` of the pages in use are a prefix cache's
        (runner/prefix_cache.py), which a request takes back when it needs them."""
        free = self.pages.num_free
        return {"total": self.pages.capacity, "used": self.pages.capacity - free - cached, "cached": cached,
                "free": free}

    def allocate(self, batch: int, length: int) -> PagedKV:
        """A cache of `batch` rows of `length` slots from free pages (PoolFull when too few are free):
        one run of consecutive pages where the pool has one (read as a view), else any pages. Its
        pages go back when it is collected."""
        row_pages = self.pages.pages_for(length)
        with self.lock:
            try:
                first = self.pages.grant_run(batch * row_pages)
                granted = list(range(first, first + batch * row_pages))
            except PoolFull:
                try:
                    granted = self.pages.grant(batch * row_pages)
                except PoolFull as e:
                    raise PoolFull(f"the KV pool ({self.nbytes / 2**20:.1f} MiB, --kv-cache-memory) has not the "
                                   f"pages for {batch} rows of {length} slots free now: {e}") from None
        self._zero_fresh(granted)
        kv = PagedKV(self.storage, self.page_tokens,
                     [granted[r * row_pages:(r + 1) * row_pages] for r in range(batch)], length)
        weakref.finalize(kv, self.release, kv.held)  # the list itself: growth and mapping change it
        return kv

    def grow(self, kv: PagedKV, length: int) -> None:
        """Give every row of `kv` the pages `length` slots need (PoolFull, nothing changed, when too few
        are free): no copy, each row's new pages follow its last one where they are free (it stays a view)."""
        more = self.pages.pages_for(length) - len(kv.tables[0])
        with self.lock:
            if more * kv.batch > self.pages.num_free:
                raise PoolFull(f"the KV pool ({self.nbytes / 2**20:.1f} MiB) has not {more * kv.batch} pages free "
                               f"now to grow {kv.batch} rows to {length} slots ({self.pages.num_free} free)")
            added = [self.pages.grant_after(table[-1], more) for table in kv.tables]
        for table, pages in zip(kv.tables, added):
            table.extend(pages)
            kv.held.extend(pages)
            self._zero_fresh(pages)
        kv.length = length
        kv.reindex()

    def map_shared(self, kv: PagedKV, pages: list[int]) -> None:
        """Every row of `kv` reads its first len(pages) pages from `pages` (a prefix cache's, one more
        holder each) instead of its own (given back): a cached prompt prefix, with no copy."""
        with self.lock:
            for table in kv.tables:
                own = table[:len(pages)]
                self.pages.share(pages)
                self.pages.release(own)
                table[:len(pages)] = pages
                for page in own:
                    kv.held.remove(page)
                kv.held.extend(pages)
        kv.shared_until = max(kv.shared_until, len(pages) * self.page_tokens)
        kv.reindex()

    def hold(self, pages: list[int]) -> None:
        """One more holder for granted `pages` (a prefix cache keeping a request's prompt pages)."""
        with self.lock:
            self.pages.share(pages)

    def release(self, pages: list[int]) -> None:
        """One holder fewer for each of `pages` (a dropped cache's, an evicted cached block's)."""
        with self.lock:
            self.pages.release(pages)

    def view(self, tables: list[list[int]], length: int) -> PagedKV:
        """A cache over pages granted elsewhere (rank 0 of a tensor-parallel group grants the pages
        each rank uses in its own storage), its never-used pages zeroed."""
        self._zero_fresh([page for table in tables for page in table])
        return PagedKV(self.storage, self.page_tokens, [list(t) for t in tables], length)

    def retable(self, kv: PagedKV, tables, length: int) -> None:
        """`kv` (a `view`) over the pages rank 0's cache holds now (it grew, or mapped shared pages)."""
        kv.tables, kv.length = [list(t) for t in tables], length
        self._zero_fresh([page for table in kv.tables for page in table])
        kv.reindex()

    def _zero_fresh(self, pages: list[int]) -> None:
        P = self.page_tokens
        fresh = sorted(page for page in pages if not self._zeroed[page])
        at = 0
        while at < len(fresh):  # one span of consecutive never-used pages at a time
            end = at
            while end + 1 < len(fresh) and fresh[end + 1] == fresh[end] + 1:
                end += 1
            for k, v in self.storage:
                k[:, fresh[at] * P:(fresh[end] + 1) * P].zero_()
                v[:, fresh[at] * P:(fresh[end] + 1) * P].zero_()
            for page in fresh[at:end + 1]:
                self._zeroed[page] = 1
            at = end + 1


def bytes_per_token(geometry: list[tuple[int, int]], dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take over every layer."""
    return 2 * sum(h * d for h, d in geometry) * torch.empty((), dtype=dtype).element_size()


def make_kv_pools(runners: list, device: torch.device, kv_cache_memory: int | str | None = None,
                  memory_utilization: float | None = None) -> None:
    """Each runner's pool (None, or one that has its pool: skipped), made once inside one budget
    (memory_budget.py), each holding as many tokens (a target model and the draft model it loaded)."""
    runners = [r for r in runners if r is not None and r.kv_pool is None]
    per_token = [bytes_per_token(r.model.kv_geometry(), r.dtype) * (1 if r.model.tp is None else r.model.tp.size)
                 for r in runners]
    budget = memory_budget.kv_budget(device, sum(per_token), runners[0].cfg.max_positions, kv_cache_memory,
                                     memory_utilization)
    for runner, share in zip(runners, per_token):
        runner.make_kv_pool(budget * share // sum(per_token))


def pool_for(model, device: torch.device, dtype: torch.dtype, budget_bytes: int | None = None) -> KVPool:
    """A network's pool: `budget_bytes` (else the default budget, memory_budget.py). A block model's
    pages are its blocks, others' DEFAULT_PAGE_TOKENS. Tensor parallel: the budget is the whole model's,
    each rank holding its heads' share (the same pages)."""
    geometry, ranks = model.kv_geometry(), 1 if model.tp is None else model.tp.size
    if budget_bytes is None:
        budget_bytes = memory_budget.kv_budget(device, ranks * bytes_per_token(geometry, dtype), model.cfg.max_positions)
    return KVPool.within(budget_bytes // ranks, geometry, model.cfg.block_size or DEFAULT_PAGE_TOKENS, device, dtype)
