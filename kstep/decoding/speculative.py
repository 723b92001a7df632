"""Speculative decoding for the AR path (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318): a drafter (a small draft model, or n-gram lookup: `drafters.py`) proposes
`num_draft_tokens` (gamma) tokens; the target scores all of them in one pass; each draft token d
is kept with probability min(1, p(d) / q(d)), the first rejected one is replaced by a sample from
norm(max(0, p - q)), and if all are kept a bonus token is sampled from the target's next
distribution. The output distribution is exactly the target's (p and q are the distributions the plain decoders sample
from: temperature, top-k, top-p applied); at temperature 0 it is the target's greedy output.

Rows accept different numbers of tokens, so each row keeps its own length: its tokens live at its
own cache slots, and a rejected suffix is "rolled back" by moving the row's length back (its stale
slots are masked out and overwritten by the next pass). Cache invariant per row: every committed
token except the last is in the target's cache (and a draft model's).

A step is one pass: the prefill (target and draft prompt passes together), then per round each of a
draft model's gamma passes (n-gram drafts need none; a self-drafting tri-mode model one bidirectional
pass of its own), then the target's verification pass.

LinearSpec (Nemotron-Labs-Diffusion's self-speculation, `linear_spec_generate`) is this loop with the
target as its own drafter (drafters.SelfDrafter): at temperature 0 its output is the target's greedy
output; above, it keeps the reference's rule (drafts kept while they equal the target's own samples,
then that sample), which samples the target's distribution too, token by token.
"""
from dataclasses import replace

import torch

from kstep.decoding.base import DecodeBatch, Decoder, DecoderResources
from kstep.decoding.drafters import NGRAM, SELF, ModelDrafter, NgramDrafter, SelfDrafter
from kstep.decoding.kv_growth import FIRST_GROWTH, GrowingCache
from kstep.decoding.sampling import OutputRules, constrain, pick_tokens, sampling_probs
from kstep.decoding.unmask import top_request
from kstep.outputs import StepOutput
from kstep.params import SELF_SPECULATION, GenerationParams
from kstep.runner.model_runner import ForwardPass, ModelRunner, asking, positions_from_padding
from kstep.runner.pass_output import PassOutput

__all__ = ["SpeculativeDecoder", "accept_drafts", "accept_greedy", "accept_matching", "sampling_probs"]


