"""Running one decoder alone, step by step: what `LLM.generate` does. The serving engine runs the
same decoders, their passes packed with other requests' (kstep/engine)."""
import time

from kstep.decoding.base import Decoder
from kstep.runner.model_runner import execute_passes


def decode_alone(decoder: Decoder, timings: dict[str, float], costs=None) -> tuple[list[list[int]], list[int]]:
    """Step the decoder to the end; returns per row its committed tokens and its nfe. Adds
    `{kind}_pass_seconds`, `num_{kind}_passes` and `positions_computed` (tokens run through the model)
    to timings; one-row single passes also go to
    `costs` (budget.PassCosts), which keeps the time-budget planner's table current."""
    rows: list[list[int]] | None = None
    row_nfe: list[int] = []
    step_start = time.perf_counter()
    while passes := decoder.next_passes():
        start = time.perf_counter()
        logits = execute_passes(passes)
        for p in passes:
            p.runner.synchronize()
        seconds = (time.perf_counter() - start) / len(passes)
        timings["positions_computed"] = timings.get("positions_computed", 0) + sum(p.num_tokens for p in passes)
        for p in passes:
            timings[f"{p.kind}_pass_seconds"] = timings.get(f"{p.kind}_pass_seconds", 0.0) + seconds
            timings[f"num_{p.kind}_passes"] = timings.get(f"num_{p.kind}_passes", 0) + 1
        out = decoder.update(logits)
        if costs is not None:  # the whole step: pass + update
            now = time.perf_counter()
            costs.observe_step(passes, now - step_start)
            step_start = now
        rows = rows or [[] for _ in out.new_token_ids]
        for row, new in zip(rows, out.new_token_ids, strict=True):
            row.extend(new)
        row_nfe = out.row_nfe
    return rows or [], row_nfe
