"""Prefix caching for the causal paths (AR, block diffusion, causal context): requests that share
a prompt prefix (a system prompt, a few-shot header, a file completed many times) read its
keys/values from the pages that hold them instead of recomputing them.

The prompt is cut into blocks of `block_size` tokens (whole pages of the model's KV pool); a block is
addressed by its tokens and its parent block's key (so equal blocks after different prefixes never
mix). A block is the pool pages where the request that stored it wrote those keys: storing takes one
more holder of them (no copy), and a later request maps them into its page tables (no copy either;
runner/kv_pool.py `map_shared`) and never writes them. A block is referenced by its children; only
unreferenced blocks (the leaves) are evicted, least recently used first, when the cache's budget
(--prefix-cache-mib, a ceiling inside the pool) is exceeded, or when a request needs pages (the
engine evicts leaves before it makes a request wait or preempts one). A page goes back to the pool
when its last holder lets go, so an eviction never touches a running request.

A tensor-parallel group's other ranks need nothing of it: rank 0 grants every page, and each rank's
storage of a cached page keeps what that rank wrote there until the page is free again.

Only causal models: in a bidirectional (diffusion) model a prompt token's keys/values depend on
everything after it, including the masked canvas, so a shared prefix does not have shared keys.
"""
import threading
from collections import OrderedDict
from dataclasses import dataclass

from kstep.layers.paged_kv import PagedKV
from kstep.runner.kv_pool import KVPool


@dataclass(slots=True)
class Block:
    parent: int | None
    pages: list[int]  # of the pool, one holder of each is this block's
    children: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int, block_size: int, pool: KVPool):
        if budget_bytes < 0 or block_size <= 0 or block_size % pool.page_tokens:
            raise ValueError(f"prefix cache budget ({budget_bytes}) must be >= 0 and block size ({block_size}) a "
                             f"positive multiple of the KV pool's page ({pool.page_tokens} tokens)")
        self.budget, self.block_size, self.pool = budget_bytes, block_size, pool
        self.pages_a_block = block_size // pool.page_tokens
        self.blocks: OrderedDict[int, Block] = OrderedDict()  # in LRU order, oldest first
        self.num_pages = 0
        self.hit_tokens = self.query_tokens = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.pool.page_bytes

    def only_held_pages(self) -> int:
        """Pages only this cache holds (a running request's shared prompt pages are in use, not cached)."""
        with self._lock:
            return sum(self.pool.pages.holders(page) == 1 for block in self.blocks.values() for page in block.pages)

    def _keys(self, tokens: list[int]) -> list[int]:
        keys, parent = [], None
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(tokens[start:start + self.block_size])))
            keys.append(parent)
        return keys

    def load(self, tokens: list[int], kv: PagedKV, max_tokens: int) -> int:
        """Map the longest cached prefix of `tokens` (whole blocks, at most max_tokens) into every row
        of kv at slots [0, n); returns n."""
        with self._lock:
            found = []
            for key in self._keys(tokens[:max_tokens]):
                if key not in self.blocks:
                    break
                found.append(self.blocks[key])
                self.blocks.move_to_end(key)
            n = len(found) * self.block_size
            self.query_tokens += len(tokens)
            self.hit_tokens += n
            if found:  # under the lock: an eviction cannot give the pages back before kv holds them
                self.pool.map_shared(kv, [page for block in found for page in block.pages])
        return n

    def store(self, tokens: list[int], kv: PagedKV, row: int = 0) -> None:
        """Keep the whole blocks of `tokens`, whose keys/values kv's `row` holds at slots [0, len)."""
        per = self.pages_a_block
        with self._lock:
            parent = None
            for i, key in enumerate(self._keys(tokens)):
                if key in self.blocks:
                    self.blocks.move_to_end(key)
                else:
                    pages = kv.tables[row][i * per:(i + 1) * per]
                    self.pool.hold(pages)
                    self.blocks[key] = Block(parent, pages)
                    self.num_pages += per
                    if parent is not None:
                        self.blocks[parent].children += 1
                parent = key
            # its own row's pages are shared now: the request must not write them again
            kv.shared_until = max(kv.shared_until, len(self._keys(tokens)) * self.block_size)
            while self.nbytes > self.budget and self._evict_one(only_held=False):
                pass

    def evict_leaves(self, count: int) -> int:
        """Evict up to `count` blocks whose pages only this cache holds, each the least recently used
        one nothing refers to (a parent becomes one once its children are gone): their pages go back
        to the pool, a request needs them. How many went."""
        with self._lock:
            evicted = 0
            while evicted < count and self._evict_one(only_held=True):
                evicted += 1
            return evicted

    def _evict_one(self, only_held: bool) -> bool:
        victim = next((key for key, b in self.blocks.items() if b.children == 0
                       and (not only_held or all(self.pool.pages.holders(p) == 1 for p in b.pages))), None)
        if victim is None:
            return False
        block = self.blocks.pop(victim)
        self.num_pages -= len(block.pages)
        self.pool.release(block.pages)
        if block.parent is not None and block.parent in self.blocks:
            self.blocks[block.parent].children -= 1
        return True
