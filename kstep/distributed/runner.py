"""The model runner of a tensor-parallel model: rank 0's, which the decoders and the engine use as
any runner (the other ranks' side is follower.py; what goes between them, messages.py).

Rank 0 sends each packed pass it is asked for (its ForwardPass descriptions: tokens, positions,
masks, cache windows; one message per step) before running it, through one channel per other rank:
a pipe to a process (launch.py) or a Ray actor's handle (ray_ranks.py), both with `name`, `pid`,
`send(message)`, `recv(timeout)` (the reply to the last message that has one) and the rank's life
(`is_lost`: known dead, without waiting; `has_ended(timeout)`, `kill`, `join`); each of those
ranks hands every message to its `Follower`. Every rank then runs the same packed pass over its
share of the weights, meeting at the layers' collectives, and rank 0 alone gets the logits. KV
caches live on every rank (each its heads): rank 0's handle carries an id the others know theirs
by; a cache rank 0 drops is dropped everywhere with the next step's message.
DiffusionGemma's self-conditioning signal is kept the same way: rank 0's `soft_embedding` sends each
rank its vocabulary slice of the probabilities (one scatter), every rank multiplies it by its
embedding rows and one all-reduce sums them (vLLM PR #46177: the embedding is never gathered), so
every rank holds the (b, L, D) result; the next pass names it by the id rank 0's tensor carries.
A prefix cache needs nothing of the other ranks: its blocks are pages rank 0 granted and holds, and
a request that maps them sends its page tables with its next pass (runner/prefix_cache.py).

A lost rank is found by the pass it fails (a collective's sockets close) or, while idle, by
`check_ranks` (a server's watcher polls it): either way the group is broken for good."""
import itertools
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from functools import partial

import torch
import torch.nn.functional as F

from kstep.distributed.group import TIMEOUT, TPGroup
from kstep.distributed.messages import (PASS_FIELDS, CopyKV, Execute, KVHandle, Message, PassDescription, ReplayOp,
                                        Report, SoftEmbedding, Stop)
from kstep.layers.attention import KVCache
from kstep.layers.paged_kv import PagedKV
from kstep.runner.model_runner import ForwardPass, ModelRunner


class GroupLost(RuntimeError):
    """The group cannot run another pass (a rank stopped, or a pass failed part-way on some rank:
    the ranks' collectives no longer line up). `is_fatal`: the engine ends its model's requests,
    and the model is down for good."""
    is_fatal = True


def _cpu(value):
    return value.to("cpu") if isinstance(value, torch.Tensor) else value


def _handle(kv: PagedKV | None) -> KVHandle | None:
    """Rank 0's cache (its heads' share, per layer, of its pool) as the other ranks know it."""
    return None if kv is None else KVHandle(kv.kv_id, kv.length, tuple(map(tuple, kv.tables)), kv.pool_pages,
                                            kv.page_tokens)


