"""A tensor-parallel group: its ranks' process group (gloo on the CPU, NCCL on CUDA) and the few
collectives kstep's sharded model and runner use.

Each model's group is its own process group made from a TCP store on a port of its own, never
torch.distributed's default group: a process may hold several (a server's models, the tests), and
the ranks' collectives cannot mix. Every collective is counted (`counts`), so a test can check what
one pass costs, and timed (`seconds`: what this rank waited in each kind, for `kstep bench tp`)."""
import datetime
import pickle
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=120)  # a peer that stops answering fails the collective (no hang)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class TPGroup:
    rank: int
    size: int
    device: torch.device
    pg: object                       # a ProcessGroupGloo / ProcessGroupNCCL
    store: object                    # kept alive: the process group talks through it while starting
    counts: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)

    @classmethod
    def join(cls, rank: int, size: int, port: int, device: torch.device | str,
             host: str = "127.0.0.1", timeout: datetime.timedelta = TIMEOUT) -> "TPGroup":
        """Join (rank 0: create) the group of `size` ranks whose store is at host:port."""
        device = torch.device(device)
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        if device.type == "cuda":
            pg = dist.ProcessGroupNCCL(store, rank, size)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        return cls(rank, size, device, pg, store)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (a row-parallel layer's partial outputs)."""
        self.counts["all_reduce"] += 1
        start = time.perf_counter()
        self.pg.allreduce([x]).wait()
        self.seconds["all_reduce"] += time.perf_counter() - start
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' equal-shaped shards concatenated along the last dim; others: None."""
        self.counts["gather"] += 1
        opts = dist.GatherOptions()
        opts.rootRank = 0
        x = x.contiguous()
        outputs = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        start = time.perf_counter()
        self.pg.gather(outputs, [x], opts).wait()
        self.seconds["gather"] += time.perf_counter() - start
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else None

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled between kstep's own processes only, never a file)."""
        self.counts["broadcast"] += 1
        start = time.perf_counter()
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.long, device=self._wire)
        self.pg.broadcast([size], dist.BroadcastOptions()).wait()
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._wire) if self.rank == 0 else \
            torch.empty(int(size), dtype=torch.uint8, device=self._wire)
        self.pg.broadcast([buffer], dist.BroadcastOptions()).wait()
        self.seconds["broadcast"] += time.perf_counter() - start
        return obj if self.rank == 0 else pickle.loads(buffer.cpu().numpy().tobytes())

    @property
    def _wire(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")
