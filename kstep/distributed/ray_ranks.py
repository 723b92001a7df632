"""The "ray" backend of a tensor-parallel model (vLLM's `distributed_executor_backend="ray"`): ranks
1..N-1 are Ray actors in a placement group; rank 0 is the calling process, as with processes.

- Placement: inside a placement group already (a Ray Serve replica: bundle 0 is the replica), the
  actors take the group's next N-1 bundles (several models: in load order); otherwise a group of
  N-1 bundles is made, STRICT_PACK on rank 0's node, and removed when the model closes. Rank 0 has
  no bundle there: it is the calling process, which Ray did not place and cannot tie to one (as any
  Ray driver's, its CPU and GPU are the caller's to keep free). A bundle is {CPU: threads} per rank,
  {GPU: 1} on CUDA (Ray names the actor's GPU: its cuda:0; rank 0, outside a placement group, takes
  the first GPU here that Ray gave no rank).
- The group: still torch.distributed (gloo / NCCL), from rank 0's TCP store at rank 0's node
  address, each rank's gloo at its own: so the ranks may sit on other machines.
- Messages: one actor call per message (`handle`, the Follower's); Ray runs one caller's calls to
  an actor in the order they were sent. `send` does not wait; `recv` waits for the last call's
  reply with a timeout, as every wait on Ray here has one.
- A lost actor: rank 0's next collective fails (its sockets close), GroupLost as with processes;
  while idle, a ping (`where`) kept in flight to each actor fails once Ray knows it died (`is_lost`).
- Ray starts locally when nothing has started it (a local instance, or RAY_ADDRESS's cluster), and
  is shut down when the last model that started it closes.

Ray is an optional dependency (`pip install -e .[ray]`): this module is imported only for this backend."""
import os
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import ray
import torch
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group, \
    remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kstep.distributed.group import TPGroup, make_store
from kstep.distributed.launch import READY_SECONDS, check_size, check_supported, load_shard, rank_device
from kstep.distributed.follower import Follower
from kstep.distributed.runner import TensorParallelRunner
from kstep.models import Transformer
from kstep.runner.model_runner import ModelRunner
from kstep.weights import read_model_config

STRATEGY = "STRICT_PACK"  # a group's ranks on one node: their collectives never cross the network
PLACE_SECONDS = 120        # for Ray to reserve the bundles of a group it can hold
ALIVE_SECONDS = 2.0        # for Ray to report an actor's death, once a collective has failed
_next_bundle: dict[str, int] = {}          # per placement group this process sits in: its next free bundle
_ray: dict = {"started": False, "users": 0}  # whether kstep started Ray here, how many models use it


@ray.remote
class RankActor:
    """Rank r of a group: joins it at rank 0's store, loads its share, then handles rank 0's messages."""

    def where(self) -> dict:
        """Where this actor runs (the tests check that it imports the kstep they run)."""
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "kstep": str(Path(__file__).parents[1] / "__init__.py"),  # the kstep package it imported
                "gpus": [str(g) for g in ray.get_gpu_ids()],
                "placement_group": ray.get_runtime_context().get_placement_group_id()}

    def start(self, rank: int, size: int, host: str, port: int, path: str, device: str, dtype: torch.dtype,
              threads: int) -> str | None:
        """Join and load; None, or why not (rank 0 says it, then stops the group)."""
        try:
            self.threads = threads
            torch.set_num_threads(threads)
            group = TPGroup.join(rank, size, device, port=port, host=host, address=ray.util.get_node_ip_address())
            self.follower = Follower(ModelRunner(load_shard(Path(path), torch.device(device), dtype, group)))
        except Exception as e:
            return f"rank {rank}: {e}"
        return None

    def handle(self, message):
        torch.set_num_threads(self.threads)  # OpenMP's thread count is per thread: Ray's may differ from start's
        try:
            return self.follower.handle(message)
        except RuntimeError as e:  # a collective failed: another rank is gone, and so is the group
            print(f"kstep rank actor: stopping: {e}", file=sys.stderr, flush=True)
            raise


