"""Prefix caching for the AR path: requests that share a prompt prefix (a system prompt, a
few-shot header, a file completed many times) copy its keys/values instead of recomputing them.

The prompt is cut into blocks of `block_size` tokens; a block is addressed by its tokens and its
parent block's key (so equal blocks after different prefixes never mix). A block holds its
keys/values for every layer. A block is referenced by its children; only unreferenced blocks (the
leaves) are evicted, least recently used first, when the memory budget is exceeded. Requests copy
blocks into their own cache, so an eviction never touches a running request.

A model's prefix cache keeps its blocks in pages of the model's KV pool (runner/kv_pool.py), so the
pool is the one budget: cached blocks hold pages only while no request needs them (the engine evicts
the least recently used leaves before it makes a request wait or preempts one), and the cache's own
budget (--prefix-cache-mib) is a ceiling inside the pool. A block that finds no free pages is not
stored. (A tensor-parallel model's ranks keep theirs as tensors of their own, mirrored from rank 0.)

Only causal models: in a bidirectional (diffusion) model a prompt token's keys/values depend on
everything after it, including the masked canvas, so a shared prefix does not have shared keys.
"""
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kstep.layers.attention import KVCache
from kstep.runner.kv_pages import PoolFull


@dataclass(slots=True)
class Block:
    parent: int | None
    keys: list[torch.Tensor]      # per layer (Hkv, block_size, hd)
    values: list[torch.Tensor]
    children: int = 0
    pages: object = None          # the pool's cache the keys and values are views of (its pages go with it)

    @property
    def num_pages(self) -> int:
        return 0 if self.pages is None else self.pages.num_pages

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixCache:
    def __init__(self, budget_bytes: int, block_size: int = 16, allocate: Callable[[int], KVCache] | None = None):
        """`allocate(slots)`: a one-row KV cache from the model's pool for a block (PoolFull when none
        is free); None: blocks are tensors of their own."""
        if budget_bytes < 0 or block_size <= 0:
            raise ValueError(f"prefix cache budget ({budget_bytes}) must be >= 0 and block size ({block_size}) > 0")
        self.budget, self.block_size, self.allocate = budget_bytes, block_size, allocate
        self.blocks: OrderedDict[int, Block] = OrderedDict()  # in LRU order, oldest first
        self.nbytes = 0
        self.num_pages = 0  # pool pages its blocks hold (0 when they are tensors of their own)
        self.hit_tokens = self.query_tokens = 0
        self._lock = threading.Lock()

    def _keys(self, tokens: list[int]) -> list[int]:
        keys, parent = [], None
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(tokens[start:start + self.block_size])))
            keys.append(parent)
        return keys

    def load(self, tokens: list[int], kv: KVCache, max_tokens: int) -> int:
        """Copy the longest cached prefix of `tokens` (whole blocks, at most max_tokens) into every
        row of kv at slots [0, n); returns n."""
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
        for i, block in enumerate(found):
            start = i * self.block_size
            for layer, (k_cache, v_cache) in enumerate(kv):
                k_cache[:, :, start:start + self.block_size] = block.keys[layer]
                v_cache[:, :, start:start + self.block_size] = block.values[layer]
        return n

    def store(self, tokens: list[int], kv: KVCache, row: int = 0) -> None:
        """Add the whole blocks of `tokens`, whose keys/values sit in kv's `row` at slots [0, len)."""
        with self._lock:
            parent = None
            for i, key in enumerate(self._keys(tokens)):
                if key in self.blocks:
                    self.blocks.move_to_end(key)
                else:
                    block = self._block(parent, kv, row, slice(i * self.block_size, (i + 1) * self.block_size))
                    if block is None:  # no free pages: this block and those after it are not kept
                        break
                    self.blocks[key] = block
                    self.nbytes += block.nbytes
                    self.num_pages += block.num_pages
                    if parent is not None:
                        self.blocks[parent].children += 1
                parent = key
            self._evict()

    def _block(self, parent: int | None, kv: KVCache, row: int, span: slice) -> Block | None:
        """A block holding kv's `row` at slots `span`: in pages of the pool (None when none are free),
        or copies of its own."""
        if self.allocate is None:
            return Block(parent, [k[row, :, span].clone() for k, _ in kv], [v[row, :, span].clone() for _, v in kv])
        try:
            pages = self.allocate(self.block_size)
        except PoolFull:
            return None
        for (k_page, v_page), (k, v) in zip(pages, kv, strict=True):
            k_page[0].copy_(k[row, :, span])
            v_page[0].copy_(v[row, :, span])
        return Block(parent, [k[0] for k, _ in pages], [v[0] for _, v in pages], pages=pages)

    def evict_leaves(self, count: int) -> int:
        """Evict up to `count` blocks, each the least recently used one nothing refers to (a parent
        becomes one once its children are gone): their pages go back to the pool, a request needs
        them. How many went."""
        with self._lock:
            evicted = 0
            while evicted < count and self._evict_one():
                evicted += 1
            return evicted

    def _evict(self) -> None:
        while self.nbytes > self.budget and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        victim = next((key for key, b in self.blocks.items() if b.children == 0), None)
        if victim is None:
            return False
        block = self.blocks.pop(victim)
        self.nbytes -= block.nbytes
        self.num_pages -= block.num_pages
        if block.parent is not None and block.parent in self.blocks:
            self.blocks[block.parent].children -= 1
        return True
