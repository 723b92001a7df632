"""Lossless self-speculative diffusion decoding (FreeDave, arXiv:2510.00294, cychomatica/FreeDave;
SSD, arXiv:2510.04147): the exact sampler's output, token for token, in fewer sequential passes.

The exact sampler (`exact`: no cache, the fixed schedule, greedy) takes one step per pass: the
pass's predictions on the current canvas decide the step (which masks take which tokens). From one
pass's predictions the next K steps are drafted as if the predictions would not change: draft 1 is
the exact next canvas, draft k applies the schedule's step k to draft k-1 with the same stale
predictions. One pass over the drafts (K canvases as K rows: the engine packs them with other
requests' passes) gives each draft its own predictions, so the exact step from draft k is known,
and draft k+1 is kept while it equals that step's result. The kept drafts are exactly the exact
sampler's canvases, and the last kept one's predictions start the next round: a pass advances
1 + (drafts kept) steps, at the price of K canvases' positions (on a bandwidth-bound GPU a pass of
K canvases costs about one; on this CPU it costs about K).

With a prefix or dual cache (Fast-dLLM's), the sampler to equal is the same fixed schedule run with
that cache: a block starts with a full pass that caches every position's keys/values, and each later
step is a window pass against that cache. Each draft of a row then gets a KV cache row of its own
(`draft_kv`, K rows per batch row) holding a copy of the row's cache from its block start, and the
verification runs the K drafts as window passes there: only the open window's positions (the block
alone with the dual cache), each draft's pass the one the cached sampler would run on it. Dream's
block sampler commits a block's first token from its block-start pass; its drafts start from the
block's second pass.

A draft that completes the block ends the chain and needs no verification of its own (the next
block starts with a pass of its own, as in the exact sampler); a chain whose first draft completes
the block is applied without a pass. Rows of a batch advance apart, each at its own step of the
block, and the batch moves on once every row has finished the block. The step itself is the exact
decoder's (`scores` and `step` of masked_diffusion.py / dream.py), so the two cannot drift apart.
"""
import torch

from kstep.decoding.base import Decoder, prefix_step_output
from kstep.decoding.draft_tally import DraftTally
from kstep.decoding.exact_step import CanvasExactStep
from kstep.outputs import StepOutput
from kstep.runner.model_runner import ForwardPass, asking
from kstep.runner.pass_output import PassOutput


