"""Running one decoder alone, step by step: what `LLM.generate` does. The serving engine runs the
same decoders, their passes packed with other requests' (kstep/engine)."""
import time

from kstep.decoding.base import Decoder
from kstep.runner.model_runner import execute_passes


def decode_alone(decoder: Decoder, timings: dict[str, float]) -> tuple[list[list[int]], list[int]]:
    """Step the decoder to the end; returns per row its committed tokens and its nfe. Adds
    `{kind}_pass_seconds` and `num_{kind}_passes` to timings."""
    rows: list[list[int]] | None = None
    row_nfe: list[int] = []
    while passes := decoder.next_passes():
        start = time.perf_counter()
        logits = execute_passes(passes)
        for p in passes:
            p.runner.synchronize()
        seconds = (time.perf_counter() - start) / len(passes)
        for p in passes:
            timings[f"{p.kind}_pass_seconds"] = timings.get(f"{p.kind}_pass_seconds", 0.0) + seconds
            timings[f"num_{p.kind}_passes"] = timings.get(f"num_{p.kind}_passes", 0) + 1
        out = decoder.update(logits)
        rows = rows or [[] for _ in out.new_token_ids]
        for row, new in zip(rows, out.new_token_ids, strict=True):
            row.extend(new)
        row_nfe = out.row_nfe
    return rows or [], row_nfe
