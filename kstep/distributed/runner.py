"""The model runner of a tensor-parallel model: rank 0's, which the decoders and the engine use as
any runner, and the loop every other rank runs.

Rank 0 sends each packed pass it is asked for (its ForwardPass descriptions: tokens, positions,
masks, cache windows; one message per step) before running it, through one channel per other rank:
a pipe to a process (launch.py) or a Ray actor's handle (ray_ranks.py), both with `send(message)`,
`recv(timeout)` (the reply to the last message that has one) and the rank's life (`is_alive`, `kill`,
`join`); each of those ranks hands every message to its `Follower`. Every rank then runs the same
packed pass over its share of the weights, meeting at the layers' collectives, and rank 0 alone
gets the logits. KV caches live on every rank (each its heads): rank 0's handle carries an id the
others know theirs by; a cache rank 0 drops is dropped everywhere with the next step's message.
DiffusionGemma's self-conditioning signal is kept the same way: rank 0's `soft_embedding` sends each
rank its vocabulary slice of the probabilities (one scatter), every rank multiplies it by its
embedding rows and one all-reduce sums them (vLLM PR #46177: the embedding is never gathered), so
every rank holds the (b, L, D) result; the next pass names it by the id rank 0's tensor carries.
A prefix cache is mirrored the same way: every load and store rank 0's makes is replayed by each
rank on its own cache and KV before the next pass, so all ranks' caches hold the same blocks (the
same operations in the same order: the same LRU choices)."""
import itertools
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import fields
from functools import partial

import torch
import torch.nn.functional as F

from kstep.distributed.group import TIMEOUT, TPGroup
from kstep.layers.attention import KVCache
from kstep.runner.model_runner import ForwardPass, ModelRunner
from kstep.runner.prefix_cache import PrefixCache

PASS_FIELDS = tuple(f.name for f in fields(ForwardPass) if f.name not in ("runner", "kv"))


class GroupLost(RuntimeError):
    """The group cannot run another pass (a rank stopped, or a pass failed part-way on some rank:
    the ranks' collectives no longer line up). `is_fatal`: the engine ends its requests and stops."""
    is_fatal = True


class SharedKV(list):
    """Rank 0's KV cache (its heads' tensors, per layer), known to the other ranks by `kv_id`."""
    kv_id: int
    batch: int
    length: int


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def describe(p: ForwardPass) -> dict:
    """What the other ranks need to run `p` (tensors on the CPU: each rank has its own device; a soft
    embedding they hold goes by its id)."""
    cpu, soft = torch.device("cpu"), p.soft_embeds
    out = {name: _to(getattr(p, name), cpu) for name in PASS_FIELDS if name != "soft_embeds"}
    out["kv"] = None if p.kv is None else (p.kv.kv_id, p.kv.batch, p.kv.length)
    out["soft_embeds"] = soft.soft_id if hasattr(soft, "soft_id") else _to(soft, cpu)
    return out


def _local_kv(described, runner: ModelRunner, caches: dict[int, KVCache]) -> KVCache | None:
    """This rank's KV cache of rank 0's (kv_id, batch, length), allocated when first seen."""
    if described is None:
        return None
    kv_id, batch, length = described
    if kv_id not in caches:
        caches[kv_id] = runner.allocate_kv(batch, length)
    return caches[kv_id]


def rebuild(d: dict, runner: ModelRunner, caches: dict[int, KVCache], softs: dict[int, torch.Tensor]) -> ForwardPass:
    """A described pass on this rank: its tensors on this device, its KV cache and soft embedding this rank's."""
    values = {name: _to(d[name], runner.device) for name in PASS_FIELDS if name != "soft_embeds"}
    soft = d["soft_embeds"]
    values["soft_embeds"] = softs[soft] if isinstance(soft, int) else _to(soft, runner.device)
    return ForwardPass(runner=runner, kv=_local_kv(d["kv"], runner, caches), **values)


