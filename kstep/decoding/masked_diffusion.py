"""Masked-diffusion decoding: LLaDA's sampler (arXiv:2502.09992; ML-GSAI/LLaDA `generate.py`) and
Fast-dLLM's accelerations (arXiv:2505.22618; NVlabs/Fast-dLLM `llada/generate.py`).

The canvas is `prompt + max_tokens` masks (+ a suffix when infilling: attended to by every pass,
never changed), decoded semi-autoregressively in blocks. Each step
proposes a token for every masked position of the current block (argmax, or Gumbel-max at
temperature > 0), scores it with the unmask rule, and unmasks the positions the policy picks:
the linear schedule's count (`fixed`, the exact sampler), every position above a confidence
`threshold`, or Fast-dLLM's `factor` rule. A block ends when it has no masks; unmasked tokens are
never re-masked. Positions outside the current block can never be unmasked, so logits are only
computed for the block. The mask token itself is never proposed (the references could write it
back into a masked position and leave a mask in the output).

Seeded `random` remasking draws what the references draw (unmask.py's `drawn_over`): one
torch.rand per row and position of the reference pass (the whole canvas in a full pass, [block
start, end of canvas) in a `prefix` window pass, the block in a `dual` one), so at temperature 0
`seed=s` equals LLaDA's generate / Fast-dLLM's after `torch.manual_seed(s)`. At temperature > 0
the Gumbel noise is drawn over the computed columns only (the references draw it over every
position's logits, (B, L, V) float64), so there the streams differ.

Cache modes (Fast-dLLM): `none` runs the whole canvas every step; `prefix` and `dual` run one full
pass at each block start that stores every position's keys/values, then each step runs only
[block start, end of canvas) (`prefix`) or the block alone (`dual`, the suffix's keys/values reused
from the block start) against the cache.

Early stop: once a row has an end-of-sequence token with nothing masked before it, the rest of its
canvas can no longer change its completion; its masks become that token. Once every row of the
batch is final (or its blocks are done), no further passes run.

The decoder is a step machine (decoding/base.py), so the same code serves `kstep generate` and the
serving engine.
"""
import torch

from kstep.decoding.base import DecodeBatch, Decoder, DecoderResources, prefix_step_output
from kstep.decoding.exact_step import CanvasExactStep
from kstep.decoding.sampling import OutputRules, constrain, pick_tokens
from kstep.decoding.unmask import confidence_rule, make_policy, top_request
from kstep.outputs import StepOutput
from kstep.params import GenerationParams
from kstep.runner.model_runner import ForwardPass, ModelRunner, asking
from kstep.runner.pass_output import PassOutput


def fill_after_stop(completions: torch.Tensor, stop_ids: torch.Tensor, mask_id: int) -> None:
    """Early stop, in place on completions (B, N): in rows whose first stop token has nothing masked
    before it, every mask after it becomes that stop token."""
    N = completions.shape[1]
    index = torch.arange(N, device=completions.device)
    is_stop = torch.isin(completions, stop_ids)
    first_stop = torch.where(is_stop.any(-1), is_stop.float().argmax(-1), N)  # (B,)
    is_mask = completions == mask_id
    has_mask_before = (is_mask & (index < first_stop[:, None])).any(-1)
    is_final = (first_stop < N) & ~has_mask_before  # (B,)
    stop_token = completions.gather(1, first_stop.clamp(max=N - 1)[:, None])  # (B, 1)
    completions.copy_(torch.where(is_final[:, None] & is_mask, stop_token, completions))