class RayChannel:
    """Rank 0's side of one rank actor: its messages are calls, its reply the last call's result."""

    def __init__(self, actor, name: str, where: dict):
        self.actor, self.name, self.where, self.pid, self.last = actor, name, where, where["pid"], None
        self.ping = None  # a `where` call in flight: it fails once Ray knows the actor died (is_lost)

    def send(self, message) -> None:
        if ray.is_initialized():  # else Ray has shut down, and its actors with it: nothing to tell
            self.last = self.actor.handle.remote(message)

    def recv(self, timeout: float):
        return ray.get(self.last, timeout=timeout)  # GetTimeoutError (a TimeoutError) past it

    def is_alive(self) -> bool:
        """False once Ray says the actor died (its last call failed so); a call still running is alive."""
        if self.last is None or not ray.is_initialized():
            return ray.is_initialized()
        ready, _ = ray.wait([self.last], timeout=ALIVE_SECONDS)
        try:
            ray.get(ready)
        except ray.exceptions.RayActorError:
            return False
        except Exception:  # the call failed, not the actor
            pass
        return True

    def has_ended(self, timeout: float) -> bool:
        """Whether Ray says the actor died (is_alive waits for its last call up to ALIVE_SECONDS)."""
        return not self.is_alive()

    def is_lost(self) -> bool:
        """Whether Ray has said the actor died, without waiting: the ping in flight is looked at and,
        once answered, sent again (an actor runs one call at a time: a ping behind a long pass waits,
        and the actor counts as alive meanwhile)."""
        if not ray.is_initialized():
            return False  # Ray stopped: the group was closed, nothing to watch
        if self.ping is None:
            self.ping = self.actor.where.remote()
            return False
        ready, _ = ray.wait([self.ping], timeout=0)
        if not ready:
            return False
        try:
            ray.get(self.ping)
        except ray.exceptions.RayActorError:
            return True
        except Exception:  # the call failed, not the actor
            pass
        self.ping = None
        return False

    def kill(self) -> None:
        if ray.is_initialized():
            ray.kill(self.actor)

    def join(self, timeout: float) -> None:
        """Once the last call ("stop") returns or `timeout` passes, the actor goes."""
        if self.last is not None and ray.is_initialized():
            ray.wait([self.last], timeout=timeout)
        self.kill()


def rank_bundle(device: torch.device | str, threads: int) -> dict[str, float]:
    """What one rank's bundle holds: its CPU threads, or one GPU."""
    return {"GPU": 1} if torch.device(device).type == "cuda" else {"CPU": threads}


