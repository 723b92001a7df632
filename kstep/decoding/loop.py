"""One decoder stepped alone, outside the engine: for callers that built a decoder themselves (tests
of a decoder's internals). `LLM.generate` and the server run decoders on the engine (kstep/engine)."""
from kstep.decoding.base import Decoder
from kstep.runner.model_runner import execute_passes


def decode_alone(decoder: Decoder) -> tuple[list[list[int]], list[int]]:
    """Step the decoder to the end; returns per row its committed tokens and its nfe."""
    rows: list[list[int]] | None = None
    row_nfe: list[int] = []
    while passes := decoder.next_passes():
        out = decoder.update(execute_passes(passes))
        rows = rows or [[] for _ in out.new_token_ids]
        for row, new in zip(rows, out.new_token_ids, strict=True):
            row.extend(new)
        row_nfe = out.row_nfe
    return rows or [], row_nfe
