"""Block diffusion with a causal context: Nemotron-Labs-Diffusion's `generate` (its remote code,
modeling_nemotron_labs_diffusion.py, with `causal_context=True`; arXiv 2607.05722). One set of weights
in two attention modes: causal passes write the KV cache, bidirectional passes denoise a block
against it and leave nothing behind.

- The prompt runs once, causally (an AR prefill): its keys are cached and its last output gives the
  first token of the first block (an AR step).
- Blocks of `block_length` positions follow the prompt (aligned to its end, not to position 0): a
  block's first position holds that token, the others masks. A denoising pass runs the block alone,
  each position seeing the whole block and the cache (no mask: the reference's `diffusion_lm`
  attention); the output at j predicts the token at j (no shift). A pass unmasks every mask whose
  confidence (its token's probability) is at least the threshold, and always the most confident
  one (`_get_transfer_index` with a threshold; at least the schedule's count with `steps`); without
  a threshold exactly the schedule's count: the block's masks split evenly over `steps` passes
  (`exact`: steps = block_length, one per pass, as the reference without a threshold).
- A block without masks is committed: a causal pass over it writes its keys, and its last output
  gives the next block's first token. A row stops once its completion is final (every position
  before max_tokens decided, or a stop token with nothing masked before it): its last block needs
  no commit (the reference runs one, and counts it).
Unlike the reference, a masked position never takes the mask token (it would stay masked). Rows keep
their own blocks and phases: one pass runs denoising rows bidirectionally and committing rows
causally (a mask per row). The prompt's keys are causal, so requests share them (the prefix cache)
as an AR model's.
"""
import torch

from kstep.decoding.base import DecodeBatch, Decoder, DecoderResources, final_rows, prefix_step_output
from kstep.decoding.kv_growth import GrowingCache
from kstep.decoding.sampling import OutputRules, constrain, pick_tokens
from kstep.decoding.schedule import num_transfer_tokens
from kstep.decoding.unmask import choose_top, confidence_rule, sampled_probability
from kstep.outputs import StepOutput
from kstep.params import GenerationParams
from kstep.runner.model_runner import ForwardPass, ModelRunner, positions_from_padding
from kstep.runner.pass_output import PassOutput

DENOISE, COMMIT, DONE = 0, 1, 2  # a row's phase once the prompt is in


