"""How many bytes a model's KV pool may take (issue 45): `--kv-cache-memory SIZE` outright, or
`--memory-utilization FRACTION` of the memory left once the weights are loaded. Left means, on a
GPU, its free device memory; on the CPU, the smallest of the kernel's MemAvailable, the cgroup's
limit less its usage, and the address-space limit (RLIMIT_AS) less what the process has mapped,
so a container's or `ulimit -v`'s limit counts as much as the machine's RAM. Pools already made in
this process (other served models, a draft model) count as taken even where their pages are not
touched yet (a CPU pool's untouched pages cost nothing until used), so the models of one server
share the memory instead of each counting all of it.

With neither flag a model takes DEFAULT_UTILIZATION of what is left, but no more than
DEFAULT_SEQUENCES whole contexts: `kstep serve` with no flags cannot exhaust the machine, and a
tiny model does not claim gigabytes it will never use."""
import os
import re
import resource
import threading

import torch

DEFAULT_UTILIZATION = 0.5
DEFAULT_SEQUENCES = 32
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}

_reserved_lock = threading.Lock()
_reserved: dict[int, int] = {}  # id of a live pool -> its bytes (process-wide: every model's pool)


def parse_size(text: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5G', '1e9' or a number of bytes -> bytes (ValueError naming the text)."""
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ValueError(f"kv_cache_memory {text!r} must be a positive size")
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--kv-cache-memory {text!r} must be a positive size such as 2GiB, 512MiB or 1e9 (bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_left() -> int | None:
    """The cgroup (v2) memory limit less its usage, where one is set."""
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    return None if limit is None or used is None else max(0, limit - used)


def _address_space_left() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = _read_int("/proc/self/statm")
    return max(0, soft - (mapped or 0) * os.sysconf("SC_PAGE_SIZE"))


def memory_left(device: torch.device) -> int:
    """Bytes a new allocation may still take on `device` (module note), less the live pools' reservations."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]  # a GPU pool is real memory at once: nothing to subtract
    limits = [_mem_available(), _cgroup_left(), _address_space_left()]
    left = min(v for v in limits if v is not None)
    with _reserved_lock:
        return max(0, left - sum(_reserved.values()))


def reserve(owner: object, nbytes: int) -> None:
    """Count `owner`'s `nbytes` as taken until `release(owner)` (a pool, for the pools made after it)."""
    with _reserved_lock:
        _reserved[id(owner)] = nbytes


def release(owner_id: int) -> None:
    with _reserved_lock:
        _reserved.pop(owner_id, None)


def kv_budget(device: torch.device, bytes_per_token: int, max_positions: int, kv_cache_memory: int | str | None = None,
              memory_utilization: float | None = None) -> int:
    """The pool's bytes under the flags (module note); ValueError names a bad value."""
    if kv_cache_memory is not None and memory_utilization is not None:
        raise ValueError("--kv-cache-memory and --memory-utilization both size the KV pool: give one")
    if kv_cache_memory is not None:
        return parse_size(kv_cache_memory)
    if memory_utilization is not None and not 0 < memory_utilization <= 1:
        raise ValueError(f"--memory-utilization {memory_utilization} must be in (0, 1]")
    share = int(memory_left(device) * (memory_utilization or DEFAULT_UTILIZATION))
    if memory_utilization is None:
        share = min(share, DEFAULT_SEQUENCES * max_positions * bytes_per_token)
    return share
