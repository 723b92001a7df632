"""The model runner of a tensor-parallel model: rank 0's, which the decoders and the engine use as
any runner, and the loop every other rank runs.

Rank 0 sends each packed pass it is asked for (its ForwardPass descriptions: tokens, positions,
masks, cache windows; one broadcast per step) before running it; every rank then runs the same
packed pass over its share of the weights, meeting at the layers' collectives, and rank 0 alone
gets the logits. KV caches live on every rank (each its heads): rank 0's handle carries an id the
others know theirs by; a cache rank 0 drops is dropped everywhere with the next step's message."""
import itertools
import weakref
from dataclasses import fields

import torch

from kstep.distributed.group import TPGroup
from kstep.layers.attention import KVCache
from kstep.runner.model_runner import ForwardPass, ModelRunner

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
    """What the other ranks need to run `p` (tensors on the CPU: each rank has its own device)."""
    out = {name: _to(getattr(p, name), torch.device("cpu")) for name in PASS_FIELDS}
    out["kv"] = None if p.kv is None else (p.kv.kv_id, p.kv.batch, p.kv.length)
    return out


def rebuild(d: dict, runner: ModelRunner, caches: dict[int, KVCache]) -> ForwardPass:
    """A described pass on this rank: its tensors on this device, its KV cache this rank's."""
    kv = None
    if d["kv"] is not None:
        kv_id, batch, length = d["kv"]
        kv = caches.get(kv_id)
        if kv is None:
            kv = caches[kv_id] = runner.allocate_kv(batch, length)
    values = {name: _to(d[name], runner.device) for name in PASS_FIELDS}
    return ForwardPass(runner=runner, kv=kv, **values)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every pass and cache is mirrored on the other ranks (module note)."""

    def __init__(self, model, group: TPGroup, workers: list):
        super().__init__(model)
        self.group, self.workers = group, workers
        self._ids = itertools.count()
        self._freed: list[int] = []
        self.is_closed = self.is_broken = False

    def allocate_kv(self, batch: int, length: int) -> KVCache:
        kv = SharedKV(super().allocate_kv(batch, length))
        kv.kv_id, kv.batch, kv.length = next(self._ids), batch, length
        weakref.finalize(kv, self._freed.append, kv.kv_id)  # list.append: safe from any thread's collection
        return kv

    def execute(self, passes: list[ForwardPass]) -> list[torch.Tensor]:
        if self.is_closed:
            raise (GroupLost if self.is_broken else RuntimeError)("the tensor-parallel group of this model has "
                                                                  "stopped")
        freed, self._freed = self._freed, []
        try:
            self.group.broadcast_object(("execute", [describe(p) for p in passes], freed))
            return super().execute(passes)
        except Exception as e:  # any failure mid-pass leaves the ranks out of step: the group is done
            self.is_closed = self.is_broken = True
            dead = [w.name for w in self.workers if not w.is_alive()]
            why = f"{', '.join(dead)} stopped" if dead else f"a pass failed ({e})"
            raise GroupLost(f"the model's tensor-parallel group cannot go on: {why}") from e

    def close(self, timeout: float = 30.0) -> None:
        """Stop the other ranks (they leave their loop and exit; a broken group's are killed)."""
        if self.is_broken:
            for worker in self.workers:
                worker.kill()
        if self.is_closed:
            return
        self.is_closed = True
        try:
            self.group.broadcast_object(("stop", [], []))
        except RuntimeError:  # a rank already gone: nothing to tell it
            pass
        for worker in self.workers:
            worker.join(timeout)
            if worker.is_alive():
                worker.kill()


@torch.inference_mode()
def follow(group: TPGroup, runner: ModelRunner) -> None:
    """A rank other than 0: run what rank 0 sends until it says stop."""
    caches: dict[int, KVCache] = {}
    while True:
        op, payload, freed = group.broadcast_object()
        for kv_id in freed:
            caches.pop(kv_id, None)
        if op == "stop":
            return
        runner.execute([rebuild(d, runner, caches) for d in payload])
