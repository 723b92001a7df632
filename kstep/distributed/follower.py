"""A rank other than 0 of a tensor-parallel group: what it does with each of rank 0's messages
(messages.py), in the order they were sent, by a process's pipe loop (`follow`) or a Ray actor's
method (ray_ranks.py). It keeps its own KV caches, prefix caches and soft embeddings under the ids
rank 0 gives them (runner.py says how rank 0 keeps them in step); it owns no decision of its own."""
import torch

from kstep.distributed.messages import (PASS_FIELDS, CopyKV, Execute, KVHandle, Message, PassDescription,
                                        PrefixLoad, RankReport, ReplayOp, Report, SoftEmbedding, Stop)
from kstep.layers.attention import KVCache
from kstep.runner.kv_pool import KVPool
from kstep.runner.model_runner import ForwardPass, ModelRunner
from kstep.runner.prefix_cache import PrefixCache


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


class Follower:
    """A rank other than 0: its caches, and `handle` for each of rank 0's messages."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.caches: dict[int, KVCache] = {}
        self.prefix_caches: dict[int, PrefixCache] = {}
        self.softs: dict[int, torch.Tensor] = {}  # DiffusionGemma's soft embeddings, by rank 0's id

    def _kv(self, handle: KVHandle | None) -> KVCache | None:
        """This rank's KV cache of rank 0's handle, allocated when first seen."""
        if handle is None:
            return None
        if handle.kv_id not in self.caches:
            pool = self.runner.kv_pool
            if pool is None:  # rank 0's shape, this rank's heads (its budget's share)
                runner = self.runner
                pool = runner.kv_pool = KVPool(runner.model.kv_geometry(), handle.pool_pages, handle.page_tokens,
                                               runner.device, runner.dtype)
            self.caches[handle.kv_id] = pool.views_at(handle.first_page, handle.batch, handle.length)
        return self.caches[handle.kv_id]

    def rebuild(self, d: PassDescription) -> ForwardPass:
        """A described pass on this rank: its tensors on this device, its KV cache and soft embedding this rank's."""
        device = self.runner.device
        soft = self.softs[d.soft_embeds] if isinstance(d.soft_embeds, int) else _to(d.soft_embeds, device)
        values = {name: _to(getattr(d, name), device) for name in PASS_FIELDS}
        return ForwardPass(runner=self.runner, kv=self._kv(d.kv), soft_embeds=soft, **values)

    def replay(self, ops: list[ReplayOp]) -> None:
        """Rank 0's prefix-cache operations and KV copies, on this rank's caches."""
        for op in ops:
            if isinstance(op, CopyKV):
                self.runner.copy_kv(self._kv(op.src), self._kv(op.dst), op.src_rows, op.dst_rows)
                continue
            if op.cache_id not in self.prefix_caches:
                self.prefix_caches[op.cache_id] = PrefixCache(op.budget, op.block_size)
            cache = self.prefix_caches[op.cache_id]
            if isinstance(op, PrefixLoad):
                cache.load(op.tokens, self._kv(op.kv), op.max_tokens)
            else:
                cache.store(op.tokens, self._kv(op.kv), op.row)

    @torch.inference_mode()
    def handle(self, message: Message) -> RankReport | None:
        """Apply one message; the reply for a Report (what this rank holds), else None."""
        self.replay(message.replayed)  # before the frees: a store may read a cache just dropped
        for kept_id in message.freed:  # a KV cache's or a soft embedding's (one id space)
            self.caches.pop(kept_id, None)
            self.softs.pop(kept_id, None)
        if isinstance(message, Report):
            return RankReport(kv_caches=sorted(self.caches), soft_embeds=sorted(self.softs),
                              prefix_blocks=sum(len(c.blocks) for c in self.prefix_caches.values()))
        if isinstance(message, SoftEmbedding):  # rank 0's soft_embedding, this rank's part
            model = self.runner.model
            share = model.tp.scatter(None, (*message.lead, model.embed.weight.shape[0]),
                                     self.runner.dtype)  # (..., rows)
            self.softs[message.soft_id] = model.soft_embedding_share(share)  # (..., D)
        elif isinstance(message, Execute):
            self.runner.execute([self.rebuild(d) for d in message.passes])
        return None


def follow(runner: ModelRunner, pipe) -> None:
    """A rank's process: handle what rank 0 sends by `pipe` until it says stop (or the pipe closes)."""
    follower = Follower(runner)
    while True:
        try:
            message = pipe.recv()
        except EOFError:  # rank 0's process is gone
            return
        reply = follower.handle(message)
        if isinstance(message, Stop):
            return
        if isinstance(message, Report):
            pipe.send(reply)
