"""The asyncio face of the engine: one loop that steps the engine in a worker thread (torch
releases the GIL, so the event loop keeps serving HTTP during a pass) and routes each step's
outputs to per-request queues. Cancellation is a flag the next step honours; a shutdown ends
every request at once (`end_all`) rather than letting them run out the server's grace period.
A model that cannot run any more (a lost tensor-parallel rank: an `is_fatal` error, from a step or
from `check`, which a light watcher polls so an idle model's loss is found at once) is down for
good: its requests end with a 503 naming why, new ones are refused (ModelDown), and `on_fatal` is
told once; the engine's other work and the server's other models go on.

All of a server's torch work (loading, warm-up, every step) runs on that one thread
(`torch_thread`): each thread that runs a parallel op gets its own OpenMP team, and once a process
holds more OpenMP threads than cores, libgomp stops spin-waiting between parallel regions, so
every op pays a futex wake-up. On 2 cores that halved throughput (measured: 87 vs 169 tokens/s
unbatched, 209 vs 446 batched, model loaded on the main thread vs on the engine thread)."""
import asyncio
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kstep.engine.engine import Engine
from kstep.engine.request import Request, RequestOutput, StepStats

log = logging.getLogger("kstep.engine")


WATCH_SECONDS = 0.25  # how often `check` looks at the model's ranks (a pipe's process: one waitpid)


class ShuttingDown(Exception):
    pass


class ModelDown(Exception):
    """The model cannot run any more (its message says why: e.g. which rank was lost)."""


def torch_thread() -> ThreadPoolExecutor:
    """The one thread a server runs torch on (see the module note): load the model through it."""
    return ThreadPoolExecutor(1, thread_name_prefix="kstep-engine")


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[StepStats, Engine], None] | None = None,
                 executor: ThreadPoolExecutor | None = None, check: Callable[[], None] | None = None):
        self.engine, self.on_step, self.check = engine, on_step, check
        self.queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._executor = executor or torch_thread()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self.is_closing = False
        self.down: str | None = None  # why the model cannot run any more, once it cannot
        # What a fatal error does once every request has its 503 (a server sets its own: the
        # server goes on while another model is up; elsewhere, the process is asked to terminate).
        self.on_fatal: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        if self.check is not None:
            self._watcher = asyncio.create_task(self._watch())

    def is_up(self) -> bool:
        """Whether the model can still run, looked at now (`check`: a lost rank takes it down here)."""
        if self.down is None and self.check is not None:
            try:
                self.check()
            except Exception as e:
                if not getattr(e, "is_fatal", False):
                    raise
                self._stop_fatally(e)
        return self.down is None

    async def _watch(self) -> None:
        """Find a lost rank while the model is idle too, not only at its next pass."""
        while self.is_up():
            await asyncio.sleep(WATCH_SECONDS)

    async def run_on_torch_thread(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def stop(self) -> None:
        for task in (self._watcher, self._task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._executor.shutdown(wait=True)

    def submit(self, request: Request) -> asyncio.Queue[RequestOutput]:
        """Queue a request; raises QueueFull (or ShuttingDown). Its outputs arrive on the returned queue."""
        if self.is_closing:
            raise ShuttingDown("the server is shutting down: it takes no new requests")
        if self.down is not None:
            raise ModelDown(self.down)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.engine.add_request(request)
        self.queues[request.request_id] = queue
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone): it leaves the batch at the next step and frees its slot."""
        self.queues.pop(request_id, None)
        self.engine.abort(request_id)
        self._wake.set()

    def end_all(self, message: str) -> None:
        """Shutdown: take no new requests and end every queued and running one now, each with a 503
        output saying `message` (they leave the batch at the next step)."""
        self.is_closing = True
        self._end_queued(message, "server_shutdown")

    def _end_queued(self, message: str, code: str) -> None:
        for request_id, queue in list(self.queues.items()):
            queue.put_nowait(RequestOutput(request_id, [], 0, is_finished=True, error=message, error_status=503,
                                           error_code=code))
            self.engine.abort(request_id)
        self.queues.clear()
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            if not self.engine.has_work():
                await self._wake.wait()
                continue
            try:
                outputs, stats = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # a failed pass fails its batch, never the server ...
                if getattr(e, "is_fatal", False):  # ... unless the model cannot run again (a lost rank)
                    self._stop_fatally(e)
                    continue
                log.exception("engine step failed")
                outputs, stats = self._fail_running(f"internal error in the engine step: {e}"), None
            if stats is not None and self.on_step is not None:
                self.on_step(stats, self.engine)
            for out in outputs:
                queue = self.queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                if out.is_finished:
                    self.queues.pop(out.request_id, None)

    def _stop_fatally(self, error: Exception) -> None:
        """The model is down (once; a step failing after the watcher found the loss adds nothing):
        every request ends with a 503 naming `error`, new ones are refused, `on_fatal` is told."""
        if self.down is not None:
            return
        self.down = str(error)
        self._end_queued(f"this model cannot run any more ({error}); it stays down until the server restarts",
                         "model_down")
        self.on_fatal()

    def _fail_running(self, message: str) -> list[RequestOutput]:
        outputs = []
        for request in list(self.engine.scheduler.running):
            self.engine.scheduler.finish(request)
            self.engine.streams.pop(request.request_id, None)
            outputs.append(RequestOutput(request.request_id, [], 0, is_finished=True, error=message))
        return outputs
