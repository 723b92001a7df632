"""Dream's samplers (Dream-v0, arXiv:2508.15487): the reference `diffusion_generate` (HKUNLP/Dream;
restated in NVlabs/Fast-dLLM `dream/model/generation_utils.py`) and Fast-dLLM's block sampler
(`dream/model/generation_utils_block.py`).

Dream keeps its AR parent's logit shift: the token at position j is predicted by the output at
j - 1, so every pass asks the runner for the rows one to the left of the masked columns.

- `cache="none"` (`--exact`: one block over the whole canvas): Dream's `_sample`, block by block.
  The schedule runs t from 1 to `eps` over the block's `steps`; each pass unmasks
  int(masked * (1 - s/t)) of the most confident masks (the last pass: all left), float32 as the
  reference; `alg_temp` samples them from softmax(confidence / alg_temp) instead. `remasking`:
  low_confidence = `maskgit_plus`, margin = `topk_margin`, entropy = `entropy`, random = `origin`
  (each mask revealed with probability 1 - s/t). A threshold is `confidence_threshold`: a quota of
  masks/steps per pass, the most confident always, the rest only at >= threshold; refused ones are
  carried to the next pass, and a refusal at the last pass adds one.
- `cache="prefix" | "dual"`: Fast-dLLM's block sampler. A block starts with a full pass that
  stores every position's keys/values and commits the block's first token; then window passes
  against the cache unmask by the threshold rule (the most confident, and all >= threshold) or by
  the same schedule as above over the block's remaining passes.

Where kstep differs, on purpose: counts are per row (the reference uses the batch mean, equal for
equal rows); the mask token is never proposed (the reference could write it back); the block
sampler's fixed schedule scores with the requested `remasking` (the reference always uses entropy
there); a block sampler needs at least two passes per block (the reference leaves a one-pass block
masked forever).
"""
import torch

from kstep.decoding.base import DecoderResources, prefix_step_output
from kstep.decoding.exact_draw import draw_one
from kstep.decoding.masked_diffusion import DiffusionDecoder, fill_after_stop
from kstep.decoding.row_tiles import tiled
from kstep.decoding.sampling import constrain
from kstep.decoding.unmask import choose_threshold, choose_top, top_request
from kstep.outputs import StepOutput
from kstep.runner.model_runner import ForwardPass, asking
from kstep.runner.pass_output import PassOutput

DEFAULT_EPS = 1e-3  # DreamGenerationConfig's eps


