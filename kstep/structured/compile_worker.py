"""A server's grammar compiles, their model-independent half (grammar.py's `plan`: the grammar text
and the completion search, nearly all of a compile's time), in one worker process at the lowest CPU
priority, so that a client sending hostile specs cannot slow other streams.

Why a process, not a thread: the search is a Python loop over short llguidance calls. In a thread of
the server it holds the GIL most of the time, and the engine's thread, which gives the GIL up around
every torch op, waits for it again each time; and a compile thread's core is one that torch's
OpenMP threads wait on. Measured with `kstep bench stall` (2 cores, 3 streams, 5 clients sending
hostile specs): with compiles in a thread, the longest gap between two chunks of a stream went from
9-14 ms alone to 133-163 ms; with them in this process it stays as alone (docs/serving.md).
The process runs at the idle scheduling class where the OS has one (Linux: a core only when the
engine leaves one, which a GPU's engine does; new grammars wait on a saturated CPU instead).

A worker that dies in a compile (a spec that exhausts its memory) costs that spec a refusal (cached
like any other) and the next compile a new worker; one that cannot start at all (a script without a
`__main__` guard that starts a server: spawn imports it again) leaves compiles in this process,
said once on stderr."""
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from kstep.structured.grammar import Plan, Refusal, known_formats, plan
from kstep.structured.spec import StructuredSpec


def _worker_start() -> None:
    """In the worker: the lowest priority, and an end with the server's process (a worker blocked on
    its queue would outlive a killed server: its queue's pipe has a writer in the worker too)."""
    os.nice(19)
    if hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    sentinel = multiprocessing.parent_process().sentinel
    threading.Thread(target=lambda: (multiprocessing.connection.wait([sentinel]), os._exit(0)), daemon=True).start()


class CompileWorker:
    """`plan` in a worker process (module note), started by `start` or the first `plan`."""

    def __init__(self):
        self._pool: ProcessPoolExecutor | None = None
        self._ready: Future | None = None  # the new worker's first task: whether it started
        self._in_process = False
        self._lock = threading.Lock()

    def start(self) -> tuple[ProcessPoolExecutor, Future]:
        """Start a worker and load what every compile needs, before the first request waits for it;
        the worker's pool and that first task."""
        with self._lock:
            if self._pool is None:
                # spawn: a fork of a process with torch's threads is not safe
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_worker_start)
                try:
                    self._ready = self._pool.submit(known_formats)
                except Exception as e:  # the OS refused a process
                    self._ready = Future()
                    self._ready.set_exception(e)
            return self._pool, self._ready

    def plan(self, spec: StructuredSpec) -> Plan | Refusal:
        if not self._in_process:
            pool, ready = self.start()
            try:
                ready.result()
            except Exception as e:
                print(f"kstep: the grammar compile worker did not start ({type(e).__name__}: {e}); "
                      f"grammars compile in the server's process", file=sys.stderr, flush=True)
                self._in_process = True
        if self._in_process:
            return plan(spec)
        try:
            return pool.submit(plan, spec).result()
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    self._pool = None  # the next compile starts a new worker
            return Refusal("its compile ended the compile worker (out of memory, or killed): it cannot be kept")

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
