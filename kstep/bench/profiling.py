"""torch.profiler for kstep's benchmarks, without kineto's start/stop lines.

Kineto logs `USDT:... profiler_start` and `profiler_stop` from C++ straight to file descriptor 2,
past Python's sys.stderr and any logging setting (KINETO_LOG_LEVEL does not reach them), so a
benchmark's own output would carry them. Only the profiler's start and stop run with fd 2 pointed
at /dev/null; whatever the profiled code prints still shows."""
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextmanager
def cpu_profile() -> Iterator[torch.profiler.profile]:
    """A CPU torch.profiler session around the block (its results on the yielded profiler)."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with _stderr_silenced():
        prof.start()
    try:
        yield prof
    finally:
        with _stderr_silenced():
            prof.stop()