def _shared(kv: SharedKV) -> tuple[int, int, int]:
    return kv.kv_id, kv.batch, kv.length


class MirroredPrefixCache(PrefixCache):
    """Rank 0's prefix cache: each load and store is queued for the other ranks (module note)."""

    def __init__(self, runner: "TensorParallelRunner", budget_bytes: int, block_size: int):
        super().__init__(budget_bytes, block_size)
        self.runner, self.cache_id = runner, next(runner._ids)

    def load(self, tokens: list[int], kv: KVCache, max_tokens: int) -> int:
        self.runner.replayed.append(("load", self.cache_id, (self.budget, self.block_size), tokens, _shared(kv),
                                     max_tokens))
        return super().load(tokens, kv, max_tokens)

    def store(self, tokens: list[int], kv: KVCache, row: int = 0) -> None:
        self.runner.replayed.append(("store", self.cache_id, (self.budget, self.block_size), tokens, _shared(kv),
                                     row))
        super().store(tokens, kv, row)


def replay(ops: list, runner: ModelRunner, caches: dict[int, KVCache], prefix_caches: dict[int, PrefixCache]) -> None:
    """A rank other than 0: rank 0's prefix-cache operations and KV copies, on this rank's caches."""
    for op, cache_id, sizes, tokens, kv, arg in ops:
        if op == "copy_kv":  # `tokens`: (rows from, rows to); `arg`: the cache copied into
            runner.copy_kv(_local_kv(kv, runner, caches), _local_kv(arg, runner, caches), *tokens)
            continue
        if cache_id not in prefix_caches:
            prefix_caches[cache_id] = PrefixCache(*sizes)
        getattr(prefix_caches[cache_id], op)(tokens, _local_kv(kv, runner, caches), arg)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every pass and cache is mirrored on the other ranks (module note). Its
    messages go to each rank through its channel (`channels`, one each, in rank order), pickled
    between kstep's own processes (never a file); `release` runs once the ranks are stopped (a Ray
    group's placement group and Ray itself, when kstep started them)."""

    def __init__(self, model, group: TPGroup, channels: list, release: Callable[[], None] | None = None):
        super().__init__(model)
        self.group, self.channels, self.release = group, channels, release
        self._ids = itertools.count()
        self._freed: deque[int] = deque()  # one deque for good: finalizers of every cache and soft embedding append
        self.replayed: list[tuple] = []  # prefix-cache operations since the last message
        self.is_closed = self.is_broken = False

    def allocate_kv(self, batch: int, length: int) -> KVCache:
        kv = SharedKV(super().allocate_kv(batch, length))
        kv.kv_id, kv.batch, kv.length = next(self._ids), batch, length
        weakref.finalize(kv, self._freed.append, kv.kv_id)  # deque.append: safe from any thread's collection
        return kv

    def make_prefix_cache(self, budget_bytes: int, block_size: int) -> PrefixCache:
        return MirroredPrefixCache(self, budget_bytes, block_size)

    def copy_kv(self, src: KVCache, dst: KVCache, src_rows: list[int], dst_rows: list[int]) -> None:
        self.replayed.append(("copy_kv", None, None, (src_rows, dst_rows), _shared(src), _shared(dst)))
        super().copy_kv(src, dst, src_rows, dst_rows)

    def expert_load(self) -> list[int] | None:
        """Per rank, the (token, expert) pairs its experts have run so far, over every MoE layer (rank
        0 routes every token, as each rank does: it knows them all); None for a dense model."""
        loads = [m.rank_load for m in self.model.modules() if getattr(m, "rank_load", None) is not None]
        return torch.stack(loads).sum(0).tolist() if loads else None

    def _send(self, message: tuple) -> None:
        self.group.counts["message"] += 1
        for channel in self.channels:
            channel.send(message)

    def _taken(self) -> tuple[list, list[int]]:
        """The prefix-cache operations and the freed caches since the last message (drained in place:
        a cache collected meanwhile goes with the next one)."""
        ops, self.replayed = self.replayed, []
        return ops, [self._freed.popleft() for _ in range(len(self._freed))]

    def execute(self, passes: list[ForwardPass]) -> list[torch.Tensor]:
        return self._mirrored("execute", [describe(p) for p in passes], partial(super().execute, passes))

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
        soft = self._mirrored("soft_embedding", (soft_id, lead), share)
        soft.soft_id = soft_id  # the other ranks' copy of it, for the next pass's description
        weakref.finalize(soft, self._freed.append, soft_id)
        return soft

    def _mirrored(self, op: str, payload, run: Callable[[], object]):
        """Send the other ranks `op` (with what rank 0 freed and replayed since the last message), then
        run rank 0's part of it; any failure breaks the group."""
        if self.is_closed:
            raise (GroupLost if self.is_broken else RuntimeError)("the tensor-parallel group of this model has "
                                                                  "stopped")
        try:
            self._send((op, payload, *self._taken()))
            return run()
        except Exception as e:  # any failure mid-pass leaves the ranks out of step: the group is done
            self.is_closed = self.is_broken = True
            # A killed rank's sockets reset a moment before its process is reaped: give it (at most 1 s) to end.
            dead = [c.name for c in self.channels if c.has_ended(1.0)]
            why = f"{', '.join(dead)} stopped" if dead else f"a pass failed ({e})"
            raise GroupLost(f"the model's tensor-parallel group cannot go on: {why}") from e

    def report(self) -> list[dict]:
        """What each other rank holds now (its KV caches, prefix-cache blocks and soft embeddings),
        after applying what rank 0 has sent: a check that they mirror rank 0."""
        self._send(("report", [], *self._taken()))
        return [channel.recv(TIMEOUT.total_seconds()) for channel in self.channels]

    def close(self, timeout: float = 30.0) -> None:
        """Stop the other ranks (they leave their loop and exit; a broken group's are killed), then
        release what the group held."""
        if self.is_broken:
            for channel in self.channels:
                channel.kill()
        if not self.is_closed:
            self.is_closed = True
            try:
                self._send(("stop", [], [], []))
            except OSError:  # a rank already gone: nothing to tell it
                pass
            for channel in self.channels:
                channel.join(timeout)  # and killed if it has not stopped by then
        release, self.release = self.release, None
        if release is not None:
            release()


