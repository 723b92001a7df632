"""Whether a request fits a model's context: its longest prompt, its completion and what its
decoding needs past them (a speculative step's drafts, a block model's last block, a random-start
model's whole canvases, an infilling suffix, which takes no structured output). Plain Python, no torch."""
from kstep.kinds import AUTOREGRESSIVE, BLOCK_DIFFUSION, UNIFORM_DIFFUSION


def check_context(rows: list[list[int]], params, suffixes: list[list[int]] | None, kind: str, family_kind: str,
                  max_positions: int, canvas_length: int | None) -> None:
    """A ValueError naming what does not fit: `kind` is the request's decoding (a tri-mode model's
    mode's), `family_kind` the family's own."""
    if not rows:
        raise ValueError("no prompts given")
    longest = max(len(ids) for ids in rows)
    extra, why = 0, ""
    if suffixes and any(suffixes):
        if params.structured is not None:
            raise ValueError(f"suffix: infilling with a structured output ({params.structured.field}) is not "
                             "supported: its grammar constrains a completion from its start to its end")
        extra, why = max(len(s) for s in suffixes), " + suffix"
    if kind == AUTOREGRESSIVE and params.num_draft_tokens:
        extra, why = params.num_draft_tokens + 1, " + num_draft_tokens + 1"
    elif kind == BLOCK_DIFFUSION:  # the last block may end up to a block past max_tokens
        extra, why = params.block_length, f" + block_length ({params.block_length})"
    elif family_kind == UNIFORM_DIFFUSION:  # whole canvases
        extra, why = -params.max_tokens % canvas_length, f" in canvases of {canvas_length}"
    if longest + params.max_tokens + extra > max_positions:
        raise ValueError(f"prompt ({longest} tokens) + max_tokens ({params.max_tokens}){why} exceeds the model's "
                         f"context of {max_positions}")
