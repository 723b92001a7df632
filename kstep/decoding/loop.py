"""Running one decoder alone, pass by pass: what `LLM.generate` does. The serving engine runs the
same decoders, their passes packed with other requests' (kstep/engine)."""
import time
from typing import Protocol

import torch

from kstep.runner.model_runner import ForwardPass, ModelRunner


class Decoder(Protocol):
    nfe: int
    is_finished: bool

    def next_pass(self) -> ForwardPass | None: ...

    def update(self, logits: torch.Tensor) -> None: ...


def decode_alone(runner: ModelRunner, decoder: Decoder, timings: dict[str, float]) -> None:
    """Step the decoder to the end; adds `{kind}_pass_seconds` and `num_{kind}_passes` to timings."""
    while (forward_pass := decoder.next_pass()) is not None:
        start = time.perf_counter()
        logits = runner.logits(forward_pass)
        runner.synchronize()
        key = forward_pass.kind
        timings[f"{key}_pass_seconds"] = timings.get(f"{key}_pass_seconds", 0.0) + time.perf_counter() - start
        timings[f"num_{key}_passes"] = timings.get(f"num_{key}_passes", 0) + 1
        decoder.update(logits)
