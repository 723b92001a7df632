"""LLaDA2.1's token editing (inclusionAI, `modeling_llada2_moe.py` `generate` of LLaDA2.1, vendored
in ZHZisZZ/dllm `dllm/pipelines/llada21/models/`): inside the block being decoded, a pass may also
replace tokens it filled earlier.

Each pass unmasks as LLaDA2.0 does (M2T: every mask above the threshold, at least one) and edits
(T2T): a position of the block that was filled before this pass (never a prompt position) takes the
pass's token where that token differs and its probability is above `editing_threshold`. Once the
block has no masks, passes go on while they edit: a pass that starts mask-free and edits nothing
ends the block (its keys, computed from exactly the final tokens, are already in the cache: no
commit pass), and after `max_post_steps` such passes the block ends regardless (its keys came from
tokens that were edited since, so it is committed like any block).

Owns the per-row counters and the edit choice; the block decoder owns the canvas and the passes.
Until its block ends, a token may still change: the decoder reports only tokens of ended blocks as
committed (the streaming contract: committed text is never retracted).
"""
import torch


class TokenEditing:
    def __init__(self, threshold: float, max_post_steps: int, rows: int, device: torch.device, mask_id: int):
        self.threshold, self.max_post_steps, self.mask_id = threshold, max_post_steps, mask_id
        self.post_passes = torch.zeros(rows, dtype=torch.long, device=device)  # mask-free passes counted, per block
        self.started_full = torch.zeros(rows, dtype=torch.bool, device=device)  # the last pass began mask-free
        self.edited = torch.zeros(rows, dtype=torch.bool, device=device)        # ... and changed some token
        self.num_edits = 0

    def edits(self, block: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, is_masked: torch.Tensor,
              editable: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(B, bs) positions this pass edits: filled before it (`editable`: not masks, not prompt),
        a different token (`tokens`) with probability (`probs`) above the threshold. Records, for
        the rows that ran (`rows` (B,)), whether the pass began mask-free and whether it edited."""
        edit = editable & rows[:, None] & (tokens != block) & (probs > self.threshold)
        self.started_full = rows & ~is_masked.any(-1)
        self.edited = edit.any(-1)
        self.num_edits += int(edit.sum())
        return edit

    def edit_block(self, block: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, editable: torch.Tensor,
                   rows: torch.Tensor, grammar=None, index: torch.Tensor | None = None) -> torch.Tensor:
        """The block (B, bs) with this pass's edits (`edits`) made; under a structured output's grammar
        (kstep/structured/constraint.py's `edit`) only the edits it allows, and what no longer parses
        after one masked again."""
        edit = self.edits(block, tokens, probs, block == self.mask_id, editable, rows)
        if grammar is not None:
            return grammar.edit(block, tokens, edit, index)
        return torch.where(edit, tokens, block)

    def block_ends(self, complete: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Given the rows whose block has no mask left after this pass (`complete` (B,)): (rows whose
        block ended with its keys exact (a mask-free pass that edited nothing), rows whose block
        ended by the cap on mask-free passes (its keys to be committed))."""
        exact = complete & self.started_full & ~self.edited
        going_on = complete & ~exact  # the reference counts the next mask-free pass before running it
        self.post_passes += going_on
        capped = going_on & (self.post_passes > self.max_post_steps)
        ended = exact | capped
        self.post_passes = torch.where(ended, 0, self.post_passes)
        self.started_full &= ~ended
        self.edited &= ~ended
        return exact, capped

    @staticmethod
    def settled(completions: torch.Tensor, prompt_lengths: torch.Tensor, ended: torch.Tensor, done: torch.Tensor,
                mask_id: int) -> torch.Tensor:
        """completions (B, N) with the positions at or after `ended` (B,) (the first position of a
        block that has not ended) masked, except in finished rows (`done`)."""
        positions = prompt_lengths[:, None] + torch.arange(completions.shape[1], device=completions.device)
        return completions.masked_fill((positions >= ended[:, None]) & ~done[:, None], mask_id)
