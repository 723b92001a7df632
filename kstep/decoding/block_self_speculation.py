"""Lossless self-speculation inside the blocks of a block-diffusion model (Fast-dLLM v2, SDAR,
LLaDA2): the exact sampler's tokens (one step per pass in each block, the references' commit pass
between blocks) in fewer sequential passes. The chain of drafts and its verification are
self_speculation.py's; what differs is where a draft runs.

A block's passes attend to the cached keys of the blocks before it. Each draft of a row gets a KV
cache row of its own (`draft_kv`, K rows per batch row), holding a copy of the row's cache from when
its block started (the prefix does not change while a block is denoised); a verification pass runs
the K drafted blocks there, each exactly as the exact sampler's pass over that block would run
(the same slots, the same mask). A drafted block with no mask left is run too: its pass is the
exact sampler's commit pass (the finished block's keys, and a shifted model's next first token from
its last output), so when it is kept its cache row becomes the row's cache and the commit needs no
pass of its own. A row's block start (its first denoising pass) is the exact sampler's own pass,
on the request's cache; a step may run both kinds of pass, one for some rows and one for others,
packed by the engine.
"""
import torch

from kstep.decoding.base import Decoder, prefix_step_output
from kstep.decoding.block_diffusion import COMMIT, DENOISE, DONE
from kstep.decoding.exact_step import BlockExactStep
from kstep.decoding.draft_tally import DraftTally
from kstep.outputs import StepOutput
from kstep.runner.model_runner import ForwardPass, asking
from kstep.runner.pass_output import PassOutput


