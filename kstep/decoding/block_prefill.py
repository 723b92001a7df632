"""A block-diffusion prompt into the cache: its whole blocks, block-causally, in one pass or (under the
engine's step budget, base.Decoder.prefill_chunk) in chunks of whole blocks, one a step.

A chunk ends on a block boundary, so its queries attend to the blocks before it (cached) and to
their own block whole: the same attention as the single pass. Chunks are counted from the first
column not cached (0, or where a shared prefix ends) in fixed sizes (the chunk rounded down to whole
blocks), so a request's chunks do not depend on its neighbours. The last chunk runs everything left,
with the outputs the decoder reads (the last prompt position; an unshifted model's fused first block),
so it may be up to two blocks longer than the chunk. Chunks need unpadded prompts (every row's blocks
at the same columns); a padded batch prefills whole, as a request packs one prompt per decoder."""
import torch

from kstep.runner.model_runner import ForwardPass


def next_chunk_end(start: int, end: int, needed_from: int, block_size: int, chunk: int | None) -> int:
    """Where the prefill's pass from column `start` (a block boundary) ends: `end` (all of it) unless
    a chunk of whole blocks ends at or before the block holding `needed_from` (the first column whose
    output is read), which the last chunk must run."""
    if chunk is None:
        return end
    size = max(block_size, chunk // block_size * block_size)
    return start + size if start + size <= needed_from // block_size * block_size else end


class BlockPrefill:
    """The prefill part of block_diffusion.py's decoder (its attributes: canvas, real, kv, prompt_width,
    prefix_cache, fused_prefill, params, runner, rows' nfe)."""
    prefilled: int | None = None  # columns cached so far (None: the prefix cache not asked yet)

    def _prefill_pass(self) -> list[ForwardPass]:
        """The prefill's next pass: all of it, or its next chunk; [] while its chunk waits for a step
        with room (the engine's prefill_budget)."""
        W, bs, B = self.prompt_width, self.params.block_length, self.canvas.shape[0]
        if self.prefilled is None:
            self.prefilled = 0
            if self.prefix_cache is not None:  # the last whole block always runs: its output may be needed
                whole = W // bs * bs
                self.prefilled = self.num_cached_tokens = \
                    self.prefix_cache.load(self.canvas[0, :whole].tolist(), self.kv, whole - bs)
        start, last = self.prefilled, self._prefill_end()
        # slots [0, W + bs) hold every row's first block when it is fused: columns [W - bs, W + bs) predict it
        needed_from = W - bs if self.fused_prefill else W - 1
        padded = not bool(self.real[:, :last].all())
        end = next_chunk_end(start, last, needed_from, bs, None if padded else self.prefill_chunk)
        if not self.prefill_fits((end - start) * B):
            return []  # waits for a step with room
        self.kv = self.cache.room(self.kv, end)  # (the first room has the prompt's slots already)
        self.prefilled = end
        key_mask = self.real[:, :end] if padded else None
        prefill = self.runner.block_prefill_pass(self.canvas[:, :end], key_mask, bs, self.kv, start)
        if end == last and self.fused_prefill:
            prefill.logits_from, prefill.logits_to = needed_from - start, end - start
        return [prefill]

    def prefill_done(self, outputs: list) -> bool:
        """After a prefill pass (or none): whether the prompt is all cached (the outputs are the last
        chunk's); a chunk before it counts as a pass of every row."""
        if self.prefilled == self._prefill_end():
            return True
        self.nfe += len(outputs)
        self.row_nfe += len(outputs)
        return False

    def _prefill_end(self) -> int:
        return self.prompt_width + (self.params.block_length if self.fused_prefill else 0)
