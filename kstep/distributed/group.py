"""A tensor-parallel group: its ranks' process group (gloo on the CPU, NCCL on CUDA) and the
collectives kstep's sharded model runs inside a pass (and between DiffusionGemma's passes, the scatter
of its self-conditioning probabilities).

Each model's group is its own process group made from a TCP store of its own, never
torch.distributed's default group: a process may hold several (a server's models, the tests), and
the ranks' collectives cannot mix. Only the pass's collectives go through it: rank 0's messages
between passes go by pipe or Ray actor call (runner.py), so an idle group never meets a collective
timeout. The ranks meet at rank 0's store by address: loopback for processes of one machine
(launch.py), each node's own address for Ray actors (ray_ranks.py), which may sit on other machines.
Every collective is counted (`counts`; `elements`: the size of this rank's share) and timed
(`seconds`: what this rank waited, for `kstep bench tp`; on CUDA after a synchronize, so it is the
collective's time, not its launch)."""
import datetime
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# A collective waits this long for a peer inside one pass, then fails (a lost peer fails at once:
# its sockets close); between passes nothing waits on the group. The tests shorten it.
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("KSTEP_TP_TIMEOUT_SECONDS", 600)))
HOST = "127.0.0.1"


def make_store(size: int, host: str = HOST, timeout: datetime.timedelta = TIMEOUT) -> dist.TCPStore:
    """Rank 0's store, on a port the system picks (no race for a free one); the others join `host` at its port."""
    return dist.TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)


@dataclass(slots=True)
class TPGroup:
    rank: int
    size: int
    device: torch.device
    pg: object                       # a ProcessGroupGloo / ProcessGroupNCCL
    store: object                    # kept alive: the process group talks through it while starting
    counts: Counter = field(default_factory=Counter)
    elements: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)

    @classmethod
    def join(cls, rank: int, size: int, device: torch.device | str, store: dist.TCPStore | None = None,
             port: int | None = None, timeout: datetime.timedelta = TIMEOUT, host: str = HOST,
             address: str | None = None) -> "TPGroup":
        """Join the group of `size` ranks: rank 0 with its store (make_store), the others at its `host`
        and port; gloo listens on this rank's `address` (default: what its hostname resolves to)."""
        device = torch.device(device)
        if store is None:
            store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        elif address is None:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        else:  # NCCL finds its own interface (NCCL_SOCKET_IFNAME); gloo is told this node's
            options = dist.ProcessGroupGloo._Options()
            options._timeout, options._devices = timeout, [dist.ProcessGroupGloo.create_device(hostname=address)]
            pg = dist.ProcessGroupGloo(store, rank, size, options)
        return cls(rank, size, device, pg, store)

    def _wait(self, work, kind: str, x: torch.Tensor) -> None:
        start = time.perf_counter()
        work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.counts[kind] += 1
        self.elements[kind] += x.numel()
        self.seconds[kind] += time.perf_counter() - start

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (a row-parallel layer's partial outputs)."""
        self._wait(self.pg.allreduce([x]), "all_reduce", x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' equal-shaped shards concatenated along the last dim; others: None."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        x = x.contiguous()
        outputs = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self._wait(self.pg.gather(outputs, [x], opts), "gather", x)
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else None

    def scatter(self, chunks: list[torch.Tensor] | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Rank 0's `chunks` (one per rank, each of `shape`), chunk r to rank r: this rank's (others pass None)."""
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        out = torch.empty(shape, dtype=dtype, device=self.device)
        inputs = [[c.contiguous() for c in chunks]] if self.rank == 0 else []
        self._wait(self.pg.scatter([out], inputs, opts), "scatter", out)
        return out