class Follower:
    """A rank other than 0: its KV and prefix caches, and what it does with each of rank 0's
    messages (`handle`, called in the order they were sent: by a process's pipe loop or a Ray
    actor's method)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.caches: dict[int, KVCache] = {}
        self.prefix_caches: dict[int, PrefixCache] = {}
        self.softs: dict[int, torch.Tensor] = {}  # DiffusionGemma's soft embeddings, by rank 0's id

    @torch.inference_mode()
    def handle(self, message: tuple) -> dict | None:
        """Apply one message; the reply for a "report" (what this rank holds), else None."""
        op, payload, replayed, freed = message
        # before the frees: a store may read a cache just dropped
        replay(replayed, self.runner, self.caches, self.prefix_caches)
        for kept_id in freed:  # a KV cache's or a soft embedding's (one id space)
            self.caches.pop(kept_id, None)
            self.softs.pop(kept_id, None)
        if op == "report":
            return {"kv_caches": sorted(self.caches), "soft_embeds": sorted(self.softs),
                    "prefix_blocks": sum(len(c.blocks) for c in self.prefix_caches.values())}
        if op == "soft_embedding":  # rank 0's soft_embedding, this rank's part
            soft_id, lead = payload
            model = self.runner.model
            share = model.tp.scatter(None, (*lead, model.embed.weight.shape[0]), self.runner.dtype)  # (..., rows)
            self.softs[soft_id] = model.soft_embedding_share(share)  # (..., D)
        elif op == "execute":
            self.runner.execute([rebuild(d, self.runner, self.caches, self.softs) for d in payload])
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
        if message[0] == "stop":
            return
        if message[0] == "report":
            pipe.send(reply)