def dream_scores(out: PassOutput, params, mask_id: int, generator: torch.Generator | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's `sample_tokens` on a pass's outputs (...) -> (tokens, confidence) (`dream_logit_scores`;
    top tokens, at temperature 0 without filters: theirs, in float32 where Dream's are in the logits' dtype)."""
    score = {"margin": "margin", "entropy": "neg_entropy"}.get(params.remasking, "prob")
    return out.read(("ids", score), lambda logits: dream_logit_scores(logits, params, mask_id, generator))


def dream_logit_scores(logits: torch.Tensor, params, mask_id: int, generator: torch.Generator | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's `sample_tokens` on (..., V) logits -> (tokens, confidence): temperature, then top-p, then
    top-k (filtered logits at the dtype's minimum), softmax; argmax at temperature 0 else a sample;
    confidence the token's probability, or top-1 minus top-2 (`margin`), or negative entropy. In row
    tiles (row_tiles.py), the draws exact (exact_draw.py): the same tokens and scores as whole."""
    return tiled(lambda rows: _dream_rows(rows, params, mask_id, generator), logits)


def _dream_rows(logits: torch.Tensor, params, mask_id: int, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    p = params
    if p.temperature > 0:
        logits = logits / p.temperature
    lowest = torch.finfo(logits.dtype).min
    if p.top_p is not None and p.top_p < 1:
        ordered, order = logits.sort(-1, descending=True)
        beyond = ordered.softmax(-1).cumsum(-1) > p.top_p
        beyond[..., 1:] = beyond[..., :-1].clone()  # keep the token that crosses top_p
        beyond[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(beyond).scatter(-1, order, beyond), lowest)
    if p.top_k is not None:
        kth = logits.topk(min(p.top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, lowest)
    probs = logits.softmax(-1)  # (..., V)
    proposal = probs.clone()
    proposal[..., mask_id] = 0  # a masked position must become a token
    if p.temperature > 0:
        tokens = draw_one(proposal.reshape(-1, proposal.shape[-1]), generator).view(probs.shape[:-1])
    else:
        tokens = proposal.argmax(-1)
    if p.remasking == "margin":
        top2 = probs.topk(2, -1).values
        confidence = top2[..., 0] - top2[..., 1]
    elif p.remasking == "entropy":
        confidence = (probs * (probs + 1e-10).log()).sum(-1)
    else:
        confidence = probs.gather(-1, tokens[..., None]).squeeze(-1)
    return tokens, confidence


class DreamDecoder(DiffusionDecoder):
    """Decodes one canvas batch, block by block; the canvas, caches, early stop and outputs are the
    masked-diffusion decoder's, the step is Dream's."""
    logits_shift = 1  # its AR parent's shift: position j is predicted by the output at j - 1

    def __init__(self, runner, batch, params, resources=DecoderResources()):
        super().__init__(runner, batch, params, resources)
        p = self.params
        self.steps_per_block = p.steps // p.num_blocks
        self.is_block_sampler = p.cache != "none"  # the schedule's arithmetic was checked by resolve
        eps = DEFAULT_EPS if p.eps is None else p.eps
        self.timesteps = torch.linspace(1, eps, self.steps_per_block + 1)  # float32, as the reference
        B = self.canvas.shape[0]
        device = self.canvas.device
        self.is_quota = not self.is_block_sampler and p.policy.kind == "threshold"  # confidence_threshold
        # Dream filters by top-p / top-k before its softmax even at temperature 0: those need the logits
        self.top = top_request(p, self.mask_id, self.first_allowed) \
            if p.top_k is None and (p.top_p is None or p.top_p >= 1) else None
        self._start_block(B, device)

    def _start_block(self, B: int, device: torch.device) -> None:
        self.carry = torch.zeros(B, dtype=torch.long, device=device)
        self.quota = torch.full((B,), self.params.block_length // self.steps_per_block, dtype=torch.long, device=device)
        self.live_steps = torch.full((B,), self.steps_per_block, dtype=torch.long, device=device)

    def next_passes(self) -> list[ForwardPass]:
        """Logits for the rows left of the block's masked columns (the shift); at a block-sampler
        block start, only for the block's first column."""
        if self.is_finished:
            return []
        (start, end), L, cache = self.block, self.canvas.shape[1], self.params.cache
        self.columns = (self.canvas[:, start:end] == self.mask_id).any(0).nonzero().squeeze(1)  # (t,)
        if not self.is_block_sampler:
            forward = self.runner.full_pass(self.canvas, self.key_mask, start - 1, end - 1, None, self.columns)
        elif self.step_idx == 0:
            self.columns = self.columns[:1] * 0  # only the first column: the pass commits it
            forward = self.runner.full_pass(self.canvas, self.key_mask, start - 1, start, self.kv)
        else:  # the block's first column is committed by the block-start pass, so window row k - 1 serves column k
            self.columns = self.columns[self.columns > 0]
            window_end = L if cache == "prefix" else end
            forward = self.runner.window_pass(self.canvas, self.key_mask, start, window_end, L, end - start - 1,
                                              self.kv, self.columns - 1)
        return asking([forward], self.top)

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        [out] = outputs  # (B, t)
        start, end = self.block
        had_masks = (self.canvas[:, start:end] == self.mask_id).any(-1)
        candidates, confidence = self.scores(out, self.columns)
        self.step(self.canvas, candidates, confidence, self.step_idx)
        self.row_nfe += had_masks  # a pass that unmasks nothing is still one the row needs
        self.step_idx, self.nfe = self.step_idx + 1, self.nfe + 1
        self._advance()
        return self._output()

    def scores(self, out: PassOutput, columns: torch.Tensor, drawn_over=None,
               rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each block column's candidate token and confidence (B, block_length), -inf where the pass
        gave no outputs, from its outputs (B, t) predicting the block's `columns`."""
        p = self.params
        start, _ = self.block
        out = constrain(out, (start - self.prompt_len + columns)[None], self.output_rules.of_rows(rows))
        tokens, scores = dream_scores(out, p, self.mask_id, self.generator)  # (B, t) each
        shape = (tokens.shape[0], p.block_length)
        candidates = tokens.new_zeros(shape).index_copy_(1, columns, tokens)
        confidence = torch.full(shape, float("-inf"), dtype=scores.dtype, device=tokens.device)
        return candidates, confidence.index_copy_(1, columns, scores)

    def step(self, canvas: torch.Tensor, candidates: torch.Tensor, confidence: torch.Tensor,
             step_idx: int | torch.Tensor) -> torch.Tensor:
        """One of Dream's steps on `canvas` (B, L) in place (masked_diffusion.py's `step`); the chosen
        positions (B, block_length)."""
        p = self.params
        start, end = self.block
        block = canvas[:, start:end]
        is_masked = block == self.mask_id
        confidence = confidence.masked_fill(~is_masked, float("-inf"))
        if self.is_block_sampler and isinstance(step_idx, int) and step_idx == 0:
            chosen = torch.zeros_like(is_masked)
            chosen[:, 0] = True  # Fast-dLLM: the block-start pass commits the block's first token
        elif p.policy.kind == "threshold" and self.is_block_sampler:
            chosen = choose_threshold(confidence, p.policy.value)
        elif self.is_quota:
            chosen = self._choose_quota(confidence)
        else:
            chosen = self._choose_scheduled(confidence, is_masked, step_idx)
        chosen &= is_masked
        if self.grammar is not None:  # every choice but a threshold's is a count
            candidates, chosen = self.keep_grammar(block, candidates, chosen, p.policy.kind != "threshold")
        block.copy_(torch.where(chosen, candidates, block))
        if p.early_stop and not p.ignore_eos:
            fill_after_stop(canvas[:, self.prompt_len:self.prompt_len + p.max_tokens], self.stop_ids, self.mask_id)
        return chosen

    def _choose_scheduled(self, confidence: torch.Tensor, is_masked: torch.Tensor,
                          step_idx: int | torch.Tensor) -> torch.Tensor:
        """The linear-in-t schedule: int(masked * (1 - s/t)) per row, all at the last pass; `random`
        (Dream's `origin`) reveals each mask with probability 1 - s/t instead. `step_idx`: the
        batch's step or each row's (B,); float32 as the reference either way."""
        p, n = self.params, self.steps_per_block
        i = torch.as_tensor(step_idx, device=is_masked.device).expand(confidence.shape[0])  # (B,)
        timesteps = self.timesteps.to(is_masked.device)
        is_last = i >= n - 1
        fraction = 1 - timesteps[(i + 1).clamp(max=n)] / timesteps[i.clamp(max=n - 1)]  # (B,)
        num_masked = is_masked.sum(-1)  # (B,)
        if p.remasking == "random":  # (one batch step: the reference draws nothing at its last pass)
            if bool(is_last.all()):
                return is_masked
            u = torch.rand(is_masked.shape, generator=self.generator, device=is_masked.device)
            return is_masked & (u < fraction[:, None])
        counts = torch.where(is_last, num_masked, (num_masked.float() * fraction).long())
        if p.alg_temp:
            return self._sample_positions(confidence, counts)
        return self._top(confidence, counts)

    def _top(self, confidence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The `counts[b]` most confident of each row, ranked over the reference's layout (the whole
        canvas without a cache; the window with one), so ties (common once top-p/top-k leave a single
        token) break as torch.topk breaks them there."""
        start, end = self.block
        L = self.canvas.shape[1]
        left, right = (start, L - end) if not self.is_block_sampler else \
            (0, L - end if self.params.cache == "prefix" else 0)
        padded = torch.nn.functional.pad(confidence, (left, right), value=float("-inf"))
        return choose_top(padded, counts, int(counts.max()))[:, left:left + confidence.shape[1]]

    def _sample_positions(self, confidence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dream's alg_temp: `counts[b]` positions drawn without replacement from softmax(conf / alg_temp)."""
        chosen = torch.zeros_like(confidence, dtype=torch.bool)
        weights = (confidence / self.params.alg_temp).softmax(-1)
        for row, count in enumerate(counts.tolist()):  # counts differ per row; alg_temp is a rare setting
            if count > 0:
                chosen[row, torch.multinomial(weights[row], count, generator=self.generator)] = True
        return chosen

    def _choose_quota(self, confidence: torch.Tensor) -> torch.Tensor:
        """Dream's confidence_threshold: quota + carry of the most confident masks; beyond the first,
        only those at >= threshold; refusals carry over, and one at the last pass adds a pass."""
        counts = self.quota + self.carry  # (B,)
        offered = self._top(confidence, counts)
        best = torch.zeros_like(offered).scatter_(-1, confidence.argmax(-1, keepdim=True), True)
        chosen = offered & ((confidence >= self.params.policy.value) | best)
        refused = counts - chosen.sum(-1)
        at_last = (self.step_idx == self.live_steps - 1) & (refused > 0)
        self.live_steps += at_last.long()
        self.quota = torch.where(at_last, 0, self.quota)
        self.carry = refused
        return chosen

    def _advance(self) -> None:
        """Move past every block with no masks left."""
        block_idx = self.block_idx
        while self.block_idx < self.params.num_blocks:
            start, end = self.block
            if bool((self.canvas[:, start:end] == self.mask_id).any()):
                break
            self.block_idx, self.step_idx = self.block_idx + 1, 0
        if self.block_idx != block_idx:
            self._start_block(self.canvas.shape[0], self.canvas.device)
        if self.block_idx == self.params.num_blocks:
            self.is_finished, self.kv = True, None

    def _output(self) -> StepOutput:
        return prefix_step_output(self, self.completions, self.committed, self.mask_id, self.stop_ids, self.row_nfe,
                                  self.include_canvas)