class SelfSpeculativeDecoder(Decoder):
    def __init__(self, exact: CanvasExactStep, num_draft_tokens: int):
        self.exact, self.num_draft = exact, num_draft_tokens
        B, device = exact.canvas.shape[0], exact.canvas.device
        self.step_idx = torch.zeros(B, dtype=torch.long, device=device)  # each row's steps in the block
        self.row_nfe = torch.zeros(B, dtype=torch.long, device=device)
        self.chain: torch.Tensor | None = None  # (B, K, L) the drafts; None: the block starts with a pass
        self.in_chain = self.verified = torch.zeros(B, num_draft_tokens, dtype=torch.bool, device=device)
        # with a cache: K rows per batch row, from the KV pool when the request joins (admission counts them)
        self.draft_kv = None if exact.kv is None else exact.runner.allocate_kv(B * num_draft_tokens,
                                                                                exact.canvas.shape[1])
        self.nfe, self.is_finished = 0, exact.is_finished
        cache = exact.params.cache
        self.tally = DraftTally(B, device, "exact" if cache in (None, "none") else f"exact, cache {cache}")

    # --- the passes -------------------------------------------------------------------------------

    def step_tokens(self) -> int:
        """Its K drafts of the canvas (windows of it with a cache: counted whole, the first pass's size)."""
        return self.exact.canvas.numel() * self.num_draft

    def next_passes(self) -> list[ForwardPass]:
        if self.is_finished:
            return []
        if self.chain is None:  # a block's first pass: the exact sampler's own
            [forward] = self.exact.next_passes()
            self.tally.count_pass(forward)
        else:
            forward, owners = self._draft_pass()
            self.tally.count_pass(forward, owners)
        return asking([forward], self.exact.top)

    def _draft_pass(self) -> tuple[ForwardPass, torch.Tensor]:
        """Without a cache, the drafts still masked somewhere in the block, one canvas row each
        (row-major: a row's drafts in order); with one, every draft (B * K rows) as a window pass on
        its own copy of its row's cache. With the batch row each of the pass's rows belongs to."""
        ex, K = self.exact, self.num_draft
        (start, end), shift = ex.block, ex.logits_shift
        if ex.kv is None:
            rows = self.verified.nonzero()[:, 0]
            key_mask = None if ex.key_mask is None else ex.key_mask[rows]
            return ex.runner.full_pass(self.chain[self.verified], key_mask, start - shift, end - shift), rows
        B, _, L = self.chain.shape
        key_mask = None if ex.key_mask is None else ex.key_mask.repeat_interleave(K, 0)
        window_end = L if ex.params.cache == "prefix" else end
        # Dream's window row j - 1 predicts block column j; its column 0 was committed at the block start
        forward = ex.runner.window_pass(self.chain.reshape(B * K, L), key_mask, start, window_end, L,
                                        end - start - shift, self.draft_kv)
        return forward, torch.arange(B, device=self.chain.device).repeat_interleave(K)

    def _verified_outputs(self, out: PassOutput) -> tuple[PassOutput, torch.Tensor]:
        """The verification pass's outputs of the verified drafts (R, t), and the block columns they predict."""
        ex, bs = self.exact, self.exact.params.block_length
        if ex.kv is None:
            return out, torch.arange(bs, device=out.device)
        return out[self.verified.reshape(-1)], torch.arange(ex.logits_shift, bs, device=out.device)

    def _copy_cache(self, rows: torch.Tensor) -> None:
        """Each drafting row's cache, as its block start left it, into its K draft rows."""
        ex, K = self.exact, self.num_draft
        if ex.kv is None:
            return
        src = rows.nonzero()[:, 0].tolist()
        ex.runner.copy_kv(ex.kv, self.draft_kv, [b for b in src for _ in range(K)],
                          [b * K + k for b in src for k in range(K)])

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        [out] = outputs
        ex, self.nfe = self.exact, self.nfe + 1
        if self.chain is None:
            candidates, confidence = ex.scores(out, ex.columns, ex.drawn_over)
            has_masks = self._has_masks(ex.canvas)
            self.row_nfe += has_masks
            if ex.is_block_sampler and ex.step_idx == 0:
                ex.step(ex.canvas, candidates, confidence, 0)  # Dream's block start: its first token
                ex.step_idx, self.step_idx = 1, self.step_idx + 1
            else:
                self._copy_cache(has_masks)
                self._draft(candidates, confidence, has_masks)
        else:
            self.row_nfe += self.verified.any(-1)
            rows = self.verified.nonzero()[:, 0]
            verified, columns = self._verified_outputs(out)
            self._verify(*ex.scores(verified, columns, rows=rows))
        self._apply_lone_steps()
        if not bool(self._has_masks(ex.canvas).any()):  # every row has finished the block
            ex.end_block()
            self.is_finished, self.chain = ex.is_finished, None
            self.step_idx.zero_()
            if self.is_finished:
                self.draft_kv = None
        return prefix_step_output(self, ex.completions, ex.committed, ex.mask_id, ex.stop_ids, self.row_nfe,
                                  ex.include_canvas)

    # --- drafting and verifying -------------------------------------------------------------------

    def _has_masks(self, canvas: torch.Tensor) -> torch.Tensor:
        start, end = self.exact.block
        return (canvas[..., start:end] == self.exact.mask_id).any(-1)

    def _draft(self, candidates: torch.Tensor, confidence: torch.Tensor, rows: torch.Tensor) -> None:
        """The chains of `rows` (B,) from their current canvas and its predictions (B, bs): up to K
        steps with the same predictions, a chain ending at the draft that completes the block.
        `in_chain` (B, K) marks the drafts; `verified` the ones a pass must run (not complete)."""
        ex, K = self.exact, self.num_draft
        canvas = ex.canvas.clone()
        chain, in_chain = [], []
        alive = rows.clone()
        for k in range(K):
            ex.step(canvas, candidates, confidence, self.step_idx + k)
            chain.append(canvas.clone())
            in_chain.append(alive)
            alive = alive & self._has_masks(canvas)
        self.chain = torch.stack(chain, 1)  # (B, K, L)
        self.in_chain = torch.stack(in_chain, 1)  # (B, K)
        self.verified = self.in_chain & self._has_masks(self.chain)

    def _verify(self, candidates: torch.Tensor, confidence: torch.Tensor) -> None:
        """Given each verified draft's predictions (R, bs): keep each row's drafts while the next one is
        the exact step from the one before; the row's canvas becomes its last kept draft, whose
        predictions start its next chain (none when that draft completes the block)."""
        ex, (B, K, L) = self.exact, self.chain.shape
        index = torch.full((B, K), -1, dtype=torch.long, device=self.chain.device)
        index[self.verified] = torch.arange(int(self.verified.sum()), device=index.device)  # draft -> pass row
        rows, ks = self.verified.nonzero(as_tuple=True)
        targets = self.chain[self.verified].clone()  # (R, L)
        ex.step(targets, candidates, confidence, self.step_idx[rows] + ks + 1)
        exact_next = torch.zeros_like(self.chain)
        exact_next[self.verified] = targets  # (B, K, L): the exact step from each verified draft
        agrees = (exact_next[:, :-1] == self.chain[:, 1:]).all(-1) & self.in_chain[:, 1:] & self.verified[:, :-1]
        kept = agrees.long().cumprod(-1).sum(-1)  # (B,) drafts kept beyond the first
        live = self.in_chain[:, 0]
        self.tally.count_round(self.chain, exact_next, self.in_chain, kept)
        last = self.chain[torch.arange(B, device=kept.device), kept]  # (B, L)
        ex.canvas.copy_(torch.where(live[:, None], last, ex.canvas))
        self.step_idx += torch.where(live, kept + 1, 0)
        at = index[torch.arange(B, device=kept.device), kept]  # its pass row, -1 when it completed the block
        more = live & (at >= 0)
        take = at.clamp(min=0)
        self._draft(candidates[take], confidence[take], more)

    def _apply_lone_steps(self) -> None:
        """A chain whose first draft completes the block needs no pass: apply it."""
        lone = self.in_chain[:, 0] & ~self.verified[:, 0]
        if bool(lone.any()):
            self.exact.canvas.copy_(torch.where(lone[:, None], self.chain[:, 0], self.exact.canvas))
            self.step_idx += lone.long()
            self.in_chain = self.in_chain & ~lone[:, None]
            self.verified = self.verified & ~lone[:, None]

    def stats(self, row: int | None = None) -> dict[str, float | str]:
        """Drafts offered beyond each pass's exact step and those kept, and the positions computed
        (draft_tally.py), of the batch or of row `row`; `equals`: the sampler whose tokens these are."""
        return self.tally.stats(row)
