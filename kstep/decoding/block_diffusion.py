"""Block-diffusion decoding (BD3-LM, arXiv:2503.09573): Fast-dLLM v2 (NVlabs/Fast-dLLM `v2/`, the
checkpoint's `modeling.py` `generate`), SDAR (JetAstra/SDAR `generate.py`, `huggingface_bd3.py`) and
LLaDA2 (inclusionAI, the checkpoint's `generate`; LLaDA2.1's token editing in token_editing.py).

Attention is bidirectional inside a block of `block_length` positions (aligned to position 0) and
causal across blocks. The prompt's whole blocks run once (a block-causal prefill into the cache);
its tail shares the first block. A block is denoised pass by pass against the cache of the blocks
before it; once it has no masks, a pass over its final tokens writes its keys/values (the commit).

Each pass unmasks, among the masks of the current block (Fast-dLLM v2: of its current sub-block),
every one whose confidence (the sampled token's probability under the tempered, filtered
distribution it came from, as the references score it) is above the threshold (strict), and at
least the schedule's count (1 without `steps`; SDAR's `low_confidence_dynamic`, LLaDA2's rule), or with
`steps` and no threshold exactly the schedule's count (SDAR's static rule: the block split evenly
over `steps` passes, the remainder first; LLaDA2 caps steps at max_tokens as its generate).

Fast-dLLM v2 keeps its AR parent's logit shift: the token at j is read from the output at j - 1, and
a block's first token is the argmax of the commit pass's last output; SDAR and LLaDA2 read it at j.
A row stops once a stop token has nothing masked before it (the references finish the block first).

`fused_commit` (default; off with `exact`) drops the commit's own pass: a row whose block is
finished runs [finished block; next block] in its next pass (block-causal, as training's [clean;
noisy] pairs), writing the finished block's keys and denoising the next at once. Unshifted models'
tokens do not change; Fast-dLLM v2's next block is predicted with its first token masked (its tokens
may differ from its reference). The commit's first token counts toward the pass's minimum; rows not
committing run a scratch block (never attended). Every pass is one ragged pass (rows keep their own
blocks). A structured output's grammar is kept at each row's frontier (kstep/structured)."""
import torch

from kstep.decoding.base import DecodeBatch, Decoder, DecoderResources, final_rows, prefix_step_output
from kstep.decoding.block_prefill import BlockPrefill
from kstep.decoding.block_unmask import block_scores, choose_in_block, open_columns, scheduled
from kstep.decoding.exact_step import BlockExactStep
from kstep.decoding.kv_growth import GrowingCache
from kstep.decoding.sampling import OutputRules, constrain
from kstep.decoding.schedule import num_transfer_tokens
from kstep.decoding.token_editing import TokenEditing
from kstep.decoding.unmask import confidence_rule, top_request
from kstep.outputs import StepOutput
from kstep.params import GenerationParams
from kstep.runner.model_runner import ForwardPass, ModelRunner, asking
from kstep.runner.pass_output import PassOutput

DENOISE, COMMIT, DONE = 0, 1, 2  # a row's phase


