"""Starting a tensor-parallel model: the other ranks as processes of their own (the "mp" backend:
torch.multiprocessing, `spawn`: a fork of a process holding threads and a loaded torch can
deadlock) or as Ray actors ("ray": ray_ranks.py), every rank loading only its share of the weights,
rank 0 returning the model and its runner.

CPU ranks run one torch thread each by default (N ranks on N cores); CUDA rank r uses cuda:r."""
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from kstep.distributed import sharding, sharding_gemma
from kstep.distributed.group import TPGroup, make_store
from kstep.distributed.follower import follow
from kstep.distributed.runner import TensorParallelRunner
from kstep.models import Transformer
from kstep.models.diffusion_gemma_model import DiffusionGemma
from kstep.registry import FAMILIES
from kstep.runner.model_runner import ModelRunner
from kstep.weights import build_model, load_weights, read_model_config

READY_SECONDS = 600  # for every rank to load its share
# How each network is split (a module with plan_shard, shard_model, shard_names); None: the Transformer.
SCHEMES = {None: sharding, DiffusionGemma: sharding_gemma}


class PipeChannel:
    """Rank 0's side of one rank's process: the pipe its messages go by, and the process."""

    def __init__(self, process, pipe):
        self.process, self.pipe, self.name, self.pid = process, pipe, process.name, process.pid

    def send(self, message) -> None:
        self.pipe.send(message)

    def recv(self, timeout: float):
        if not self.pipe.poll(timeout):
            raise TimeoutError(f"{self.name} did not answer in {timeout:g} s")
        return self.pipe.recv()

    def is_lost(self) -> bool:
        """Whether the process has ended (waitpid without waiting: cheap enough to poll)."""
        return not self.process.is_alive()

    def has_ended(self, timeout: float) -> bool:
        """Whether the process ends within `timeout` seconds (a killed one is reaped a moment late)."""
        self.process.join(timeout)
        return not self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()


def check_size(size: int, device: torch.device, backend: str = "mp") -> None:
    """A group this machine can hold, or a ValueError naming the numbers (Ray's ranks: Ray's
    resources decide, ray_ranks.py)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if backend == "ray":
        return
    first = device.index or 0
    if device.type == "cuda" and first + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} from cuda:{first} needs {first + size} CUDA devices; "
                         f"there are {torch.cuda.device_count()}")
    if device.type == "cpu" and size > (os.cpu_count() or 1):
        raise ValueError(f"tensor_parallel_size {size} exceeds the {os.cpu_count()} CPU cores here (one rank per core)")


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def load_shard(path, device: torch.device, dtype: torch.dtype, group: TPGroup) -> Transformer | DiffusionGemma:
    """This rank's share of the checkpoint at `path`: built at its local shapes, then only its
    slices read (peak memory: the share plus one tensor being copied)."""
    cfg = read_model_config(path)
    family, scheme = FAMILIES[cfg.family], scheme_of(cfg)
    shard = scheme.plan_shard(cfg, group.rank, group.size)
    model = build_model(cfg, device, dtype, reshape=lambda m: scheme.shard_model(m, shard, group))
    with torch.no_grad():
        for p in model.parameters():  # padded vocabulary rows and other ranks' biases stay zero
            p.zero_()
    names, zeros = scheme.shard_names(family.layout.checkpoint_names(cfg), shard, cfg)
    load_weights(model, path, names, zeros)
    model.fuse_projections()
    return model


def _rank_main(rank: int, size: int, port: int, path: str, device: str, dtype: torch.dtype, threads: int,
               pipe) -> None:
    try:
        torch.set_num_threads(threads)
        group = TPGroup.join(rank, size, device, port=port)
        model = load_shard(Path(path), torch.device(device), dtype, group)
    except Exception as e:  # rank 0 says why, then stops the group
        pipe.send(f"rank {rank}: {e}")
        return
    pipe.send(None)
    try:
        follow(ModelRunner(model), pipe)
    except RuntimeError as e:  # a collective failed: another rank is gone, and so is the group
        print(f"kstep rank {rank}: stopping: {e}", file=sys.stderr, flush=True)


def scheme_of(cfg):
    """The module that splits this config's network (SCHEMES), or a ValueError for one it does not know."""
    network = FAMILIES[cfg.family].network
    if network not in SCHEMES:
        raise ValueError(f"tensor parallel does not run {cfg.family} yet (its own network): use tensor_parallel_size 1")
    return SCHEMES[network]


def check_supported(cfg, size: int) -> None:
    """A model tensor parallel runs at this size (before any rank starts), or a ValueError saying why."""
    scheme_of(cfg).plan_shard(cfg, 0, size)


def load_tensor_parallel(path, device: torch.device, dtype: torch.dtype, size: int,
                         threads: int = 1) -> tuple[Transformer | DiffusionGemma, TensorParallelRunner]:
    """Start ranks 1..size-1 as processes, load rank 0's share here; (rank 0's model, its runner)."""
    check_size(size, device)
    check_supported(read_model_config(path), size)
    context = mp.get_context("spawn")
    store = make_store(size)
    pipes, workers = [], []
    try:
        for rank in range(1, size):
            mine, theirs = context.Pipe()
            workers.append(context.Process(target=_rank_main, daemon=True, name=f"kstep-rank-{rank}", args=(
                rank, size, store.port, str(path), str(rank_device(device, rank)), dtype, threads, theirs)))
            workers[-1].start()
            theirs.close()  # the child holds it now: its death reads as EOF here
            pipes.append(mine)
        group = TPGroup.join(0, size, rank_device(device, 0), store=store)
        model = load_shard(path, rank_device(device, 0), dtype, group)
        for pipe in pipes:
            if not pipe.poll(READY_SECONDS):
                raise ValueError("a rank did not load in time")
            if (failed := pipe.recv()) is not None:
                raise ValueError(failed)
    except BaseException as e:
        for worker in workers:
            worker.kill()
            worker.join(5)
        if isinstance(e, (ValueError, RuntimeError, EOFError)):
            raise ValueError(f"tensor parallel start failed: {e or 'a rank stopped while loading'}") from None
        raise
    return model, TensorParallelRunner(model, group, [PipeChannel(w, p) for w, p in zip(workers, pipes)])