def describe(p: ForwardPass) -> PassDescription:
    """What the other ranks need to run `p` (tensors on the CPU: each rank has its own device; a soft
    embedding they hold goes by its id)."""
    soft = p.soft_embeds
    return PassDescription(kv=_handle(p.kv), soft_embeds=soft.soft_id if hasattr(soft, "soft_id") else _cpu(soft),
                           **{name: _cpu(getattr(p, name)) for name in PASS_FIELDS})


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every pass and cache is mirrored on the other ranks (module note). Its
    messages go to each rank through its channel (`channels`, one each, in rank order), pickled
    between kstep's own processes (never a file); `release` runs once the ranks are stopped (a Ray
    group's placement group and Ray itself, when kstep started them). Once a rank is lost the group
    is broken for good (`lost` says why): its other ranks are killed, every later pass raises GroupLost."""

    def __init__(self, model, group: TPGroup, channels: list, release: Callable[[], None] | None = None):
        super().__init__(model)
        self.group, self.channels, self.release = group, channels, release
        self._ids = itertools.count()
        self._freed: deque[int] = deque()  # one deque for good: finalizers of every cache and soft embedding append
        self.replayed: list[ReplayOp] = []  # KV copies since the last message
        self.is_closed = self.is_broken = False
        self.lost: str | None = None  # why the group cannot go on, once it cannot

    def allocate_kv(self, batch: int, length: int) -> KVCache:
        kv = super().allocate_kv(batch, length)
        kv.kv_id, kv.pool_pages, kv.page_tokens = next(self._ids), self.kv_pool.pages.num_pages, self.kv_pool.page_tokens
        weakref.finalize(kv, self._freed.append, kv.kv_id)  # deque.append: safe from any thread's collection
        return kv

    def copy_kv(self, src: KVCache, dst: KVCache, src_rows: list[int], dst_rows: list[int]) -> None:
        self.replayed.append(CopyKV(_handle(src), _handle(dst), src_rows, dst_rows))
        super().copy_kv(src, dst, src_rows, dst_rows)

    def expert_load(self) -> list[int] | None:
        """Per rank, the (token, expert) pairs its experts have run so far, over every MoE layer (rank
        0 routes every token, as each rank does: it knows them all); None for a dense model."""
        loads = [m.rank_load for m in self.model.modules() if getattr(m, "rank_load", None) is not None]
        return torch.stack(loads).sum(0).tolist() if loads else None

    def _send(self, message: Message) -> None:
        self.group.counts["message"] += 1
        for channel in self.channels:
            channel.send(message)

    def _taken(self) -> dict:
        """The replayed operations and the freed caches since the last message, as a message's fields
        (drained in place: a cache collected meanwhile goes with the next one)."""
        ops, self.replayed = self.replayed, []
        return {"replayed": ops, "freed": [self._freed.popleft() for _ in range(len(self._freed))]}

    def execute(self, passes: list[ForwardPass]):
        """ModelRunner.execute over the group: its outputs, as they are."""
        return self._mirrored(lambda: Execute(passes=[describe(p) for p in passes], **self._taken()),
                              partial(super().execute, passes))

    def probs_embedder(self):
        """None: the ranks embed their slices of the probabilities (soft_embedding)."""
        return None

    @torch.inference_mode()
    def soft_embedding(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) processed logits -> (..., D), vocabulary-parallel (module note): the probabilities
        computed here as the dense model does, each rank's slice of them scattered."""
        model, size = self.model, self.group.size
        probs = model.soft_probs(logits)  # (..., V) in the model dtype
        rows, lead = model.embed.weight.shape[0], tuple(probs.shape[:-1])
        padded = F.pad(probs, (0, rows * size - probs.shape[-1]))  # (..., rows * N): padding rows weigh 0
        soft_id = next(self._ids)

        def share() -> torch.Tensor:
            return model.soft_embedding_share(self.group.scatter(list(padded.split(rows, dim=-1)), (*lead, rows),
                                                                 probs.dtype))  # (..., D)
        soft = self._mirrored(lambda: SoftEmbedding(soft_id=soft_id, lead=lead, **self._taken()), share)
        soft.soft_id = soft_id  # the other ranks' copy of it, for the next pass's description
        weakref.finalize(soft, self._freed.append, soft_id)
        return soft

    def _mirrored(self, message: Callable[[], Message], run: Callable[[], object]):
        """Send the other ranks `message()` (made now: it takes what rank 0 freed and replayed since
        the last one), then run rank 0's part of it; any failure breaks the group."""
        if self.is_closed:
            if self.is_broken:
                raise GroupLost(self.lost)
            raise RuntimeError("the tensor-parallel group of this model has stopped")
        try:
            self._send(message())
            return run()
        except Exception as e:  # any failure mid-pass leaves the ranks out of step: the group is done
            if self.lost is not None:  # found lost meanwhile (check_ranks): the same reason
                raise GroupLost(self.lost) from e
            # A killed rank's sockets reset a moment before its process is reaped: give it (at most 1 s) to end.
            dead = [c.name for c in self.channels if c.has_ended(1.0)]
            self._break(f"{', '.join(dead)} stopped" if dead else f"a pass failed ({e})")
            raise GroupLost(self.lost) from e

    def _break(self, why: str) -> None:
        """The group is done: say why, and kill the ranks still up (they would wait for rank 0 for ever)."""
        self.lost = self.lost or f"the model's tensor-parallel group cannot go on: {why}"
        self.is_closed = self.is_broken = True
        for channel in self.channels:
            channel.kill()

    def check_ranks(self) -> None:
        """Raise GroupLost if a rank has died, idle or not (the channels' `is_lost`: no waiting), and
        break the group; a closed group that is not broken passes. Safe beside a running pass: a
        rank is only looked at, and the pass fails on its own once its peer is gone."""
        if self.is_broken:
            raise GroupLost(self.lost)
        if self.is_closed:
            return
        dead = [c.name for c in self.channels if c.is_lost()]
        if dead:
            self._break(f"{', '.join(dead)} stopped")
            raise GroupLost(self.lost)

    def ranks(self) -> list[dict]:
        """Each other rank: its name and process id (for /health: which process is which model's)."""
        return [{"name": c.name, "pid": c.pid} for c in self.channels]

    def report(self) -> list[dict]:
        """What each other rank holds now (its KV caches and soft embeddings),
        after applying what rank 0 has sent: a check that they mirror rank 0."""
        self._send(Report(**self._taken()))
        return [asdict(channel.recv(TIMEOUT.total_seconds())) for channel in self.channels]

    def close(self, timeout: float = 30.0) -> None:
        """Stop the other ranks (they leave their loop and exit; a broken group's are killed), then
        release what the group held."""
        if self.is_broken:
            for channel in self.channels:
                channel.kill()
        if not self.is_closed:
            self.is_closed = True
            try:
                self._send(Stop())
            except OSError:  # a rank already gone: nothing to tell it
                pass
            for channel in self.channels:
                channel.join(timeout)  # and killed if it has not stopped by then
        release, self.release = self.release, None
        if release is not None:
            release()
