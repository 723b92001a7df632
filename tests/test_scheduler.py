"""The scheduler on its own: FCFS admission, the batch limit, the bounded queue, aborts, and the
bookkeeping of step outputs. Fake requests and hand-built StepOutputs; no model, no torch."""
import subprocess
import sys
from pathlib import Path

import pytest

from kstep.engine.request import Request
from kstep.engine.scheduler import QueueFull, Scheduler
from kstep.outputs import StepOutput
from kstep.params import GenerationParams


def make_request(name: str, rows: int = 1) -> Request:
    return Request([[1, 2, 3]] * rows, GenerationParams(max_tokens=4), request_id=name)


def admit(scheduler: Scheduler) -> list[str]:
    """One schedule() call, as the engine makes it: admitted requests get a (fake) decoder."""
    batch, admitted = scheduler.schedule()
    for request in admitted:
        request.decoder = object()
    return [r.request_id for r in batch]


def step(new_token_ids: list[list[int]], is_finished: bool = False, nfe: int = 1) -> StepOutput:
    lengths = [len(ids) for ids in new_token_ids]
    return StepOutput(new_token_ids, lengths, [is_finished] * len(new_token_ids), [nfe] * len(new_token_ids), nfe,
                      is_finished)


def test_scheduler_request_and_params_import_no_torch():
    # kstep/__init__.py loads `load` / `LLM` lazily: these modules and everything they import stay
    # plain Python.
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "import kstep, kstep.engine.scheduler, kstep.engine.request, kstep.params, kstep.outputs\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('kstep'))\n"
        "print(sorted(m for m in sys.modules if m.startswith('kstep.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "kstep.engine.scheduler" in proc.stdout  # the modules were really loaded from this checkout


def test_fcfs_order_and_max_batch_size():
    scheduler = Scheduler(max_batch_size=2, max_queue=8)
    for name in "abcde":
        scheduler.add(make_request(name))
    assert admit(scheduler) == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d", "e"]
    assert admit(scheduler) == ["a", "b"]  # running requests keep their slots
    scheduler.finish(scheduler.running[0])
    assert admit(scheduler) == ["b", "c"]  # the freed slot goes to the oldest waiting request
    for request in list(scheduler.running):
        scheduler.finish(request)
    assert admit(scheduler) == ["d", "e"]
    assert scheduler.num_waiting == 0 and scheduler.num_running == 2


def test_requests_join_while_others_run():
    scheduler = Scheduler(max_batch_size=3, max_queue=8)
    scheduler.add(make_request("a"))
    assert admit(scheduler) == ["a"]
    scheduler.add(make_request("b"))
    scheduler.add(make_request("c"))
    batch, admitted = scheduler.schedule()
    assert [r.request_id for r in batch] == ["a", "b", "c"]
    assert [r.request_id for r in admitted] == ["b", "c"]  # only the newcomers need a decoder
    scheduler.add(make_request("d"))
    batch, admitted = scheduler.schedule()
    assert [r.request_id for r in batch] == ["a", "b", "c"] and admitted == []  # full: d waits
    assert scheduler.has_work() and scheduler.num_waiting == 1


def test_abort_waiting_and_running_requests():
    scheduler = Scheduler(max_batch_size=2, max_queue=8)
    requests = {name: make_request(name) for name in "abcd"}
    for request in requests.values():
        scheduler.add(request)
    admit(scheduler)  # a, b run; c, d wait
    scheduler.abort("c")
    assert [r.request_id for r in scheduler.waiting] == ["d"]  # a waiting request leaves the queue at once
    assert requests["c"].is_aborted and requests["c"].decoder is None
    scheduler.abort("a")
    assert requests["a"].is_aborted
    assert admit(scheduler) == ["b", "d"]  # a running one leaves at the next step, and its slot is reused
    assert requests["a"] not in scheduler.running
    assert requests["a"].decoder is None  # its decoder (and KV cache) goes with it
    scheduler.abort("no-such-request")  # unknown (e.g. already finished): nothing happens
    assert admit(scheduler) == ["b", "d"]


def test_full_queue_raises_queue_full():
    scheduler = Scheduler(max_batch_size=2, max_queue=1)
    for name in "abc":  # two free slots plus one queue place
        scheduler.add(make_request(name))
    with pytest.raises(QueueFull, match="queue is full"):
        scheduler.add(make_request("d"))
    admit(scheduler)  # a, b run; c waits and fills the queue
    with pytest.raises(QueueFull):
        scheduler.add(make_request("d"))
    scheduler.finish(scheduler.running[0])
    scheduler.add(make_request("d"))  # a free slot: d may queue for the next step
    assert admit(scheduler) == ["b", "c"] and scheduler.num_waiting == 1


@pytest.mark.parametrize("max_batch_size,max_queue", [(0, 1), (-1, 1), (1, -1)])
def test_bad_limits_are_refused(max_batch_size, max_queue):
    with pytest.raises(ValueError, match="max_batch_size"):
        Scheduler(max_batch_size, max_queue)


def test_update_appends_step_outputs_and_finishes_requests():
    scheduler = Scheduler(max_batch_size=4, max_queue=8)
    a, b = make_request("a", rows=2), make_request("b")
    scheduler.add(a)
    scheduler.add(b)
    batch, _ = scheduler.schedule()
    a.decoder, b.decoder = object(), object()
    scheduler.update(batch, [step([[5], []], nfe=1), step([[7, 8]], nfe=1)])
    assert a.output_ids == [[5], []] and b.output_ids == [[7, 8]]
    assert not a.is_finished and not b.is_finished and scheduler.num_running == 2
    scheduler.update(batch, [step([[6, 9], [4]], nfe=2), step([[2]], is_finished=True, nfe=2)])
    assert a.output_ids == [[5, 6, 9], [4]] and a.nfe == 2
    assert b.output_ids == [[7, 8, 2]] and b.nfe == 2 and b.is_finished
    assert scheduler.running == [a]  # the finished request left the batch
    assert b.decoder is None and a.decoder is not None  # and dropped its decoder
    with pytest.raises(ValueError):  # one output per request of the batch, no fewer
        scheduler.update([a], [])


def test_finish_drops_the_decoder_and_the_slot():
    scheduler = Scheduler(max_batch_size=1, max_queue=8)
    a, b = make_request("a"), make_request("b")
    scheduler.add(a)
    scheduler.add(b)
    assert admit(scheduler) == ["a"]
    scheduler.finish(a)  # e.g. its decoder failed
    assert a.decoder is None and scheduler.running == []
    assert admit(scheduler) == ["b"]
    scheduler.finish(a)  # finishing twice is harmless
    assert scheduler.running == [b]
    scheduler.finish(b)
    assert not scheduler.has_work()
