"""A rank other than 0 of a tensor-parallel group: what it does with each of rank 0's messages
(messages.py), in the order they were sent, by a process's pipe loop (`follow`) or a Ray actor's
method (ray_ranks.py). It keeps its own KV caches and soft embeddings under the ids
rank 0 gives them (runner.py says how rank 0 keeps them in step); it owns no decision of its own."""
import torch

from kstep.distributed.messages import (PASS_FIELDS, Execute, KVHandle, Message, PassDescription, RankReport,
                                        ReplayOp, Report, SoftEmbedding, Stop)
from kstep.layers.attention import KVCache
from kstep.runner.kv_pool import KVPool
from kstep.runner.model_runner import ForwardPass, ModelRunner


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


class Follower:
    """A rank other than 0: its caches, and `handle` for each of rank 0's messages."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.caches: dict[int, KVCache] = {}
        self.softs: dict[int, torch.Tensor] = {}  # DiffusionGemma's soft embeddings, by rank 0's id

    def _kv(self, handle: KVHandle | None) -> KVCache | None:
        """This rank's KV cache of rank 0's handle, made when first seen, its page tables rank 0's as
        they were when the handle was made."""
        if handle is None:
            return None
        pool = self.runner.kv_pool
        if pool is None:  # rank 0's shape, this rank's heads (its budget's share)
            runner = self.runner
            pool = runner.kv_pool = KVPool(runner.model.kv_geometry(), handle.pool_pages, handle.page_tokens,
                                           runner.device, runner.dtype)
        kv = self.caches.get(handle.kv_id)
        if kv is None:
            kv = self.caches[handle.kv_id] = pool.view(handle.tables, handle.length)
        elif kv.length != handle.length or any(map(tuple.__ne__, map(tuple, kv.tables), handle.tables)):
            pool.retable(kv, handle.tables, handle.length)  # grown, or a prefix cache's pages mapped in
        return kv

    def rebuild(self, d: PassDescription) -> ForwardPass:
        """A described pass on this rank: its tensors on this device, its KV cache and soft embedding this rank's."""
        device = self.runner.device
        soft = self.softs[d.soft_embeds] if isinstance(d.soft_embeds, int) else _to(d.soft_embeds, device)
        values = {name: _to(getattr(d, name), device) for name in PASS_FIELDS}
        return ForwardPass(runner=self.runner, kv=self._kv(d.kv), soft_embeds=soft, **values)

    def replay(self, ops: list[ReplayOp]) -> None:
        """Rank 0's KV copies, on this rank's caches."""
        for op in ops:
            self.runner.copy_kv(self._kv(op.src), self._kv(op.dst), op.src_rows, op.dst_rows)

    @torch.inference_mode()
    def handle(self, message: Message) -> RankReport | None:
        """Apply one message; the reply for a Report (what this rank holds), else None."""
        self.replay(message.replayed)  # before the frees: a copy may read a cache just dropped
        for kept_id in message.freed:  # a KV cache's or a soft embedding's (one id space)
            self.caches.pop(kept_id, None)
            self.softs.pop(kept_id, None)
        if isinstance(message, Report):
            return RankReport(kv_caches=sorted(self.caches), soft_embeds=sorted(self.softs))
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
