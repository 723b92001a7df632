"""The asyncio face of the engine: one loop that steps the engine in a worker thread (torch
releases the GIL, so the event loop keeps serving HTTP during a pass) and routes each step's
outputs to per-request queues. Cancellation is a flag the next step honours; a shutdown ends
every request at once (`end_all`) rather than letting them run out the server's grace period.

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

from kstep.engine.engine import Engine, StepStats
from kstep.engine.request import Request, RequestOutput

log = logging.getLogger("kstep.engine")


class ShuttingDown(Exception):
    pass


def torch_thread() -> ThreadPoolExecutor:
    """The one thread a server runs torch on (see the module note): load the model through it."""
    return ThreadPoolExecutor(1, thread_name_prefix="kstep-engine")


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[StepStats, Engine], None] | None = None,
                 executor: ThreadPoolExecutor | None = None):
        self.engine, self.on_step = engine, on_step
        self.queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._executor = executor or torch_thread()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.is_closing = False
        # What a fatal error does once every request has its 503: stop the server (kstep serve sets
        # its own, which exits non-zero; elsewhere, the process is asked to terminate).
        self.on_fatal: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def run_on_torch_thread(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    def submit(self, request: Request) -> asyncio.Queue[RequestOutput]:
        """Queue a request; raises QueueFull (or ShuttingDown). Its outputs arrive on the returned queue."""
        if self.is_closing:
            raise ShuttingDown("the server is shutting down: it takes no new requests")
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
        for request_id, queue in list(self.queues.items()):
            queue.put_nowait(RequestOutput(request_id, [], 0, is_finished=True, error=message, error_status=503,
                                           error_code="server_shutdown"))
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
        """Every request ends with a 503 naming `error`, and the server shuts down (`on_fatal`), rather
        than serve a model that can no longer run."""
        log.error("the model cannot run any more: %s; the server stops", error)
        self.end_all(f"the server cannot run this model any more ({error}); it is stopping")
        self.on_fatal()

    def _fail_running(self, message: str) -> list[RequestOutput]:
        outputs = []
        for request in list(self.engine.scheduler.running):
            self.engine.scheduler.finish(request)
            self.engine.streams.pop(request.request_id, None)
            outputs.append(RequestOutput(request.request_id, [], 0, is_finished=True, error=message))
        return outputs
