"""Starting a tensor-parallel model: the other ranks as processes of their own (torch.multiprocessing,
`spawn`: a fork of a process holding threads and a loaded torch can deadlock), every rank loading
only its share of the weights, rank 0 returning the model and its runner.

CPU ranks run one torch thread each by default (N ranks on N cores); CUDA rank r uses cuda:r."""
import os
import queue
from pathlib import Path

import torch
import torch.multiprocessing as mp

from kstep.distributed.group import TPGroup, free_port
from kstep.distributed.runner import TensorParallelRunner, follow
from kstep.distributed.sharding import plan_shard, shard_model, shard_names
from kstep.models import Transformer
from kstep.registry import FAMILIES
from kstep.runner.model_runner import ModelRunner
from kstep.weights import build_model, load_weights, read_model_config

READY_SECONDS = 600  # for every rank to load its share


def check_size(size: int, device: torch.device) -> None:
    """A group this machine can hold, or a ValueError naming the numbers."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} exceeds the {torch.cuda.device_count()} CUDA devices here")
    if device.type == "cpu" and size > (os.cpu_count() or 1):
        raise ValueError(f"tensor_parallel_size {size} exceeds the {os.cpu_count()} CPU cores here (one rank per core)")


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def load_shard(path, device: torch.device, dtype: torch.dtype, group: TPGroup) -> Transformer:
    """This rank's share of the checkpoint at `path`: built at its local shapes, then only its
    slices read (peak memory: the share plus one tensor being copied)."""
    cfg = read_model_config(path)
    family = FAMILIES[cfg.family]
    if family.network is not None:
        raise ValueError(f"tensor parallel does not run {cfg.family} yet (its own network): use tensor_parallel_size 1")
    shard = plan_shard(cfg, group.rank, group.size)
    model = build_model(cfg, device, dtype, reshape=lambda m: shard_model(m, shard, group))
    with torch.no_grad():
        for p in model.parameters():  # padded vocabulary rows and other ranks' biases stay zero
            p.zero_()
    names, zeros = shard_names(family.layout.checkpoint_names(cfg), shard, cfg)
    load_weights(model, path, names, zeros)
    model.fuse_projections()
    return model


def _rank_main(rank: int, size: int, port: int, path: str, device: str, dtype: torch.dtype, threads: int,
               reports) -> None:
    try:
        torch.set_num_threads(threads)
        group = TPGroup.join(rank, size, port, device)
        model = load_shard(Path(path), torch.device(device), dtype, group)
    except Exception as e:  # rank 0 says why, then stops the group
        reports.put(f"rank {rank}: {e}")
        return
    reports.put(None)
    try:
        follow(group, ModelRunner(model))
    except RuntimeError:  # rank 0 went away (its process ended without a stop): nothing to serve
        pass


def load_tensor_parallel(path, device: torch.device, dtype: torch.dtype, size: int,
                         threads: int = 1) -> tuple[Transformer, TensorParallelRunner]:
    """Start ranks 1..size-1, load rank 0's share here; (rank 0's model, its runner)."""
    check_size(size, device)
    plan_shard(read_model_config(path), 0, size)  # a size the model cannot split fails before any rank starts
    context = mp.get_context("spawn")
    port, reports = free_port(), context.Queue()
    workers = [context.Process(target=_rank_main, daemon=True, name=f"kstep-rank-{rank}",
                               args=(rank, size, port, str(path), str(rank_device(device, rank)), dtype, threads,
                                     reports)) for rank in range(1, size)]
    for worker in workers:
        worker.start()
    try:
        group = TPGroup.join(0, size, port, rank_device(device, 0))
        model = load_shard(path, rank_device(device, 0), dtype, group)
        for _ in workers:
            failed = reports.get(timeout=READY_SECONDS)
            if failed:
                raise ValueError(failed)
    except (ValueError, RuntimeError, queue.Empty) as e:
        for worker in workers:
            worker.kill()
        raise ValueError(f"tensor parallel start failed: {e or 'a rank did not load in time'}") from None
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    return model, TensorParallelRunner(model, group, workers)