def accept_drafts(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection-sampling rule. target_probs (B, g+1, V), draft_probs (B, g, V), drafts (B, g) ->
    (number of leading drafts kept (B,), the token that follows them (B,))."""
    B, g, V = draft_probs.shape
    p_draft = target_probs[:, :g].gather(-1, drafts[..., None]).squeeze(-1)  # (B, g)
    q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(B, g, generator=generator, dtype=torch.float64, device=drafts.device)
    kept = (u * q_draft <= p_draft).long().cumprod(-1)  # keep while u <= p/q
    num_kept = kept.sum(-1)  # (B,)
    index = num_kept[:, None, None].expand(B, 1, V)
    p_next = target_probs.gather(1, index).squeeze(1)  # (B, V)
    no_draft = draft_probs.new_zeros(B, 1, V)  # after all g kept (or g = 0), the next token comes from p alone
    q_next = torch.cat([draft_probs, no_draft], 1).gather(1, index).squeeze(1)
    residual = (p_next - q_next).clamp(min=0)  # after all g kept, q_next = 0: the bonus comes from p
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-300), p_next)
    return num_kept, torch.multinomial(residual, 1, generator=generator).squeeze(-1)


def accept_greedy(target: PassOutput, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: keep drafts while they equal the target's argmax; then the target's argmax."""
    return accept_matching(pick_tokens(target, 0), drafts)


def accept_matching(target_tokens: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_tokens (B, g+1) the target's own picks after each prefix, drafts (B, g): keep drafts
    while they equal the target's pick; then the target's pick (LinearSpec's acceptance)."""
    num_kept = (drafts == target_tokens[:, :-1]).long().cumprod(-1).sum(-1)
    return num_kept, target_tokens.gather(1, num_kept[:, None]).squeeze(-1)


class SpeculativeDecoder(Decoder):
    """Decodes left-padded prompts (B, P) with the target on `runner` and drafts from `draft`: a draft
    model's runner, "ngram" (lookup, no model) or "self" (the target's bidirectional mode: LinearSpec).
    A structured output's grammar masks the target's distributions after each draft prefix, so the
    drafts are verified against it too (and the output's distribution is the masked target's)."""
    keeps_grammar = True

    def __init__(self, runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                 resources: DecoderResources = DecoderResources()):
        draft = SELF if params.mode == SELF_SPECULATION else resources.draft  # LinearSpec drafts for itself
        if draft is None:
            raise ValueError("num_draft_tokens > 0 needs a draft model (kstep.load(..., draft=...), --draft)")
        prompts, key_mask, stop_ids = batch.prompts, batch.key_mask, batch.stop_ids
        pad_id, generator = batch.pad_id, batch.generator
        self.runner, self.params, self.generator = runner, params, generator
        self.first_allowed, self.grammar = batch.first_allowed, batch.constraint
        self.output_rules = replace(OutputRules.of(batch, params), grammar=None)
        self.top = top_request(params, None, self.first_allowed, is_scored=False)  # the target's greedy passes
        self.prompts, self.key_mask, self.pad_id = prompts, key_mask, pad_id
        self.stop_ids = set(stop_ids.tolist()) if not params.ignore_eos else set()
        self.stop_tensor = stop_ids
        self.gamma = params.num_draft_tokens
        B, P = prompts.shape
        slots = P + params.max_tokens + self.gamma + 1
        # The caches grow as the completion does (kv_growth.py): the prompt and a first stretch now, then
        # each round the slots its passes write (all of it only if it fits the pool at all).
        self.cache = GrowingCache(runner, B, slots)
        self.kv = self.cache.room(None, P + min(params.max_tokens, FIRST_GROWTH) + self.gamma + 1)
        self.real = torch.ones(B, slots, dtype=torch.bool, device=prompts.device)
        if key_mask is not None:
            self.real[:, :P] = key_mask
            self.positions = positions_from_padding(key_mask)
        else:
            self.positions = torch.arange(P, device=prompts.device).expand(B, -1)
        if draft == NGRAM:
            rows = prompts.tolist() if key_mask is None else [p[m].tolist() for p, m in zip(prompts, key_mask)]
            self.drafter = NgramDrafter(rows, runner.model.cfg.vocab_size, params, prompts.device)
        elif draft == SELF:
            self.drafter = SelfDrafter(runner, self.kv, self.real, prompts, self.positions, batch.mask_id, params,
                                       generator)
        else:
            self.drafter = ModelDrafter(draft, prompts, self.positions, key_mask, self.real, params,
                                        stop_ids, generator)
        self.drafter.room(self.kv.length)
        self.phase, self.prefilled = "prefill", 0  # -> ("draft" ->) "verify" -> ...; prompt columns cached
        self.out: list[list[int]] = [[] for _ in range(B)]
        self.row_finished = [False] * B
        self.row_nfe = [0] * B
        self.nfe, self.is_finished = 0, False
        self.num_proposed, self.num_kept = [0] * B, [0] * B  # per row
        self.drafts: torch.Tensor | None = None
        self.draft_probs: torch.Tensor | None = None

    # --- state per row ------------------------------------------------------------------------------

    def _last_committed(self) -> torch.Tensor:
        """(B, 1): each row's last committed token."""
        return torch.tensor([[self.out[b][-1]] for b in range(len(self.out))], device=self.prompts.device)

    # --- passes -----------------------------------------------------------------------------------

    def _room(self, slots: int) -> None:
        """Caches of at least `slots` slots, the target's and a draft model's (PoolFull, nothing more
        changed: the engine preempts a request and asks again)."""
        self.kv = self.cache.room(self.kv, slots)
        self.drafter.room(slots)

    def reserve(self) -> None:
        self._room(self.cache.most)

    def next_passes(self) -> list[ForwardPass]:
        if self.is_finished:
            return []
        if self.phase != "prefill":  # a round writes at most gamma + 1 slots past its rows' committed tokens
            self._room(self.prompts.shape[1] + max(len(o) for o in self.out) + self.gamma + 1)
        if self.phase == "prefill":  # the prompt into both caches, whole or in chunks; its last pass picks token 1
            (B, P), start, has_draft = self.prompts.shape, self.prefilled, isinstance(self.drafter, ModelDrafter)
            end = self.next_chunk(start, P, B * (1 + has_draft))  # (a draft model's chunk counts too)
            if end is None:
                return []  # waits for a step with room
            self.prefilled = end
            target = asking([self.runner.causal_pass(self.prompts[:, start:end], self.positions[:, start:end],
                                                     self.key_mask, start, self.kv)], self.top)
            return [self.drafter.prefill_pass(start, end), *target] if has_draft else target
        if self.phase == "draft":
            return [self.drafter.next_pass()]
        if isinstance(self.drafter, NgramDrafter):
            self.drafts, self.draft_probs = self.drafter.propose(self.out, self.gamma)
        P = self.prompts.shape[1]
        g = torch.tensor([len(o) for o in self.out], device=self.prompts.device)
        ids = torch.cat([self._last_committed(), self.drafts], 1)  # (B, g + 1), g <= gamma
        positions = self.positions[:, -1:] + g[:, None] + torch.arange(ids.shape[1], device=ids.device)
        return asking([self.runner.ragged_causal_pass(ids, positions, P + g - 1, self.real, self.kv)], self.top)

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        """Prefill: sample the first token from the target's outputs (B, 1). A draft pass: the drafter
        samples its next proposal. Verify: (B, g + 1)."""
        if not outputs or (self.phase == "prefill" and self.prefilled < self.prompts.shape[1]):
            self.nfe += bool(outputs)  # a prefill chunk before its last, or none (it waited)
            return self._output([[] for _ in self.out])
        if self.phase == "draft":
            self.drafter.absorb(outputs[0])
            if self.drafter.is_target:  # the target's own pass (LinearSpec): its nfe, as the reference counts
                self.nfe += 1
                self.row_nfe = [n + (not done) for n, done in zip(self.row_nfe, self.row_finished, strict=True)]
            if self.drafter.is_done:
                self.drafts, self.draft_probs = self.drafter.result()
                self.phase = "verify"
            return self._output([[] for _ in self.out])
        out = outputs[-1]
        p = self.params
        self.nfe += 1
        if not self.output_rules.is_empty:  # (the grammar's masks follow the drafts: below)
            generated = torch.tensor([[len(o)] for o in self.out], device=out.device)  # (B, 1)
            index = generated + torch.arange(out.shape[1], device=out.device)  # (B, T)
            out = constrain(out, index, self.output_rules)
        if self.grammar is not None:  # the target's distributions after each draft prefix, as the grammar allows
            out = out.with_logits(self.grammar.mask_drafts(out.logits, self.drafts))
        if self.drafts is None:
            new = [[t] for t in pick_tokens(out[:, -1], p.temperature, self.generator, p.top_k, p.top_p).tolist()]
        else:
            if p.temperature == 0 or self.draft_probs is None:  # greedy, or LinearSpec's sampled rule
                tokens = pick_tokens(out, p.temperature, self.generator, p.top_k, p.top_p)  # (B, g + 1)
                num_kept, following = accept_matching(tokens, self.drafts)
            else:
                num_kept, following = accept_drafts(sampling_probs(out.logits, p), self.draft_probs, self.drafts,
                                                    self.generator)
            drafts, num_kept, following = self.drafts.tolist(), num_kept.tolist(), following.tolist()
            new = [d[:k] + [f] for d, k, f in zip(drafts, num_kept, following, strict=True)]
            live = [not f for f in self.row_finished]
            for b, (k, alive) in enumerate(zip(num_kept, live, strict=True)):
                self.num_proposed[b] += self.drafts.shape[1] * alive
                self.num_kept[b] += k * alive
        committed = []
        for b, tokens in enumerate(new):
            committed.append([])
            if self.row_finished[b]:
                continue
            self.row_nfe[b] += 1
            for token in tokens if self.grammar is None else self.grammar.take_run(b, tokens):
                self.out[b].append(token)
                committed[b].append(token)
                if token in self.stop_ids or len(self.out[b]) == p.max_tokens:
                    self.row_finished[b] = True
                    break
        self.drafts = self.draft_probs = None
        if all(self.row_finished):
            self.is_finished, self.kv = True, None
            self.drafter.release()
        elif self.drafter.has_passes:
            self.drafter.start(self.out, self.gamma)
            self.phase = "draft"
        else:
            self.phase = "verify"
        return self._output(committed)

    def _output(self, committed: list[list[int]]) -> StepOutput:
        return StepOutput(committed, [len(o) for o in self.out], list(self.row_finished), list(self.row_nfe),
                          self.nfe, self.is_finished)

    def stats(self, row: int | None = None) -> dict[str, float]:
        """Drafts proposed and kept and tokens per target pass (a row's: per pass it took), of the batch
        or of row `row`; the draft passes are the batch's (every row runs in each)."""
        rows = range(len(self.out)) if row is None else [row]
        proposed, kept = sum(self.num_proposed[b] for b in rows), sum(self.num_kept[b] for b in rows)
        per_pass = sum(len(o) for o in self.out) / max(1, self.nfe) / len(self.out) if row is None else \
            len(self.out[row]) / max(1, self.row_nfe[row])
        return {"acceptance_rate": kept / proposed if proposed else 0.0, "drafted_tokens": proposed,
                "accepted_tokens": kept, "tokens_per_target_pass": per_pass, "draft_passes": self.drafter.num_passes}