class BlockSelfSpeculativeDecoder(Decoder):
    def __init__(self, exact: BlockExactStep, num_draft_tokens: int):
        self.exact, self.num_draft = exact, num_draft_tokens
        B, bs, device = exact.canvas.shape[0], exact.params.block_length, exact.canvas.device
        self.has_pred = torch.zeros(B, dtype=torch.bool, device=device)  # predictions of the current block
        self.tokens = torch.zeros(B, bs, dtype=torch.long, device=device)
        self.confidence = torch.zeros(B, bs, device=device)
        self.verified = torch.zeros(B, num_draft_tokens, dtype=torch.bool, device=device)
        # Whole caches when the request joins (admission counts them): a kept draft's cache row becomes
        # the row's cache, so the exact sampler's must hold every block a draft may write.
        exact.reserve()
        self.draft_kv = exact.runner.allocate_kv(B * num_draft_tokens, exact.canvas.shape[1] + exact.spare_slots)
        self.kinds: list[str] = []
        self.nfe, self.is_finished = 0, exact.is_finished
        self.tally = DraftTally(B, device, "exact")

    # --- the passes -------------------------------------------------------------------------------

    def step_tokens(self) -> int:
        """The exact sampler's pass and the K drafts of every row's block (counted as wide as it)."""
        return self.exact.step_tokens() * (1 + self.num_draft)

    def next_passes(self) -> list[ForwardPass]:
        ex, passes, self.kinds = self.exact, [], []
        if self.is_finished:
            return []
        active = ex.phase != DONE
        # the rows the exact sampler's pass serves, fixed now: a draft pass may commit a row before it returns
        self.committing, self.starting = active & (ex.phase == COMMIT), active & (ex.phase == DENOISE) & ~self.has_pred
        if ex.needs_prefill:  # the exact sampler's prefill (or its next chunk; none while it waits)
            ex.prefill_chunk, ex.prefill_budget = self.prefill_chunk, self.prefill_budget
            passes = ex.next_passes()
            self.kinds = ["exact"] * len(passes)
            for forward in passes:
                self.tally.count_pass(forward)
            return passes
        if bool((self.committing | self.starting).any()):
            passes += ex.next_passes()  # the exact sampler's own: block starts and commits
            passes[-1].logits_columns, ex.columns = None, None  # every position: drafts read the whole block
            self.kinds.append("exact")
            self.tally.count_pass(passes[-1])
        if bool(self.verified.any()):
            passes.append(self._draft_pass())
            self.kinds.append("drafts")
            self.tally.count_pass(passes[-1], torch.arange(len(self.verified), device=self.verified.device)
                                  .repeat_interleave(self.num_draft))
        return passes

    def _draft_pass(self) -> ForwardPass:
        """The drafted blocks (B * K rows, row b's K drafts in order), each on its draft cache row as
        the exact sampler's pass over that block runs on the row's own cache."""
        ex, K, bs = self.exact, self.num_draft, self.exact.params.block_length
        starts = (ex.pads + ex.block_starts).repeat_interleave(K)  # (B * K,)
        positions = ex.block_starts.repeat_interleave(K)[:, None] + torch.arange(bs, device=starts.device)
        forward = ex.runner.ragged_causal_pass(self.chain.reshape(-1, bs), positions, starts,
                                               ex.real.repeat_interleave(K, 0), self.draft_kv, is_causal=False,
                                               kind="block", block_size=bs)
        return asking([forward], ex.top)[0]

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        ex, self.nfe = self.exact, self.nfe + bool(outputs)  # one packed pass a step
        if ex.needs_prefill:  # the prompt's blocks into the cache (and a shifted model's first token)
            out = ex.update(outputs)
            self.is_finished = ex.is_finished
            return out
        outputs = dict(zip(self.kinds, outputs, strict=True))
        if "drafts" in outputs:
            ex.row_nfe += self.verified.any(-1)
            self._verify(outputs["drafts"])
        if "exact" in outputs:
            self._exact_pass(outputs["exact"])
        self._draft(ex.phase == DENOISE)
        ex.update_phases()
        self.has_pred &= ex.phase == DENOISE
        self.verified &= self.has_pred[:, None]
        self.is_finished = ex.is_finished
        return prefix_step_output(self, ex.settled(), ex.lengths, ex.mask_id, ex.stop_ids, ex.row_nfe,
                                  ex.include_canvas, finished=ex.phase == DONE, canvas=ex.completions())

    def _exact_pass(self, out: PassOutput) -> None:
        """The exact sampler's pass (B, bs): commits for the rows that finished a block, and the
        predictions of each block that starts (its prefix copied to the row's draft caches)."""
        ex, commit, starting = self.exact, self.committing, self.starting
        ex.row_nfe += commit | starting
        ex.commit(out[:, -1], commit)
        if not bool(starting.any()):
            return
        rows = torch.arange(len(starting), device=starting.device)
        tokens, confidence = self._scores(ex.block_outputs(out, torch.zeros_like(ex.phase)), rows)
        self.tokens[starting], self.confidence[starting] = tokens[starting], confidence[starting]
        self.has_pred |= starting
        K = self.num_draft
        src = starting.nonzero()[:, 0].tolist()
        ex.runner.copy_kv(ex.kv, self.draft_kv, [b for b in src for _ in range(K)],
                          [b * K + k for b in src for k in range(K)])

    # --- drafting and verifying -------------------------------------------------------------------

    def _block_index(self, rows: torch.Tensor) -> torch.Tensor:
        ex = self.exact
        return (ex.pads + ex.block_starts)[rows, None] + torch.arange(ex.params.block_length, device=rows.device)

    def _scores(self, block: PassOutput, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and confidence (R, bs) from outputs (R, bs) predicting the blocks of batch rows `rows`."""
        tokens, _, confidence = self.exact.block_scores(block, rows)
        return tokens, confidence

    def _has_masks(self, blocks: torch.Tensor) -> torch.Tensor:
        return (blocks == self.exact.mask_id).any(-1)

    def _draft(self, rows: torch.Tensor) -> None:
        """Chains (B, K, bs) for `rows` that hold predictions of their block; a chain whose first
        draft completes the block is applied at once (no pass)."""
        ex, K = self.exact, self.num_draft
        B = rows.shape[0]
        index = self._block_index(torch.arange(B, device=rows.device))
        block = ex.canvas.gather(1, index)
        alive = rows & self.has_pred & self._has_masks(block)
        chain, in_chain = [], []
        for k in range(K):
            block = self.exact.block_step(block, self.tokens, self.confidence, ex.passes_in_block + k, alive)
            chain.append(block)
            in_chain.append(alive)
            alive = alive & self._has_masks(block)
        self.chain, self.in_chain = torch.stack(chain, 1), torch.stack(in_chain, 1)  # (B, K, bs), (B, K)
        self.verified = self.in_chain  # a draft without masks runs as its block's commit

    def _verify(self, out: PassOutput) -> None:
        """Keep each row's drafts while the next one is the exact step from the one before; its block
        becomes the last kept one, whose predictions start its next chain."""
        ex, (B, K, bs) = self.exact, self.chain.shape
        rows = torch.arange(B, device=out.device).repeat_interleave(K)  # each pass row's batch row
        tokens, confidence = self._scores(ex.block_outputs(out, torch.zeros_like(rows)), rows)
        tokens, confidence = tokens.view(B, K, bs), confidence.view(B, K, bs)
        passes = ex.passes_in_block[:, None] + torch.arange(1, K + 1, device=out.device)  # (B, K)
        exact_next = self.exact.block_step(self.chain.reshape(-1, bs), tokens.reshape(-1, bs), confidence.reshape(-1, bs),
                                passes.reshape(-1), self.verified.reshape(-1)).view(B, K, bs)
        agrees = (exact_next[:, :-1] == self.chain[:, 1:]).all(-1) & self.in_chain[:, 1:] & \
            self._has_masks(self.chain[:, :-1])
        kept = agrees.long().cumprod(-1).sum(-1)  # (B,) drafts kept beyond the first
        live = self.in_chain[:, 0]
        self.tally.count_round(self.chain, exact_next, self.in_chain, kept)
        b = torch.arange(B, device=kept.device)
        index = self._block_index(b)
        ex.canvas.scatter_(1, index, torch.where(live[:, None], self.chain[b, kept], ex.canvas.gather(1, index)))
        ex.passes_in_block += torch.where(live, kept + 1, 0)
        done = live & ~self._has_masks(self.chain[b, kept])  # its kept draft finished the block: the commit ran
        finished = done & ex.is_final()  # a final row needs no commit (nor a next block)
        done = done & ~finished
        if bool(done.any()):
            src = (b * K + kept)[done].tolist()
            ex.runner.copy_kv(self.draft_kv, ex.kv, src, b[done].tolist())
            ex.commit(out[b * K + kept][:, -1], done)  # the next block, and a shifted model's first token
        more = live & ~done & ~finished  # its last kept draft still has masks: its predictions go on
        self.tokens = torch.where(more[:, None], tokens[b, kept], self.tokens)
        self.confidence = torch.where(more[:, None], confidence[b, kept], self.confidence)
        self.has_pred = (self.has_pred & ~live) | more

    def stats(self, row: int | None = None) -> dict[str, float | str]:
        """The drafts' figures (draft_tally.py), of the batch or of row `row`."""
        return self.tally.stats(row)
