"""Fast-dLLM v2's block cache (`use_block_cache=True` of its `generate` / `batch_sample`, the setting its
published evaluations run with): inside a block, a pass may run only the current sub-block.

A block's first pass, and the first pass of each sub-block (its first position still a mask), run
the whole block, whose keys/values stay in the cache as the block cache. The other passes run only
the sub-block, bidirectionally against the finished blocks and the whole block cache, whose
sub-block slots they overwrite in place; the rest of the block's keys stay as the last whole pass
left them, so the pass is approximate, as Fast-dLLM's DualCache is for LLaDA. Token for token its
reference in that mode (tests/block_reference.py `use_block_cache`).

In a batch whose rows disagree (one starts a sub-block, another is inside one), the pass runs the
whole block for every row, and a row inside its sub-block writes the keys of its positions outside
the sub-block to a spare slot no query reads, keeping its block cache: each row gets the pass it
would get alone.
"""
import torch

from kstep.decoding.block_diffusion import COMMIT, DENOISE, DONE, BlockDiffusionDecoder
from kstep.decoding.block_unmask import open_columns
from kstep.outputs import StepOutput
from kstep.runner.model_runner import ForwardPass
from kstep.runner.pass_output import PassOutput


class BlockCacheDecoder(BlockDiffusionDecoder):
    spare_slots = 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rows = self.canvas.shape[0]
        self.has_block_cache = torch.zeros(rows, dtype=torch.bool, device=self.canvas.device)
        self.ran_whole = torch.zeros_like(self.has_block_cache)  # the last pass ran a row's whole block
        self.sub_pass = False

    def _open_sub_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) each row's open sub-block's first column in its block, and (B,) whether that column is
        still a mask (the sub-block begins: its pass runs the whole block)."""
        bs, sub = self.params.block_length, self.params.sub_block_length
        starts = self.pads + self.block_starts
        block = self.canvas.gather(1, starts[:, None] + torch.arange(bs, device=starts.device))
        lo = open_columns(block, self.mask_id, sub).float().argmax(-1) // sub * sub
        return lo, block.gather(1, lo[:, None]).squeeze(1) == self.mask_id

    def _next_passes(self) -> list[ForwardPass]:
        if self.is_finished:
            return []
        active = (self.phase != DONE)
        self.lo, begins = self._open_sub_blocks()  # once per step: the pass and its key writes read them
        whole = (self.phase == DENOISE) & (~self.has_block_cache | begins)  # rows that run their whole block
        self.sub_pass = not self.needs_prefill and not bool((self.phase == COMMIT).any()) and not bool(whole[active].any())
        if not self.sub_pass:
            # which rows this pass runs a whole current block for: a fused commit runs the next block's
            # too; a prefill runs none (unless it is fused, for an unshifted model)
            self.ran_whole = whole | ((self.phase == COMMIT) & self.fused)
            if self.needs_prefill and not self.fused_prefill:
                self.ran_whole = torch.zeros_like(whole)
            return super()._next_passes()
        sub, bs, lo = self.params.sub_block_length, self.params.block_length, self.lo
        block_slots = self.pads + self.block_starts  # (B,)
        offsets = torch.arange(sub, device=lo.device)
        ids = self.canvas.gather(1, (block_slots + lo)[:, None] + offsets)
        positions = (self.block_starts + lo)[:, None] + offsets
        return [self.runner.ragged_causal_pass(ids, positions, block_slots + lo, self.real, self.kv, is_causal=False,
                                               kind="block", attend_until=block_slots + bs)]

    def _write_slots(self, index: torch.Tensor) -> torch.Tensor | None:
        """A whole-block pass for rows that did not want one: their positions outside the open
        sub-block write to the spare slot (their block cache stays)."""
        keep = (self.phase == DENOISE) & self.has_block_cache & ~self.ran_whole  # rows inside a sub-block
        if self.needs_prefill or not bool(keep.any()):
            return None
        sub, lo = self.params.sub_block_length, self.lo
        column = torch.arange(index.shape[1], device=index.device)
        inside = (column >= lo[:, None]) & (column < (lo + sub)[:, None])  # (B, width)
        spare = self.kv.length - 1
        return torch.where(keep[:, None] & ~inside, spare, index)

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        if not self.sub_pass:
            ran = self.ran_whole.clone()
            step = super().update(outputs)
            if not self.needs_prefill:  # (a prefill's chunk before its last runs no block)
                # rows that ran their whole block now have its keys cached (a new block's first pass included)
                self.has_block_cache |= ran & (self.phase == DENOISE)
            return step
        [out] = outputs  # (B, sub): the sub-block's outputs
        self.nfe += 1
        active = self.phase != DONE
        self.row_nfe += active
        sub = out.shape[1]
        # shifted (Fast-dLLM v2): position lo + j reads the output at lo + j - 1, inside the sub-block;
        # the sub-block's first position (filled: else the pass would have run the whole block) its own
        source = (torch.arange(sub, device=out.device) - 1).clamp(min=0)
        columns = self.lo[:, None] + torch.arange(sub, device=out.device)  # (B, sub)
        self._denoise(out[:, source].scatter(self.params.block_length, columns), active & (self.phase == DENOISE))
        self.update_phases()
        return self._output()

    def _next_block(self, rows: torch.Tensor) -> None:
        super()._next_block(rows)
        self.has_block_cache = self.has_block_cache & ~rows  # a new block has no block cache yet