def _place(size: int, bundle: dict[str, float]) -> tuple[PlacementGroup, list[int], bool]:
    """(the placement group, the bundles of ranks 1..size-1, whether this call made the group)."""
    current = get_current_placement_group()
    if current is not None:  # e.g. a Serve replica's: bundle 0 is the caller's
        first = _next_bundle.get(current.id.hex(), 1)
        bundles = list(range(first, first + size - 1))
        if bundles[-1] >= current.bundle_count:
            raise ValueError(f"tensor_parallel_size {size}: the placement group this runs in has {current.bundle_count}"
                             f" bundles, {first} of them taken; its ranks need {size - 1} more")
        for b in bundles:
            spec = current.bundle_specs[b]
            if any(spec.get(k, 0) < v for k, v in bundle.items()):
                raise ValueError(f"rank bundle {b} of the placement group holds {spec}; a rank needs {bundle}")
        _next_bundle[current.id.hex()] = first + size - 1
        return current, bundles, False
    node = ray.util.get_node_ip_address()
    here = [n["Resources"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == node]
    if not any(all(r.get(k, 0) >= v * (size - 1) for k, v in bundle.items()) for r in here):
        have = {k: here[0].get(k, 0) for k in bundle} if here else {}
        raise ValueError(f"tensor_parallel_size {size} on Ray: {size - 1} ranks of {bundle} do not fit this "
                         f"node's Ray resources {have}")
    # the node's own resource pins the group to rank 0's node (STRICT_PACK: one node for all)
    pg = placement_group([{**bundle, f"node:{node}": 0.001}] + [bundle] * (size - 2), strategy=STRATEGY)
    if not ray.wait([pg.ready()], timeout=PLACE_SECONDS)[0]:
        remove_placement_group(pg)
        raise ValueError(f"Ray could not reserve {size - 1} bundles of {bundle} on this node in {PLACE_SECONDS} s "
                         "(other work holds them)")
    return pg, list(range(size - 1)), True


def _own_gpu(device: torch.device, taken: set[str]) -> torch.device:
    """Rank 0's GPU outside a placement group: the one asked for, or the first here that Ray gave no rank."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g.strip() for g in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    free = [i for i, g in enumerate(ids) if g not in taken]
    if device.index is not None and device.index not in free:
        raise ValueError(f"rank 0's {device} is a GPU Ray gave another rank (GPUs {sorted(taken)}): give another")
    if not free:
        raise ValueError(f"no GPU here is left for rank 0: Ray gave the other ranks GPUs {sorted(taken)}")
    return device if device.index is not None else torch.device("cuda", free[0])


def _init_ray() -> None:
    ray.init(include_dashboard=False, logging_level="warning", log_to_driver=False)


def _start_ray() -> None:
    """Start Ray here unless something has (the models that started it share it: `_release`).
    Ray's local processes are killed when the thread that started them ends (Linux's parent-death
    signal is per thread), and a model may load on a thread that ends first (a server's engine
    thread): off the main thread Ray starts on a thread of its own, which lives until Ray stops."""
    if not ray.is_initialized():
        if threading.current_thread() is threading.main_thread():
            _init_ray()
        else:
            started: Future = Future()
            _ray["stop"] = stop = threading.Event()

            def keep() -> None:
                try:
                    _init_ray()
                except BaseException as e:
                    started.set_exception(e)
                    return
                started.set_result(None)
                stop.wait()
            threading.Thread(target=keep, name="kstep-ray", daemon=True).start()
            started.result()
        _ray["started"] = True
    if _ray["started"]:
        _ray["users"] += 1


def _release(pg: PlacementGroup | None) -> None:
    if _ray["started"] and _ray["users"] == 1:  # the last model on the Ray kstep started: it stops, group and all
        _ray["users"], _ray["started"] = 0, False
        ray.shutdown()
        if "stop" in _ray:
            _ray.pop("stop").set()
        return
    if pg is not None and ray.is_initialized():
        remove_placement_group(pg)
    if _ray["started"]:
        _ray["users"] -= 1


def load_on_ray(path, device: torch.device, dtype: torch.dtype, size: int,
                threads: int = 1) -> tuple[Transformer, TensorParallelRunner]:
    """Start ranks 1..size-1 as Ray actors (module note), load rank 0's share here; (rank 0's model, its runner)."""
    check_size(size, device, backend="ray")
    check_supported(read_model_config(path), size)
    _start_ray()
    bundle, actors, made = rank_bundle(device, threads), [], None
    try:
        pg, bundles, owned = _place(size, bundle)
        made = pg if owned else None
        gpus = 1 if device.type == "cuda" else 0
        actors = [RankActor.options(num_cpus=0 if gpus else threads, num_gpus=gpus, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b))).remote() for b in bundles]
        where = ray.get([a.where.remote() for a in actors], timeout=READY_SECONDS)
        own = _own_gpu(device, {g for w in where for g in w["gpus"]}) if gpus and owned else rank_device(device, 0)
        host = ray.util.get_node_ip_address()
        store = make_store(size, host)
        local = "cuda:0" if gpus else str(device)  # Ray's CUDA_VISIBLE_DEVICES holds the actor's GPU alone
        starts = [a.start.remote(r, size, host, store.port, str(path), local, dtype, threads)
                  for r, a in enumerate(actors, 1)]
        group = TPGroup.join(0, size, own, store=store, address=host)
        model = load_shard(path, own, dtype, group)
        if failed := [e for e in ray.get(starts, timeout=READY_SECONDS) if e is not None]:
            raise ValueError(failed[0])
    except BaseException as e:
        for actor in actors:
            ray.kill(actor)
        _release(made)
        if isinstance(e, (ValueError, RuntimeError, TimeoutError, ray.exceptions.RayError)):
            raise ValueError(f"tensor parallel start on Ray failed: {e}") from None
        raise
    channels = [RayChannel(a, f"kstep-rank-{r}", w) for r, (a, w) in enumerate(zip(actors, where), 1)]
    return model, TensorParallelRunner(model, group, channels, release=lambda: _release(made))
