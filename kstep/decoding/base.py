"""The decoder contract: what every family's decoder is to the engine and to `LLM.generate`.

Every decoder is built the same way, `cls(runner, batch, params, resources)` (decoding/table.py picks
the class), and a self-speculation wrapper as `wrapper(exact_decoder, num_draft_tokens)` around the
exact-step interface below (`ExactStep`). A decoder owns one canvas batch (B rows decoded together
with the same params) and is a step machine: `next_passes()` describes the forward passes its next step needs (each names the runner
that executes it: the target model, or a speculative draft model), the caller runs them (alone, or
packed with other requests' passes of the same runner), and `update(logits)` applies the step and
returns a `StepOutput`. Callers never look inside a decoder.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kstep.outputs import StepOutput
from kstep.params import GenerationParams
from kstep.registry import BlockRules
from kstep.runner.model_runner import ForwardPass, ModelRunner
from kstep.runner.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from kstep.structured.constraint import Constraint


@dataclass(slots=True, frozen=True)
class DecoderResources:
    """What a decoder may share with other requests or take from its family: the AR prefix cache, a
    speculative drafter (a draft model's runner, or "ngram"), a block family's rules."""
    prefix_cache: PrefixCache | None = None
    draft: "ModelRunner | str | None" = None
    rules: BlockRules | None = None


@dataclass(slots=True)
class DecodeBatch:
    """What a decoder starts from: the prompts left-padded into one batch, and the ids it needs."""
    prompts: torch.Tensor              # (B, P)
    key_mask: torch.Tensor | None      # (B, P) True = real token; None when nothing is padded
    stop_ids: torch.Tensor             # (S,) end-of-sequence ids (at least one entry; -1 when none)
    pad_id: int
    mask_id: int | None                # diffusion families
    generator: torch.Generator | None  # seeded sampling
    include_canvas: bool = False       # report every position each step (`StepOutput.canvas`)
    first_allowed: torch.Tensor | None = None  # (B, V) bool: token healing's first tokens per row
    suffixes: torch.Tensor | None = None      # (B, S) infilling: the text after the gap, right-padded
    suffix_mask: torch.Tensor | None = None   # (B, S) True = real suffix token; None when nothing is padded
    constraint: "Constraint | None" = None    # a structured output's grammar, one matcher per row (kstep/structured)

    @classmethod
    def from_prompts(cls, rows: list[list[int]], pad_id: int, stop_ids: list[int], mask_id: int | None,
                     device: torch.device, seed: int | None = None, include_canvas: bool = False,
                     first_allowed: torch.Tensor | None = None,
                     suffixes: list[list[int]] | None = None, constraint: "Constraint | None" = None) -> "DecodeBatch":
        width = max(len(ids) for ids in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        key_mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for row, prompt in enumerate(rows):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            key_mask[row, width - len(prompt):] = True
        has_padding = not bool(key_mask.all())
        generator = None if seed is None else torch.Generator(device).manual_seed(seed)
        suffix_ids = suffix_mask = None
        if suffixes and any(suffixes):  # right-padded: every row's gap starts right after its prompt
            width = max(len(s) for s in suffixes)
            suffix_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            suffix_mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for row, suffix in enumerate(suffixes):
                suffix_ids[row, :len(suffix)] = torch.tensor(suffix, dtype=torch.long)
                suffix_mask[row, :len(suffix)] = True
            suffix_ids = suffix_ids.to(device)
            suffix_mask = None if bool(suffix_mask.all()) else suffix_mask.to(device)
        return cls(ids.to(device), key_mask.to(device) if has_padding else None,
                   torch.tensor(stop_ids or [-1], device=device), pad_id, mask_id, generator, include_canvas,
                   None if first_allowed is None else first_allowed.to(device), suffix_ids, suffix_mask, constraint)

    @property
    def num_rows(self) -> int:
        return self.prompts.shape[0]


class Decoder(ABC):
    nfe: int = 0                       # forward passes of its own model so far (the batch's)
    is_finished: bool = False
    keeps_grammar: bool = False        # it applies DecodeBatch.constraint (kstep/structured/constraint.py)
    constraint: "Constraint | None" = None  # the batch's, once LLM.make_decoder built it (its figures)
    # Chunked prefill (the engine's --max-num-batched-tokens): a prompt runs in chunks of `prefill_chunk`
    # tokens, one a step (None: whole), at fixed boundaries, so its numbers do not depend on its neighbours;
    # a chunk larger than `prefill_budget` (what the step has left; None: go) waits for a later step.
    # A decoder whose passes cannot be split takes no notice.
    prefill_chunk: int | None = None
    prefill_budget: int | None = None

    def __init__(self, runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                 resources: DecoderResources = DecoderResources()):
        """Start decoding `batch` under resolved `params` on `runner`."""

    @abstractmethod
    def next_passes(self) -> list[ForwardPass]:
        """The passes of the next step (empty once finished); independent of each other."""

    @abstractmethod
    def update(self, logits: list[torch.Tensor]) -> StepOutput:
        """Apply the step given each pass's logits, in the order `next_passes` returned them."""

    def prefill_fits(self, tokens: int) -> bool:
        """Whether a prefill pass of `tokens` tokens fits what the step has left (prefill_budget)."""
        return self.prefill_budget is None or tokens <= self.prefill_budget

    def next_chunk(self, start: int, end: int, rows: int) -> int | None:
        """Where this step's causal prefill pass from column `start` ends: `end`, or its chunk's end
        before it (prefill_chunk); None when that pass of `rows` rows does not fit the step (it waits)."""
        if self.prefill_chunk is not None:
            end = min(end, start + self.prefill_chunk)
        return end if self.prefill_fits((end - start) * rows) else None

    def evict(self) -> bool:
        """Drop its KV caches (their pages go back) and keep everything else, to resume where it was
        (the next passes rebuild the caches): True if it can. False: the engine drops the decoder, and
        the request recomputes from its prompt."""
        return False

    def reserve(self) -> None:
        """Take now every KV page it may need (PoolFull if they are not free): a request that resumes
        after a preemption is not preempted again. Caches taken whole when it starts: nothing to do."""

    def step_tokens(self) -> int:
        """The most tokens one of its steps runs once under way (a prefill aside): what the engine's
        step budget counts when it admits it. 0: one a row (a decode, the engine counts them);
        whole-canvas decoders count their canvas."""
        return 0

    def stats(self, row: int | None = None) -> dict[str, float | str]:
        """Decoder-specific figures for the result's timings (e.g. draft acceptance): the batch's, or
        row `row`'s own where the decoder counts them per row."""
        return {}


def leading_unmasked(completions: torch.Tensor, mask_id: int) -> torch.Tensor:
    """(B, N) -> (B,) length of each row's leading run without masks: what no later step can change."""
    is_mask = completions == mask_id
    return torch.where(is_mask.any(-1), is_mask.float().argmax(-1), completions.shape[1])


def final_rows(completions: torch.Tensor, mask_id: int, stop_ids: torch.Tensor) -> torch.Tensor:
    """(B, N) -> (B,) rows whose completion can no longer change: no mask left, or a stop token with
    nothing masked before it."""
    N = completions.shape[1]
    first_mask = leading_unmasked(completions, mask_id)
    is_stop = torch.isin(completions, stop_ids)
    first_stop = torch.where(is_stop.any(-1), is_stop.float().argmax(-1), N)
    return (first_stop < first_mask) | (first_mask == N)


def prefix_step_output(decoder: Decoder, completions: torch.Tensor, committed: list[int], mask_id: int,
                       stop_ids: torch.Tensor, row_nfe: torch.Tensor, include_canvas: bool,
                       finished: torch.Tensor | None = None, canvas: torch.Tensor | None = None) -> StepOutput:
    """A StepOutput for a canvas decoder: rows commit their leading unmasked run; `committed` (the
    lengths reported so far) is updated in place. A row is finished (unless the decoder says) once
    its completion is final (`final_rows`). `canvas`: what the canvas channel shows, when it holds
    more than `completions` (tokens that may still change, shown there as masks)."""
    lengths = leading_unmasked(completions, mask_id).tolist()
    rows = completions.tolist()
    new = [row[old:length] for row, old, length in zip(rows, committed, lengths, strict=True)]
    if finished is None:
        finished = final_rows(completions, mask_id, stop_ids)
    committed[:] = lengths
    shown = rows if canvas is None else canvas.tolist() if include_canvas else None
    return StepOutput(new, lengths, finished.tolist(), row_nfe.tolist(), decoder.nfe, decoder.is_finished,
                      shown if include_canvas else None)
