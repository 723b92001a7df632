"""Typed results that cross boundaries: a decoder's step (`StepOutput`, decoder -> engine and
`LLM.generate`) and a finished generation (`GenerationResult`, the public API). Plain Python."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class StepOutput:
    """What one step of a decoder committed, per row of its batch. A committed token is final: it
    and everything before it can no longer change (AR: every sampled token; diffusion: the leading
    run of unmasked positions)."""
    new_token_ids: list[list[int]]   # per row: tokens committed in this step, after the earlier ones
    committed_lengths: list[int]     # per row: committed tokens so far
    finished: list[bool]             # per row: its completion is final (stop token or max_tokens)
    row_nfe: list[int]               # per row: forward passes it needed so far (what it takes alone)
    nfe: int                         # the batch's forward passes of its own model so far
    is_finished: bool                # the decoder needs no further pass
    canvas: list[list[int]] | None = None  # per row: every position, masks included (when asked for)

    @property
    def num_committed(self) -> int:
        return sum(len(ids) for ids in self.new_token_ids)


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]             # the completion, cut at the first end-of-sequence token
    finish_reason: str               # "stop" (end-of-sequence reached) or "length"
    nfe: int                         # forward passes this row needed (what it takes alone); timings["batch_passes"]: the batch's
    seconds: float                   # generation time, excluding loading
    prompt_tokens: int
    text: str | None = None          # when the checkpoint has a tokenizer
    timings: dict[str, float | str] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / self.nfe if self.nfe else 0.0

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "nfe": self.nfe, "seconds": round(self.seconds, 6), "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "tokens_per_forward": round(self.tokens_per_forward, 4),
                "timings": {k: round(v, 6) if isinstance(v, float) else v for k, v in self.timings.items()}}