class CausalContextDecoder(Decoder):
    keeps_grammar = True
    def __init__(self, runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                 resources: DecoderResources = DecoderResources()):
        self.runner, self.params = runner, params
        self.mask_id, self.stop_ids, self.generator = batch.mask_id, batch.stop_ids, batch.generator
        self.include_canvas, self.first_allowed, self.grammar = batch.include_canvas, batch.first_allowed, batch.constraint
        self.output_rules = OutputRules.of(batch, params)
        prompts, key_mask = batch.prompts, batch.key_mask
        B, W = prompts.shape
        bs, N, device = params.block_length, params.max_tokens, prompts.device
        self.prompts, self.key_mask, self.prompt_width = prompts, key_mask, W
        slots = W + -(-N // bs) * bs  # the last block may run past max_tokens: it is decoded whole
        self.canvas = torch.full((B, slots), self.mask_id, dtype=torch.long, device=device)
        self.canvas[:, :W] = prompts
        self.real = torch.ones(B, slots, dtype=torch.bool, device=device)
        if key_mask is not None:
            self.real[:, :W] = key_mask
        self.positions = torch.arange(W, device=device).expand(B, -1) if key_mask is None \
            else positions_from_padding(key_mask)  # (B, W)
        self.prompt_lengths = self.positions[:, -1] + 1  # (B,)
        # the cache grows block by block (kv_growth.py): the prompt and a first block now
        self.cache = GrowingCache(runner, B, slots)
        self.kv = self.cache.room(None, W + bs)
        self.block_idx = torch.zeros(B, dtype=torch.long, device=device)  # each row's current block
        self.phase = torch.full((B,), DENOISE, dtype=torch.long, device=device)
        self.passes_in_block = torch.zeros(B, dtype=torch.long, device=device)
        self.schedule: torch.Tensor | None = None  # (B, steps): counts per pass of each row's block
        self.rule = confidence_rule(params.remasking)
        same_rows = key_mask is None and bool((prompts == prompts[:1]).all())
        self.prefix_cache = resources.prefix_cache if same_rows else None
        self.num_cached_tokens, self.prefilled = 0, None  # prompt columns cached (None: the prefix cache not asked)
        self.is_prefilled, self.columns = False, None
        self.row_nfe = torch.zeros(B, dtype=torch.long, device=device)
        self.nfe, self.is_finished = 0, False
        self.lengths = [0] * B  # committed tokens reported per row

    def reserve(self) -> None:
        self.kv = self.cache.room(self.kv, self.cache.most)

    def next_passes(self) -> list[ForwardPass]:
        if self.is_finished:
            return []
        if not self.is_prefilled:  # the prompt, whole or its next chunk (base.Decoder.prefill_chunk)
            if self.prefilled is None:
                self.prefilled = 0
                if self.prefix_cache is not None:  # the last prompt token always runs: its output is the first token
                    self.prefilled = self.num_cached_tokens = \
                        self.prefix_cache.load(self.prompts[0].tolist(), self.kv, self.prompt_width - 1)
            start = self.prefilled
            end = self.next_chunk(start, self.prompt_width, self.prompts.shape[0])
            if end is None:
                return []  # waits for a step with room
            self.prefilled = end
            return [self.runner.causal_pass(self.prompts[:, start:end], self.positions[:, start:end], self.key_mask,
                                            start, self.kv)]
        bs = self.params.block_length
        offsets = torch.arange(bs, device=self.canvas.device)
        starts = self.prompt_width + self.block_idx * bs  # (B,) slot of each row's block
        self.kv = self.cache.room(self.kv, int(starts.max()) + bs)  # PoolFull: the engine preempts, asks again
        ids = self.canvas.gather(1, starts[:, None] + offsets)  # (B, bs)
        positions = (self.prompt_lengths + self.block_idx * bs)[:, None] + offsets
        self.columns = self._read_columns(ids)
        return [self.runner.ragged_causal_pass(ids, positions, starts, self.real, self.kv,
                                               is_causal=self.phase != DENOISE, kind="block", columns=self.columns)]

    def _read_columns(self, ids: torch.Tensor) -> torch.Tensor:
        """(k,) the block columns whose outputs are read: the masks of denoising rows, and the last
        one when a row commits (the LM head's cost grows with them)."""
        read = ((ids == self.mask_id) & (self.phase == DENOISE)[:, None]).any(0)  # (bs,)
        read[-1] |= bool((self.phase == COMMIT).any())
        return read.nonzero().squeeze(1)

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        if not outputs:  # its prefill's chunk waited
            return self._output()
        [out] = outputs
        self.nfe += 1
        self.row_nfe += self.phase != DONE
        if not self.is_prefilled and self.prefilled < self.prompt_width:  # a chunk before the prompt's last
            return self._output()
        if not self.is_prefilled:
            self.is_prefilled = True
            if self.prefix_cache is not None:
                self.prefix_cache.store(self.prompts[0].tolist(), self.kv)
            self._seed(out[:, -1], torch.ones_like(self.phase, dtype=torch.bool))
        else:
            bs = self.params.block_length
            out = out.spread(bs, self.columns)  # (B, bs); unread columns 0
            committing = self.phase == COMMIT
            self._denoise(out, self.phase == DENOISE)
            if bool(committing.any()):
                self.block_idx += committing
                self.passes_in_block = torch.where(committing, 0, self.passes_in_block)
                self.phase = torch.where(committing, DENOISE, self.phase)
                self._seed(out[:, -1], committing)
        self._update_phases()
        return self._output()

    def _output(self) -> StepOutput:
        return prefix_step_output(self, self.completions(), self.lengths, self.mask_id, self.stop_ids,
                                  self.row_nfe, self.include_canvas, finished=self.phase == DONE)

    def _seed(self, last: PassOutput, rows: torch.Tensor) -> None:
        """The first token of each of `rows`' current block: sampled from a causal pass's last
        output `last` (B,), as an AR step (the reference writes it whatever it is)."""
        p, bs = self.params, self.params.block_length
        index = self.block_idx * bs  # (B,) its place in the completion
        last = constrain(last.view(-1, 1), index[:, None], self.output_rules)[:, 0]
        token = pick_tokens(last, p.temperature, self.generator, p.top_k, p.top_p)  # (B,)
        slot = (self.prompt_width + index)[:, None]
        if self.grammar is not None:  # the block's first position is the row's frontier (kstep/structured)
            token, rows = (t[:, 0] for t in self.grammar.step(self.canvas.gather(1, slot), token[:, None],
                                                              rows[:, None], index[:, None], rows=rows))
        self.canvas.scatter_(1, slot, torch.where(rows, token, self.canvas.gather(1, slot)[:, 0])[:, None])
        if p.steps is not None:  # the block's masks, split over `steps` passes (the reference's schedule)
            masks = (self.canvas.gather(1, slot + torch.arange(bs, device=slot.device)) == self.mask_id).sum(-1)
            counts = num_transfer_tokens(masks, p.steps)  # (B, steps)
            self.schedule = counts if self.schedule is None else torch.where(rows[:, None], counts, self.schedule)

    def _denoise(self, out: PassOutput, rows: torch.Tensor) -> None:
        """One unmask step for `rows` from their block's outputs (B, bs)."""
        if not bool(rows.any()):
            return
        p, bs = self.params, self.params.block_length
        index = (self.block_idx * bs)[:, None] + torch.arange(bs, device=out.device)  # (B, bs) in the completion
        slots = self.prompt_width + index
        block = self.canvas.gather(1, slots)
        out = constrain(out, index, self.output_rules)
        tokens = pick_tokens(out.excluding(self.mask_id), p.temperature, self.generator, p.top_k, p.top_p)
        confidence = sampled_probability(out, tokens, p) if p.remasking == "low_confidence" else \
            self.rule(out, tokens, self.generator).float()  # (B, bs)
        is_masked = (block == self.mask_id) & rows[:, None]
        confidence = confidence.masked_fill(~is_masked, float("-inf"))
        count = torch.ones_like(self.passes_in_block) if self.schedule is None else \
            self.schedule.gather(1, self.passes_in_block.clamp(max=self.schedule.shape[1] - 1)[:, None])[:, 0]
        chosen = choose_top(confidence, torch.minimum(count, is_masked.sum(-1)), bs)
        if p.policy.kind == "threshold":
            chosen |= confidence >= p.policy.value
        chosen &= is_masked
        if self.grammar is not None:  # in order from each row's frontier (kstep/structured/constraint.py)
            tokens, chosen = self.grammar.step(block, tokens, chosen, index,
                                               None if p.policy.kind == "threshold" else count, rows)
        self.canvas.scatter_(1, slots, torch.where(chosen, tokens, block))
        self.passes_in_block += rows

    def _update_phases(self) -> None:
        """Denoised blocks go to commit; a row is done once its completion is final."""
        bs = self.params.block_length
        slots = (self.prompt_width + self.block_idx * bs)[:, None] + torch.arange(bs, device=self.canvas.device)
        is_complete = ~(self.canvas.gather(1, slots) == self.mask_id).any(-1)
        self.phase = torch.where((self.phase == DENOISE) & is_complete, COMMIT, self.phase)
        stops = self.stop_ids[:0] if self.params.ignore_eos else self.stop_ids
        self.phase = torch.where(final_rows(self.completions(), self.mask_id, stops), DONE, self.phase)
        if bool((self.phase == DONE).all()):
            self.is_finished, self.kv = True, None

    def completions(self) -> torch.Tensor:
        """(B, max_tokens): each row's positions after its prompt (masks where not decided)."""
        W = self.prompt_width
        return self.canvas[:, W:W + self.params.max_tokens]
