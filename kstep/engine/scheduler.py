"""FCFS admission with a maximum batch and a bounded queue (and, told by the engine, KV pages). Plain Python, no torch: it decides
which requests take part in the next step, and records what each step committed."""
import threading
from collections import deque

from kstep.engine.request import Request
from kstep.outputs import StepOutput


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, max_batch_size: int, max_queue: int):
        if max_batch_size <= 0 or max_queue < 0:
            raise ValueError(f"max_batch_size ({max_batch_size}) must be > 0 and max_queue ({max_queue}) >= 0")
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.departed = 0  # requests that have left the batch so far (the engine retries a refused admission after one)
        self._lock = threading.Lock()  # requests arrive on the event loop while a step runs in its thread

    def add(self, request: Request) -> None:
        with self._lock:
            free_slots = max(0, self.max_batch_size - len(self.running))  # joins at the next step
            if len(self.waiting) >= self.max_queue + free_slots:
                raise QueueFull(f"the server's queue is full ({self.max_queue} requests waiting); retry later")
            self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Mark a request aborted; a waiting one leaves the queue now, a running one at the next step."""
        with self._lock:
            for request in (*self.waiting, *self.running):
                if request.request_id == request_id:
                    request.is_aborted = True
            self.waiting = deque(r for r in self.waiting if not r.is_aborted)

    def schedule(self, may_admit: bool = True) -> tuple[list[Request], list[Request]]:
        """(the batch for the next step, the requests just admitted into it): running requests keep
        their slots; waiting ones join in arrival order while there is room (and `may_admit`: the
        engine knows the queue's head waits for KV pages that are not free yet)."""
        with self._lock:
            for request in self.running:
                if request.is_aborted:
                    request.decoder = None  # its KV cache goes now, not when the last reference does
                    self.departed += 1
            self.running = [r for r in self.running if not r.is_aborted]
            admitted = []
            while may_admit and self.waiting and len(self.running) < self.max_batch_size:
                admitted.append(self.waiting.popleft())
                self.running.append(admitted[-1])
            return list(self.running), admitted

    def requeue(self, requests: list[Request]) -> None:
        """Requests that must wait after all (their KV pages are not free, or were taken back): out of
        the batch, back to the head of the queue in their order."""
        with self._lock:
            for request in requests:
                if request in self.running:
                    self.running.remove(request)
            self.waiting.extendleft(reversed([r for r in requests if not r.is_aborted]))

    def update(self, batch: list[Request], outputs: list[StepOutput]) -> None:
        """Record each request's step; a finished request leaves the batch and drops its decoder."""
        for request, out in zip(batch, outputs, strict=True):
            request.append(out)
            if request.is_finished:
                self.finish(request)

    def finish(self, request: Request) -> None:
        """Take a request out of the batch (done, or failed); its decoder and caches go with it."""
        request.decoder = None
        with self._lock:
            if request in self.running:
                self.running.remove(request)
                self.departed += 1

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
