"""A model's KV pool (issue 45): every decoder's cache lives in storage allocated once, when the model
loads, inside a memory budget (memory_budget.py), so what a busy server holds for its caches is
bounded by construction and a request joins only when its pages are free.

Storage: per layer, keys and values of shape (Hkv_l, slots, hd_l), head-major as a contiguous cache
is, cut into pages of `page_tokens` slots (kv_pages.py keeps the books). A cache of `batch` rows of
`length` slots is granted as one run of consecutive pages, row after row, so each layer's cache is a
plain strided view (batch, Hkv, length, hd) of the storage: attention, the CPU decode kernel, the
prefix cache and self-speculation's row copies read and write it as they did a cache of their own,
with no gather and no copy. A run needs consecutive free pages: a pool with enough pages free but
none in a run waits for one to free up (fragmentation costs admission, never memory or correctness).

The pages go back when the cache object is collected (its last holder drops it): nothing can still
read a page that is handed out again. Pages are zeroed the first time they are granted (a masked
slot never written still meets attention's matmul with weight 0, and 0 x NaN would be NaN); after
that they hold an earlier cache's finite values."""
import threading
import weakref

import torch

from kstep.runner import memory_budget
from kstep.runner.kv_pages import PagePool, PoolFull

DEFAULT_PAGE_TOKENS = 16


class KVBudgetExceeded(ValueError):
    """A request whose caches are larger than the whole KV pool: it could never run (a 400, not a wait)."""


class PagedKV(list):
    """One cache: per layer (keys, values), each a (batch, Hkv, length, hd) view of the pool's storage;
    `first_page` where its run starts (a tensor-parallel rank places its own at the same pages)."""
    batch: int
    length: int
    first_page: int
    num_pages: int


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
        self._lock = threading.Lock()
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
    def nbytes(self) -> int:
        return self.pages.num_pages * self.page_tokens * bytes_per_token(self.geometry, self.dtype)

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
        """A cache of `batch` rows of `length` slots from free pages (PoolFull when no run of them is
        free); its pages go back when it is collected."""
        row_pages = self.pages.pages_for(length)
        with self._lock:
            try:
                first = self.pages.grant_run(batch * row_pages)
            except PoolFull as e:
                raise PoolFull(f"the KV pool ({self.nbytes / 2**20:.1f} MiB, --kv-cache-memory) has not the pages for "
                               f"{batch} rows of {length} slots free now: {e}") from None
        kv = self.views_at(first, batch, length)
        weakref.finalize(kv, self._release, range(first, first + batch * row_pages))
        return kv

    def _release(self, pages: range) -> None:
        with self._lock:  # a cache may be collected on another thread than the engine's
            self.pages.release(pages)

    def views_at(self, first_page: int, batch: int, length: int) -> PagedKV:
        """The cache whose run starts at `first_page` (granted here, or by rank 0 of a tensor-parallel
        group for this rank's own storage), its never-used pages zeroed."""
        P, row_pages = self.page_tokens, self.pages.pages_for(length)
        start, stop = first_page * P, (first_page + batch * row_pages) * P
        self._zero_fresh(first_page, batch * row_pages)
        kv = PagedKV((k[:, start:stop].view(k.shape[0], batch, row_pages * P, k.shape[2]).transpose(0, 1)[:, :, :length],
                      v[:, start:stop].view(v.shape[0], batch, row_pages * P, v.shape[2]).transpose(0, 1)[:, :, :length])
                     for k, v in self.storage)
        kv.batch, kv.length, kv.first_page, kv.num_pages = batch, length, first_page, batch * row_pages
        return kv

    def _zero_fresh(self, first_page: int, num_pages: int) -> None:
        P, page = self.page_tokens, first_page
        while page < first_page + num_pages:
            if self._zeroed[page]:
                page += 1
                continue
            end = page
            while end < first_page + num_pages and not self._zeroed[end]:
                self._zeroed[end] = 1
                end += 1
            for k, v in self.storage:  # one span of never-used pages at a time
                k[:, page * P:end * P].zero_()
                v[:, page * P:end * P].zero_()
            page = end


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


def copy_rows(src: PagedKV, dst: PagedKV, src_rows: list[int], dst_rows: list[int]) -> None:
    """Rows of one cache into rows of another, every layer, the slots both have."""
    for (k, v), (dk, dv) in zip(src, dst):
        n = min(k.shape[2], dk.shape[2])
        dk[dst_rows, :, :n] = k[src_rows, :, :n]
        dv[dst_rows, :, :n] = v[src_rows, :, :n]
