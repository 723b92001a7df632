"""`LLM.generate`'s path: one request through an engine of its own, so an offline batch takes the
server's path (the KV pool's admission and growth, preemption, the same decoders' steps); and a
server's warm-up, one tiny generation."""
import torch

from kstep.engine.engine import Engine
from kstep.engine.request import Request
from kstep.engine.served_model import ServedModel
from kstep.params import knob_applies


def run_alone(llm: ServedModel, request: Request) -> Request:
    """Step `request` to its end on an engine of its own (torch's generator when it is unseeded, no
    detokenising: the caller reads the ids); raises what failed it."""
    engine = Engine(llm, max_batch_size=1, offline=True)
    engine.add_request(request)
    while engine.has_work():
        for out in engine.step()[0]:
            if out.error is not None:  # a refusal's exception, or (a recomputation that differed) the message
                raise request.exception or RuntimeError(out.error)
    return request


def warm_up(llm: ServedModel) -> None:
    """One tiny generation so the first request does not pay for lazy initialisation."""
    # (a random-start model: one decoder pass, not a canvas's worth)
    quick = {"max_denoising_steps": 1} if knob_applies("max_denoising_steps", llm.cfg.family, llm.kind) else {}
    with torch.inference_mode():
        llm.generate([llm.pad_id if llm.pad_id != llm.cfg.mask_token_id else 0], max_tokens=2, **quick)
