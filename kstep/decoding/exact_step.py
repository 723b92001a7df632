"""The exact-step interfaces: what lossless self-speculation drives of the sampler it equals.

A self-speculative decoder (self_speculation.py, block_self_speculation.py) wraps an exact sampler
and runs its passes itself: it drafts several of the sampler's steps from one pass's predictions,
then verifies them with one pass over the drafts. For the drafts to be the sampler's own steps it
calls the sampler's scoring and step on canvases of its choosing, never a copy of them. These
classes declare that surface (the state it reads and the methods it calls); the samplers implement
them and the wrappers call nothing else.
"""
from abc import ABC, abstractmethod

import torch

from kstep.params import GenerationParams
from kstep.runner.model_runner import ForwardPass, ModelRunner
from kstep.runner.pass_output import PassOutput
from kstep.runner.top_tokens import TopRequest


class CanvasExactStep(ABC):
    """A canvas sampler's step (masked_diffusion.py's DiffusionDecoder, dream.py's DreamDecoder),
    for self_speculation.py: one canvas (B, L), its current block, one step per pass."""
    runner: ModelRunner
    params: GenerationParams
    canvas: torch.Tensor            # (B, L) prompt, completion (masks where undecided), suffix
    key_mask: torch.Tensor | None   # (B, L) True = a real position
    kv: list | None                 # the block start's cache (prefix / dual), None without a cache
    mask_id: int
    logits_shift: int               # the pass reads the block's predictions at [start, end) - shift
    is_block_sampler: bool          # a block's first pass commits its first token (Dream's cached sampler)
    step_idx: int                   # the batch's step in the current block
    columns: torch.Tensor | None    # the last pass's block columns with outputs
    drawn_over: tuple | None        # the last pass's random draws' layout (unmask.py's DrawnOver)
    top: TopRequest | None          # what its greedy passes ask for instead of logits
    stop_ids: torch.Tensor
    include_canvas: bool
    committed: list[int]            # per row, the committed length reported so far
    is_finished: bool

    @property
    @abstractmethod
    def completions(self) -> torch.Tensor:
        """(B, max_tokens) the gap after the prompt: tokens, masks where still masked."""

    @property
    @abstractmethod
    def block(self) -> tuple[int, int]:
        """[start, end) of the current block in the canvas."""

    @abstractmethod
    def next_passes(self) -> list[ForwardPass]:
        """The sampler's own next pass (a block's first pass, cached or not)."""

    @abstractmethod
    def scores(self, out: PassOutput, columns: torch.Tensor, drawn_over=None,
               rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each block column's candidate and confidence (R, block_length) from a pass's outputs of
        the block's `columns` (`rows`: the batch rows the outputs are of)."""

    @abstractmethod
    def step(self, canvas: torch.Tensor, candidates: torch.Tensor, confidence: torch.Tensor,
             step_idx: int | torch.Tensor) -> torch.Tensor:
        """The sampler's step `step_idx` (the batch's, or each row's) on `canvas` in place; the chosen positions."""

    @abstractmethod
    def end_block(self) -> None:
        """Every row has finished the current block: on to the next one (or finish)."""


class BlockExactStep(ABC):
    """A block sampler's step (block_diffusion.py's BlockDiffusionDecoder), for
    block_self_speculation.py: rows with their own blocks and phases, a KV cache of the finished blocks."""
    runner: ModelRunner
    params: GenerationParams
    canvas: torch.Tensor            # (B, slots) prompt and blocks; row b's position p at slot pads[b] + p
    real: torch.Tensor              # (B, slots) True = a real slot
    kv: list | None
    spare_slots: int                # cache slots past the canvas (never attended)
    pads: torch.Tensor              # (B,) each row's left padding
    block_starts: torch.Tensor      # (B,) position of each row's current block
    phase: torch.Tensor             # (B,) DENOISE | COMMIT | DONE
    passes_in_block: torch.Tensor   # (B,) passes run in the current block
    row_nfe: torch.Tensor           # (B,) passes each row needed
    lengths: list[int]              # committed tokens reported per row
    needs_prefill: bool
    columns: torch.Tensor | None
    top: TopRequest | None
    mask_id: int
    stop_ids: torch.Tensor
    include_canvas: bool
    is_finished: bool

    @abstractmethod
    def next_passes(self) -> list[ForwardPass]:
        """The sampler's own next pass (a prefill, block starts, commits)."""

    @abstractmethod
    def update(self, outputs: list[PassOutput]):
        """Apply its own pass (the prefill's)."""

    @abstractmethod
    def block_outputs(self, out: PassOutput, half: torch.Tensor) -> PassOutput:
        """(B, bs) the outputs predicting each row's block, which starts at column half[b] * bs of `out`."""

    @abstractmethod
    def block_scores(self, out: PassOutput, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens, their probability and confidence (R, bs) from outputs (R, bs) predicting the
        blocks of batch rows `rows` (R,)."""

    @abstractmethod
    def block_step(self, blocks: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor,
                   passes: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """The sampler's step on blocks (R, bs) at their passes in the block (R,), for `live` rows."""

    @abstractmethod
    def commit(self, last: PassOutput, rows: torch.Tensor) -> None:
        """`rows`' finished blocks are in the cache: their next blocks begin (`last`: the finished block's last outputs)."""

    @abstractmethod
    def update_phases(self) -> None:
        """Denoised blocks go to commit; finished rows to done."""

    @abstractmethod
    def is_final(self) -> torch.Tensor:
        """(B,) rows whose completion can no longer change."""

    @abstractmethod
    def settled(self) -> torch.Tensor:
        """(B, max_tokens) the completions, tokens that may still change shown as masks."""

    @abstractmethod
    def completions(self) -> torch.Tensor:
        """(B, max_tokens) the completions (masks where undecided)."""
