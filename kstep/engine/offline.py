"""`LLM.generate`'s path: one request through an engine of its own, so an offline batch takes the
server's path (the KV pool's admission and growth, preemption, the same decoders' steps)."""
from kstep.engine.engine import Engine
from kstep.engine.request import Request
from kstep.engine.served_model import ServedModel
from kstep.runner.kv_pool import KVBudgetExceeded


def run_alone(llm: ServedModel, request: Request) -> Request:
    """Step `request` to its end on an engine of its own (torch's generator when it is unseeded, no
    detokenising: the caller reads the ids); raises what failed it."""
    engine = Engine(llm, max_batch_size=1, assigns_seeds=False, detokenizes=False)
    engine.add_request(request)
    while engine.has_work():
        for out in engine.step()[0]:
            if out.error is not None:
                if request.exception is not None:
                    raise request.exception
                raise KVBudgetExceeded(out.error) if out.error_code == "kv_budget_exceeded" else RuntimeError(out.error)
    return request