class DiffusionDecoder(Decoder, CanvasExactStep):
    """Decodes one canvas batch (B rows with the same settings), block by block, one step per pass."""
    keeps_grammar = True
    logits_shift = 0  # a pass reads the block's predictions at [start, end) - shift (Dream's: 1)
    is_block_sampler = False  # Dream's cached sampler: a block's first pass commits its first token

    def __init__(self, runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                 resources: DecoderResources = DecoderResources()):
        self.params = p = params
        self.runner, self.mask_id, self.stop_ids, self.generator = runner, batch.mask_id, batch.stop_ids, batch.generator
        self.include_canvas, self.first_allowed, self.grammar = batch.include_canvas, batch.first_allowed, batch.constraint
        self.output_rules = OutputRules.of(batch, params)
        prompts, key_mask, mask_id = batch.prompts, batch.key_mask, batch.mask_id
        B, P = prompts.shape
        N, device = p.max_tokens, prompts.device
        suffixes = batch.suffixes if batch.suffixes is not None else torch.zeros(B, 0, dtype=torch.long, device=device)
        self.prompt_len = P
        # Infilling: prompt + N masks + suffix; every pass attends to the suffix, none changes it.
        self.canvas = torch.full((B, P + N + suffixes.shape[1]), mask_id, dtype=torch.long, device=device)
        self.canvas[:, :P] = prompts
        self.canvas[:, P + N:] = suffixes
        if key_mask is not None or batch.suffix_mask is not None:
            def real(mask, width):
                return mask if mask is not None else torch.ones(B, width, dtype=torch.bool, device=device)
            key_mask = torch.cat([real(key_mask, P), real(None, N), real(batch.suffix_mask, suffixes.shape[1])], 1)
        self.key_mask = key_mask
        self.rule = confidence_rule(p.remasking)
        # classifier-free guidance mixes two rows' logits: it needs them whole
        self.top = top_request(p, mask_id, self.first_allowed) if p.cfg_scale == 0 else None
        # Every block starts fully masked, so a fixed schedule is the same for all rows, known on the host.
        self.policy = make_policy(p.policy, p.block_length)
        rows = B * (2 if p.cfg_scale > 0 else 1)
        self.kv = None if p.cache == "none" else runner.allocate_kv(rows, self.canvas.shape[1])
        self.block_idx, self.step_idx, self.nfe = 0, 0, 0
        self.columns = self.drawn_over = None  # the last pass's (next_passes)
        # Per row, the passes in which it unmasked something: what it would have taken alone (in a
        # batch a row idles while the others finish a block; those passes change nothing in it).
        self.row_nfe = torch.zeros(B, dtype=torch.long, device=prompts.device)
        self.is_finished = False
        self.committed = [0] * B  # per row, the committed length reported so far

    @property
    def completions(self) -> torch.Tensor:
        """(B, max_tokens) the gap after the prompt (before any suffix): tokens, masks where still masked."""
        return self.canvas[:, self.prompt_len:self.prompt_len + self.params.max_tokens]

    @property
    def block(self) -> tuple[int, int]:
        start = self.prompt_len + self.block_idx * self.params.block_length
        return start, start + self.params.block_length

    def _model_input(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The canvas, and with LLaDA's unsupervised classifier-free guidance (cfg_scale > 0) also its
        unconditional copy (prompt masked) as extra rows."""
        if self.params.cfg_scale == 0:
            return self.canvas, self.key_mask
        unconditional = self.canvas.clone()
        unconditional[:, :self.prompt_len] = self.mask_id
        key_mask = None if self.key_mask is None else torch.cat([self.key_mask, self.key_mask])
        return torch.cat([self.canvas, unconditional]), key_mask

    def step_tokens(self) -> int:
        """Its canvas (a block start's full pass; twice with classifier-free guidance)."""
        return self.canvas.numel() * (1 if self.params.cfg_scale == 0 else 2)

    def next_passes(self) -> list[ForwardPass]:
        """The forward pass the next step needs: a full pass when uncached or at a block start,
        otherwise a window pass against the cache. Logits only for the block's columns still masked
        in some row: no other position can be unmasked in this step."""
        if self.is_finished:
            return []
        ids, key_mask = self._model_input()
        (start, end), L, cache = self.block, self.canvas.shape[1], self.params.cache
        self.columns = (self.canvas[:, start:end] == self.mask_id).any(0).nonzero().squeeze(1)  # (t,)
        if cache == "none" or self.step_idx == 0:
            self.drawn_over = (L, start + self.columns)  # the references' full pass: every position
            forward = self.runner.full_pass(ids, key_mask, start, end, self.kv, self.columns)
        else:
            window_end = L if cache == "prefix" else end
            self.drawn_over = (window_end - start, self.columns)  # their window pass: [start, window_end)
            forward = self.runner.window_pass(ids, key_mask, start, window_end, L, end - start, self.kv, self.columns)
        return asking([forward], self.top)

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        """Apply one step given the outputs ((B or 2B), t) of the masked block columns asked for."""
        [out] = outputs
        candidates, confidence = self.scores(out, self.columns, self.drawn_over)
        self.row_nfe += self.step(self.canvas, candidates, confidence, self.step_idx).any(-1)
        self.step_idx, self.nfe = self.step_idx + 1, self.nfe + 1
        self._advance()
        return prefix_step_output(self, self.completions, self.committed, self.mask_id, self.stop_ids, self.row_nfe,
                                  self.include_canvas)

    def scores(self, out: PassOutput, columns: torch.Tensor, drawn_over=None,
               rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each block column's candidate token and confidence (B, block_length), -inf where the pass
        gave no outputs, from its outputs ((B or 2B), t) of the block's `columns`."""
        p = self.params
        if p.cfg_scale > 0:
            cond, uncond = out.logits.chunk(2)
            out = PassOutput.of_logits(uncond + (p.cfg_scale + 1) * (cond - uncond))
        start, _ = self.block
        # The mask token is never a candidate (a masked position must become a token); confidence is
        # still scored on the unmodified logits, as the references do.
        proposal = constrain(out.excluding(self.mask_id), (start - self.prompt_len + columns)[None],
                             self.output_rules.of_rows(rows))
        picked = pick_tokens(proposal, p.temperature, self.generator, p.top_k, p.top_p)  # (B, t)
        picked_confidence = self.rule(out, picked, self.generator, drawn_over)  # (B, t)
        # Back to the whole block: positions without logits are unmasked already in every row.
        shape = (picked.shape[0], p.block_length)
        candidates = picked.new_zeros(shape).index_copy_(1, columns, picked)
        confidence = torch.full(shape, float("-inf"), device=picked.device).index_copy_(1, columns,
                                                                                        picked_confidence.float())
        return candidates, confidence

    def step(self, canvas: torch.Tensor, candidates: torch.Tensor, confidence: torch.Tensor,
             step_idx: int | torch.Tensor) -> torch.Tensor:
        """One step of the block's schedule on `canvas` (B, L) in place, given its block's candidates
        and confidence (B, block_length): the policy's choice among the masks, then early stop; the
        chosen positions (B, block_length). `step_idx`: the batch's step in the block, or each row's
        (B,) (self-speculation: rows advance apart)."""
        start, end = self.block
        block = canvas[:, start:end]
        is_masked = block == self.mask_id
        chosen = self.policy.choose(confidence.masked_fill(~is_masked, float("-inf")), step_idx) & is_masked
        if self.grammar is not None:
            candidates, chosen = self.keep_grammar(block, candidates, chosen, self.params.policy.kind == "fixed")
        block.copy_(torch.where(chosen, candidates, block))
        if self.params.early_stop and not self.params.ignore_eos:
            fill_after_stop(canvas[:, self.prompt_len:self.prompt_len + self.params.max_tokens], self.stop_ids,
                            self.mask_id)
        return chosen

    def keep_grammar(self, block: torch.Tensor, candidates: torch.Tensor, chosen: torch.Tensor,
                     is_counted: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's step under a structured output's grammar (kstep/structured/constraint.py): decided
        in order from each row's frontier, as many as the schedule chose where it counts (`is_counted`)."""
        start, end = self.block
        index = torch.arange(start - self.prompt_len, end - self.prompt_len).expand(block.shape[0], -1)
        return self.grammar.step(block, candidates, chosen, index, chosen.sum(-1) if is_counted else None)

    def end_block(self) -> None:
        self.step_idx = 0
        self._advance()

    def _advance(self) -> None:
        """Move past every block with no masks left (a block ends when it has none)."""
        while self.block_idx < self.params.num_blocks:
            start, end = self.block
            if bool((self.canvas[:, start:end] == self.mask_id).any()):
                break
            self.block_idx, self.step_idx = self.block_idx + 1, 0
        if self.step_idx >= self.params.block_length:  # every step unmasks at least one position per row
            raise RuntimeError(f"internal: block {self.block_idx} still masked after {self.step_idx} steps")
        if self.block_idx == self.params.num_blocks:
            self.is_finished, self.kv = True, None
