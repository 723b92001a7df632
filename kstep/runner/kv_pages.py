"""The bookkeeping of a model's KV pool in fixed pages (issue 45): which pages are free, how many
holders each granted page has (a prompt's pages shared by the prefix cache and the requests that
map them). Plain Python: the storage and the caches' page tables are runner/kv_pool.py's and
runner/paged_kv.py's.

Page 0 is never granted (the trash page, kept so that a page id of 0 is never a cache's). Free pages
are handed out lowest first, so a cache granted pages at once usually holds a consecutive run, which
attention reads as a view instead of a gather; `grant_run` asks for a run outright (the first that
fits), `grant_after` extends one."""
TRASH_PAGE = 0


class PoolFull(Exception):
    """Fewer free pages than asked for: the caller admits later, or preempts."""


class PagePool:
    """`num_pages` pages of `page_tokens` slots each; page 0 is the trash page (module note)."""

    def __init__(self, num_pages: int, page_tokens: int):
        if num_pages < 2 or page_tokens < 1:
            raise ValueError(f"a page pool needs at least 2 pages (one is the trash page) of at least 1 token, "
                             f"got {num_pages} pages of {page_tokens}")
        self.num_pages, self.page_tokens = num_pages, page_tokens
        # one byte per page, 1 = free: finding the lowest free page, or the first run of n, is a bytes search
        self._is_free = bytearray(b"\x01") * num_pages
        self._is_free[TRASH_PAGE] = 0
        self._num_free = num_pages - 1
        self._holders = [0] * num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def capacity(self) -> int:
        """Pages that can ever be granted (all but the trash page)."""
        return self.num_pages - 1

    def pages_for(self, num_slots: int) -> int:
        """Pages that hold `num_slots` logical slots."""
        return -(-num_slots // self.page_tokens)

    def grant(self, num_pages: int) -> list[int]:
        """`num_pages` free pages, lowest first, each with one holder; PoolFull (nothing granted) if
        fewer are free."""
        if num_pages > self._num_free:
            raise PoolFull(f"{num_pages} pages asked for, {self._num_free} free of {self.capacity}")
        pages, at = [], 0
        for _ in range(num_pages):
            at = self._is_free.find(1, at + 1)
            pages.append(at)
        self._take(pages)
        return pages

    def grant_run(self, num_pages: int) -> int:
        """The first page of the lowest run of `num_pages` consecutive free pages, each granted with one
        holder; PoolFull (nothing granted) when no run is free, though as many pages may be."""
        at = self._is_free.find(b"\x01" * num_pages, 1) if 0 < num_pages <= self._num_free else -1
        if at < 0:
            raise PoolFull(f"{num_pages} consecutive pages asked for, {self._num_free} free of {self.capacity}"
                           + (" (not consecutive)" if num_pages <= self._num_free else ""))
        self._take(range(at, at + num_pages))
        return at

    def grant_after(self, page: int, num_pages: int) -> list[int]:
        """`num_pages` free pages, those right after `page` when they are all free (a growing row stays
        one run), else the lowest; PoolFull (nothing granted) if fewer are free."""
        after = range(page + 1, page + 1 + num_pages)
        if num_pages and after.stop <= self.num_pages and all(self._is_free[p] for p in after):
            self._take(after)
            return list(after)
        return self.grant(num_pages)

    def _take(self, pages) -> None:
        for page in pages:
            self._is_free[page], self._holders[page] = 0, 1
        self._num_free -= len(pages)

    def share(self, pages: list[int]) -> None:
        """One more holder for each of `pages` (granted ones)."""
        self._check_granted(pages)
        for page in pages:
            self._holders[page] += 1

    def release(self, pages) -> None:
        """One holder fewer for each of `pages`; a page with none left is free again."""
        self._check_granted(pages)
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._is_free[page] = 1
                self._num_free += 1

    def holders(self, page: int) -> int:
        return self._holders[page]

    def _check_granted(self, pages: list[int]) -> None:
        idle = [page for page in pages if page == TRASH_PAGE or not 0 < page < self.num_pages
                or self._holders[page] == 0]
        if idle:
            raise RuntimeError(f"internal: pages {idle} are not granted")