class BlockDiffusionDecoder(Decoder, BlockExactStep, BlockPrefill):
    keeps_grammar = True
    spare_slots = 0  # KV slots past the canvas, never attended (block_cache.py writes keys it must not keep there)

    def __init__(self, runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                 resources: DecoderResources = DecoderResources()):
        rules, prefix_cache = resources.rules, resources.prefix_cache  # (decoding/table.py gives the family's rules)
        self.runner, self.params, self.rules, self.lengths = runner, params, rules, [0] * batch.num_rows
        self.mask_id, self.stop_ids, self.generator = batch.mask_id, batch.stop_ids, batch.generator
        self.include_canvas, self.first_allowed, self.grammar = batch.include_canvas, batch.first_allowed, batch.constraint
        self.output_rules = OutputRules.of(batch, params)
        prompts, key_mask = batch.prompts, batch.key_mask
        B, W = prompts.shape
        bs, N, device, self.prompt_width = params.block_length, params.max_tokens, prompts.device, W
        self.pads = (W - key_mask.sum(-1)) if key_mask is not None else torch.zeros(B, dtype=torch.long, device=device)
        self.prompt_lengths = W - self.pads  # (B,)
        # Slots = canvas columns: row b's position p sits at slot pads[b] + p; room for the last block (it may
        # end up to bs - 1 past max_tokens), the next block's first token, a fused commit's scratch block.
        self.fused = params.fused_commit and W + N + 2 * bs <= runner.cfg.max_positions
        slots = W + N + (2 if self.fused else 1) * bs
        self.canvas = torch.cat([prompts, prompts.new_full((B, slots - W), self.mask_id)], 1)
        self.real = torch.cat([key_mask if key_mask is not None else torch.ones_like(prompts, dtype=torch.bool),
                               torch.ones(B, slots - W, dtype=torch.bool, device=device)], 1)
        # the cache grows block by block (kv_growth.py): the prompt and a first pass's blocks now
        self.cache = GrowingCache(runner, B, slots + self.spare_slots)
        self.kv = self.cache.room(None, W + (2 if self.fused else 1) * bs + self.spare_slots)
        self.block_starts = self.prompt_lengths // bs * bs  # (B,) position of each row's current block
        self.phase = torch.full((B,), DENOISE, dtype=torch.long, device=device)
        self.passes_in_block = torch.zeros(B, dtype=torch.long, device=device)
        self.editing = None if params.editing_threshold is None else \
            TokenEditing(params.editing_threshold, params.max_post_steps, B, device, self.mask_id)
        steps = params.steps
        if rules.steps_capped and self.editing is None:  # LLaDA2.0's generate: min(steps, gen_length)
            steps = min(steps or bs, N)
        self.schedule = None if steps is None else num_transfer_tokens(torch.tensor([bs]), steps)[0].to(device)
        self.rule, self.top = confidence_rule(params.remasking), top_request(params, self.mask_id, self.first_allowed)
        self.needs_prefill = bool((self.prompt_lengths >= bs).any())
        # An unshifted model's prefill also runs every row's first block (the prompt's keys are the same):
        # that block's first denoising pass too, one pass fewer.
        self.fused_prefill = self.fused and not rules.is_shifted
        # A prompt's whole blocks do not depend on what follows (block-causal): requests share them as an AR
        # prefix, one prompt per decoder (unpadded, rows the same), in cache blocks of whole model blocks.
        same_rows = key_mask is None and bool((prompts == prompts[:1]).all())
        shares = prefix_cache is not None and prefix_cache.block_size % bs == 0 and bs == runner.cfg.block_size
        self.prefix_cache = prefix_cache if same_rows and shares else None
        self.num_cached_tokens, self.columns = 0, None  # columns: the last pass's columns with logits
        self.row_nfe, self.nfe, self.is_finished = torch.zeros(B, dtype=torch.long, device=device), 0, False

    def reserve(self) -> None:
        self.kv = self.cache.room(self.kv, self.cache.most)

    def step_tokens(self) -> int:
        """A pass over every row's block (and the next one's, when a commit is fused)."""
        return self.canvas.shape[0] * self.params.block_length * (2 if self.fused else 1)

    def next_passes(self) -> list[ForwardPass]:
        return asking(self._next_passes(), self.top)

    def _next_passes(self) -> list[ForwardPass]:
        if self.is_finished:
            return []
        if self.needs_prefill:
            return self._prefill_pass()
        bs = self.params.block_length
        width = 2 * bs if self._fuses_commit() else bs
        starts = self.pads + self.block_starts  # (B,) slot of each row's block
        self.kv = self.cache.room(self.kv, int(starts.max()) + width + self.spare_slots)
        index = starts[:, None] + torch.arange(width, device=starts.device)  # (B, width)
        ids = self.canvas.gather(1, index)
        positions = self.block_starts[:, None] + torch.arange(width, device=starts.device)
        self.columns = self._read_columns(width)
        return [self.runner.ragged_causal_pass(ids, positions, starts, self.real, self.kv, is_causal=False,
                                               kind="block", columns=self.columns, block_size=bs,
                                               write_slots=self._write_slots(index))]

    def _write_slots(self, index: torch.Tensor) -> torch.Tensor | None:
        """Where a block pass over the slots `index` (B, width) writes its keys (None: there)."""
        return None

    def _read_columns(self, width: int) -> torch.Tensor:
        """(k,) the pass's positions whose outputs are read (any row): those that predict a mask of a
        block's open sub-block, and a commit's last position (the LM head's cost grows with them)."""
        bs = self.params.block_length
        active = self.phase != DONE
        committing = active & (self.phase == COMMIT)
        half = committing.long() if width == 2 * bs else torch.zeros_like(committing, dtype=torch.long)
        offsets = torch.arange(bs, device=half.device)
        block = self.canvas.gather(1, (self.pads + self.block_starts + half * bs)[:, None] + offsets)
        source = (half[:, None] * bs + offsets - int(self.rules.is_shifted)).clamp(min=0)  # (B, bs)
        read = torch.zeros(width, dtype=torch.bool, device=half.device)
        wanted = (block == self.mask_id) & open_columns(block, self.mask_id, self.params.sub_block_length) \
            if self.editing is None else torch.ones_like(block, dtype=torch.bool)  # editing reads every position
        read[source[wanted & active[:, None]]] = True
        if width == bs and bool(committing.any()):  # a commit pass of its own: its last output
            read[-1] = True
        return read.nonzero().squeeze(1)

    def _fuses_commit(self) -> bool:
        """This pass carries the commit of some row's finished block (it runs two blocks per row)."""
        return self.fused and bool((self.phase == COMMIT).any())

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        if self.needs_prefill and not self.prefill_done(outputs):
            return self._output()
        [out], self.nfe = outputs, self.nfe + 1
        if self.needs_prefill:
            self._after_prefill(out)
            if self.fused_prefill:  # each row's block sits at its own offset in the window of 2 * bs
                active, bs = self.phase != DONE, self.params.block_length
                offset = self.pads + self.block_starts - (self.prompt_width - bs)  # (B,) in [1, bs]
                source = offset[:, None] + torch.arange(bs, device=offset.device)
                self.row_nfe += active & ~(self.prompt_lengths >= bs)
                self._denoise(out.gather(source), active)
        else:
            active = self.phase != DONE
            self.row_nfe += active
            bs = self.params.block_length
            if self.columns is not None:  # back to (B, width); the columns not read stay zero
                out = out.spread(2 * bs if self._fuses_commit() else bs, self.columns)
            if out.shape[1] == 2 * bs:  # fused: committing rows run [finished; next], the rest [block; scratch]
                committing = active & (self.phase == COMMIT)
                self.commit(out[:, bs - 1], committing)
                self._denoise(self.block_outputs(out, committing.long()), active & (self.phase == DENOISE),
                              already=committing.long() if self.rules.is_shifted else None)
            else:
                self._denoise(self.block_outputs(out, torch.zeros_like(self.phase)), active & (self.phase == DENOISE))
                self.commit(out[:, -1], active & (self.phase == COMMIT))
        self.update_phases()
        return self._output()

    def _after_prefill(self, out: PassOutput) -> None:
        """The prompt's whole blocks are cached. A shifted model's first token, when the prompt ends
        on a block boundary, is the prefill's last output (an AR step, as Fast-dLLM v2)."""
        self.needs_prefill = False
        bs = self.params.block_length
        if self.prefix_cache is not None:
            self.prefix_cache.store(self.canvas[0, :self.prompt_width // bs * bs].tolist(), self.kv)
        had_blocks = self.prompt_lengths >= bs
        self.row_nfe += had_blocks
        if self.rules.is_shifted:
            on_boundary = had_blocks & (self.prompt_lengths % bs == 0)
            self._write_first_token(out[:, -1], on_boundary, self.prompt_lengths)

    def _write_first_token(self, last: PassOutput, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Argmax of the last outputs `last` (B,) at `positions` (B,) for `rows`, if within max_tokens."""
        index = positions - self.prompt_lengths
        proposal = constrain(last.view(-1, 1), index[:, None], self.output_rules)[:, 0]
        token = proposal.excluding(self.mask_id).argmax()
        in_range = rows & (index < self.params.max_tokens)
        slot = (self.pads + positions).clamp(max=self.canvas.shape[1] - 1)
        current = self.canvas.gather(1, slot[:, None]).squeeze(1)
        if self.grammar is not None:  # the block's first position is the row's frontier
            token, in_range = (t[:, 0] for t in self.grammar.step(current[:, None], token[:, None], in_range[:, None],
                                                                  index[:, None], rows=in_range))
        self.canvas.scatter_(1, slot[:, None], torch.where(in_range, token, current)[:, None])

    def block_outputs(self, out: PassOutput, half: torch.Tensor) -> PassOutput:
        """(B, bs): the outputs that predict each row's current block, which starts at column
        half[b] * bs of the pass's outputs (B, T). Shifted: the token at j from the output at j - 1
        (a column 0 with no output before it in the pass is never masked: it keeps its own)."""
        bs = self.params.block_length
        source = half[:, None] * bs + torch.arange(bs, device=out.device)  # (B, bs)
        if self.rules.is_shifted:
            source = (source - 1).clamp(min=0)
        return out.gather(source)

    def _denoise(self, out: PassOutput, rows: torch.Tensor, already: torch.Tensor | None = None) -> None:
        """One unmask step for `rows` given their block's outputs (B, bs); `already` (B,): tokens this
        pass has written in the block (a fused commit's first token), counted toward the minimum."""
        if not bool(rows.any()):
            return
        p, bs = self.params, self.params.block_length
        starts = self.pads + self.block_starts
        index = starts[:, None] + torch.arange(bs, device=starts.device)  # (B, bs)
        block = self.canvas.gather(1, index)
        in_completion = (self.block_starts - self.prompt_lengths)[:, None] + torch.arange(bs, device=starts.device)
        tokens, probs, confidence = self.block_scores(out, torch.arange(len(rows), device=rows.device))
        if self.editing is not None:  # LLaDA2.1: filled tokens (not the prompt's) it may replace, edited first
            editable = (block != self.mask_id) & (in_completion >= 0)
            block = self.editing.edit_block(block, tokens, probs, editable, rows, self.grammar, in_completion)
        count = scheduled(self.schedule, self.passes_in_block)
        if already is not None:
            count = (count - already).clamp(min=0)
        chosen = choose_in_block(block, confidence, rows, count, p, self.mask_id)
        if self.grammar is not None:  # in order from each row's frontier (kstep/structured/constraint.py)
            tokens, chosen = self.grammar.step(block, tokens, chosen, in_completion,
                                               count if p.policy.kind != "threshold" else None, rows)
        self.canvas.scatter_(1, index, torch.where(chosen, tokens, block))
        self.passes_in_block += rows

    def block_scores(self, out: PassOutput, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.params
        positions = self.block_starts[rows, None] + torch.arange(p.block_length, device=rows.device)  # (R, bs)
        out = constrain(out, positions - self.prompt_lengths[rows, None], self.output_rules.of_rows(rows))
        return block_scores(out, p, self.mask_id, self.rule, self.generator)

    def block_step(self, blocks: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor, passes: torch.Tensor,
                   live: torch.Tensor) -> torch.Tensor:
        chosen = choose_in_block(blocks, confidence, live, scheduled(self.schedule, passes), self.params, self.mask_id)
        return torch.where(chosen, tokens, blocks)

    def commit(self, last: PassOutput, rows: torch.Tensor) -> None:
        """This pass wrote the finished block's exact keys/values; the next block begins (its first
        token from the finished block's last output `last` (B,) when shifted)."""
        if not bool(rows.any()):
            return
        self._next_block(rows)
        if self.rules.is_shifted:
            self._write_first_token(last, rows, self.block_starts)

    def _next_block(self, rows: torch.Tensor) -> None:
        bs = self.params.block_length
        self.block_starts = torch.where(rows, self.block_starts + bs, self.block_starts)
        self.passes_in_block = torch.where(rows, 0, self.passes_in_block)
        self.phase = torch.where(rows, DENOISE, self.phase)

    def update_phases(self) -> None:
        """Denoised blocks go to commit; a row is done once its completion is final."""
        bs = self.params.block_length
        starts = self.pads + self.block_starts
        block = self.canvas.gather(1, starts[:, None] + torch.arange(bs, device=starts.device))
        is_complete = ~(block == self.mask_id).any(-1)
        to_commit = (self.phase == DENOISE) & is_complete
        if self.editing is not None:  # a block ends when editing has converged, or by the cap
            exact, to_commit = self.editing.block_ends(to_commit)
            self._next_block(exact)  # its keys are already exact in the cache: nothing to commit
        self.phase = torch.where(to_commit, COMMIT, self.phase)
        self.phase = torch.where(self.is_final(), DONE, self.phase)  # a final row needs no commit
        if bool((self.phase == DONE).all()):
            self.is_finished, self.kv = True, None

    def is_final(self) -> torch.Tensor:
        """(B,) rows whose completion can no longer change (`final_rows`; with ignore_eos, no stops)."""
        stops = self.stop_ids[:0] if self.params.ignore_eos else self.stop_ids
        return final_rows(self.settled(), self.mask_id, stops)

    def settled(self) -> torch.Tensor:
        """The completions, with the tokens token editing may still change shown as masks."""
        if self.editing is None:
            return self.completions()
        ended = self.block_starts + self.params.block_length * (self.phase == COMMIT)  # (B,)
        return self.editing.settled(self.completions(), self.prompt_lengths, ended, self.phase == DONE, self.mask_id)

    def completions(self) -> torch.Tensor:
        """(B, max_tokens): each row's positions after its prompt (masks where not decided)."""
        W = self.prompt_width  # every row's prompt ends there (left padding)
        return self.canvas[:, W:W + self.params.max_tokens]

    def _output(self) -> StepOutput:
        return prefix_step_output(self, self.settled(), self.lengths, self.mask_id, self.stop_ids, self.row_nfe,
                                  self.include_canvas, finished=self.phase == DONE, canvas=self.completions())
