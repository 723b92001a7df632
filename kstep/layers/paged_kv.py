"""One cache in a model's KV pool (kstep/runner/kv_pool.py), read and written through its page tables.

A cache has `batch` rows of `length` logical slots; row r's slot s lives at physical slot
tables[r][s // P] * P + s % P of the pool's per-layer storage (heads, slots, head dim). Attention
asks for a layer's keys and values over a range of logical slots and writes a pass's keys at logical
slots: the cache turns both into the physical slots.

Reading: when every row's pages are consecutive and the rows lie equally far apart (a cache granted
at once from a pool that is not fragmented, the common case), a layer's slots are one strided view of
the storage (no copy, and the CPU decode kernel walks it in place); otherwise they are gathered
(index_select over the slots read: one copy of what the pass attends to, measured in
docs/architecture.md). Writing is a slice assignment into the view, or an index_copy_ into the
storage. A cache changes its tables only between passes (growth appends pages, a prefix-cache hit
maps shared pages), and recomputes its index then.

Pages another holder shares (a prefix cache's blocks, kstep/runner/prefix_cache.py) are only read: a write
below `shared_until` is a bug and raises."""
import torch


class PagedKV:
    def __init__(self, storage: list[tuple[torch.Tensor, torch.Tensor]], page_tokens: int, tables: list[list[int]],
                 length: int):
        self.storage, self.page_tokens, self.tables, self.length = storage, page_tokens, tables, length
        self.held: list[int] = [page for table in tables for page in table]  # one holder each (released on collection)
        self.shared_until = 0  # logical slots [0, shared_until) of every row are shared pages
        self.reindex()

    @classmethod
    def of_its_own(cls, geometry: list[tuple[int, int]], batch: int, length: int, device: torch.device,
                   dtype: torch.dtype) -> "PagedKV":
        """A zeroed cache in storage of its own (a page a row), for a network called alone (training,
        the references' checks): the same cache a runner's decoders take from its pool."""
        storage = [(torch.zeros(h, batch * length, d, device=device, dtype=dtype),
                    torch.zeros(h, batch * length, d, device=device, dtype=dtype)) for h, d in geometry]
        return cls(storage, max(1, length), [[row] for row in range(batch)], length)

    @property
    def batch(self) -> int:
        return len(self.tables)

    @property
    def num_pages(self) -> int:
        return len(self.held)

    @property
    def num_layers(self) -> int:
        return len(self.storage)

    @property
    def is_view(self) -> bool:
        """Its layers are strided views of the storage (no gather to read them)."""
        return self._views is not None

    def reindex(self) -> None:
        """Rebuild the physical slot index (and the views, where the tables allow) after the tables changed."""
        P, device = self.page_tokens, self.storage[0][0].device
        pages = torch.tensor(self.tables, dtype=torch.long)  # (b, pages a row)
        slots = (pages[:, :, None] * P + torch.arange(P)).view(self.batch, -1)[:, :self.length].contiguous()
        self.slots = slots.to(device)  # (b, length) physical slot of each logical one
        self._flat: dict[tuple[int, int], torch.Tensor] = {}
        self._views = self._strided_views(pages)

    def _strided_views(self, pages: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        first = pages[:, 0]
        runs = bool((pages[:, 1:] - pages[:, :-1] == 1).all())
        gap = int(first[1] - first[0]) if self.batch > 1 else pages.shape[1]
        if not runs or gap < pages.shape[1] or not bool((first == first[0] + gap * torch.arange(self.batch)).all()):
            return None
        P, start = self.page_tokens, int(first[0]) * self.page_tokens

        def view(t: torch.Tensor) -> torch.Tensor:  # (Hkv, slots, hd) -> (b, Hkv, length, hd)
            h, _, d = t.shape
            return t.as_strided((self.batch, h, self.length, d), (gap * P * d, t.stride(0), d, 1), start * d)
        return [(view(k), view(v)) for k, v in self.storage]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer i's (keys, values) as (b, Hkv, length, hd) views of the storage, or None (gathered only)."""
        return None if self._views is None else self._views[i]

    def _index(self, lo: int, hi: int) -> torch.Tensor:
        """The physical slots of logical [lo, hi) of every row, row after row (cached until reindexed)."""
        flat = self._flat.get((lo, hi))
        if flat is None:
            if len(self._flat) >= 64:  # a pass's layers share one; older passes' are not needed again
                self._flat.clear()
            flat = self._flat[(lo, hi)] = self.slots[:, lo:hi].reshape(-1)
        return flat

    def read(self, i: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values at logical slots [lo, hi): each (b, Hkv, hi - lo, hd)."""
        if self._views is not None:
            k, v = self._views[i]
            return k[:, :, lo:hi], v[:, :, lo:hi]
        index = self._index(lo, hi)
        return tuple(t.index_select(1, index).view(t.shape[0], self.batch, hi - lo, t.shape[2]).transpose(0, 1)
                     for t in self.storage[i])

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Layer i's keys and values k, v (b, Hkv, T, hd) at logical slots [start, start + T) of every row."""
        end = start + k.shape[2]
        if start < self.shared_until or end > self.length:
            raise RuntimeError(f"internal: a write at slots [{start}, {end}) of a cache of {self.length} whose "
                               f"[0, {self.shared_until}) are shared pages")
        if self._views is not None:
            k_view, v_view = self._views[i]
            k_view[:, :, start:end] = k
            v_view[:, :, start:end] = v
            return
        self._scatter(i, k, v, self._index(start, end))

    def write_at(self, i: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Layer i's keys and values k, v (b, Hkv, T, hd), each row's at its own logical `slots` (b, T)
        (rows of different lengths: speculative decoding; a block cache's spare slot)."""
        self._scatter(i, k, v, self.slots.gather(1, slots).reshape(-1))

    def _scatter(self, i: int, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
        for store, new in zip(self.storage[i], (k, v)):
            store.index_copy_(1, index, new.transpose(0, 1).reshape(store.shape[0], -1, store.shape[2]))

    def copy_rows(self, dst: "PagedKV", src_rows: list[int], dst_rows: list[int]) -> None:
        """Rows of this cache into rows of `dst` (every layer, the slots both have, but dst's shared
        prefix: only self-speculation copies into a cache that has one, from the draft rows it filled
        from that cache, so those slots already hold the same values)."""
        lo, n = dst.shared_until, min(self.length, dst.length)
        src = self.slots[src_rows, lo:n].reshape(-1)
        to = dst.slots[dst_rows, lo:n].reshape(-1)
        for (k, v), (dk, dv) in zip(self.storage, dst.storage, strict=True):
            dk.index_copy_(1, to, k.index_select(1, src))
            dv.index_copy_(1, to, v.index_select(1, src))
