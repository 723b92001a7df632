"""The autoregressive baseline: prefill once (in chunks, under the engine's token budget), then one
cached decode pass per token.

The KV cache comes from the model's pool (runner/kv_pool.py) and grows with the completion, its
completion part doubling (so a request that stops early never held max_tokens' slots); there is no
recomputation of the prefix; it is the honest baseline diffusion is compared with.
Like the diffusion decoder it is a step machine (decoding/base.py), so the serving engine batches
AR requests the same way.

A structured output (kstep/structured) masks each sampled position to what its grammar allows, and
jumps forward where the grammar forces text (keys, braces, quotes): those tokens are appended
without a decode step of their own, and the next pass takes them with the last sampled token, as a
short prefill (SGLang's jump-forward decoding).
"""
import torch

from kstep.decoding.base import DecodeBatch, Decoder, DecoderResources
from kstep.decoding.kv_growth import FIRST_GROWTH, GrowingCache
from kstep.decoding.sampling import OutputRules, constrain, pick_tokens
from kstep.decoding.unmask import top_request
from kstep.outputs import StepOutput
from kstep.params import GenerationParams
from kstep.runner.model_runner import ForwardPass, ModelRunner, asking, positions_from_padding
from kstep.runner.pass_output import PassOutput

class AutoregressiveDecoder(Decoder):
    """Decodes left-padded prompts (B, P) until every row hits a stop id or max_tokens."""
    keeps_grammar = True

    def __init__(self, runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                 resources: DecoderResources = DecoderResources()):
        prompts, key_mask = batch.prompts, batch.key_mask
        stop_ids, pad_id, generator = batch.stop_ids, batch.pad_id, batch.generator
        self.runner, self.params, self.prompts = runner, params, prompts
        self.first_allowed, self.grammar = batch.first_allowed, batch.constraint
        self.output_rules = OutputRules.of(batch, params)
        self.top = top_request(params, None, self.first_allowed, is_scored=False)  # greedy: the argmax
        # Prefix caching needs every row to hold the same unpadded prompt (one prompt, n samples).
        same_rows = key_mask is None and bool((prompts == prompts[:1]).all())
        self.prefix_cache = resources.prefix_cache if same_rows else None
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache gave (None: not looked up yet)
        self.stop_ids, self.pad_id, self.generator = stop_ids, pad_id, generator
        B, P = prompts.shape
        N = params.max_tokens
        # The cache grows as the completion does (kv_growth.py): the prompt and a first page now, all of it
        # only if it fits the pool at all (a request that never could is refused now).
        self.cache = GrowingCache(runner, B, P + N)
        self.kv = self.cache.room(None, P + min(N, FIRST_GROWTH))
        if key_mask is not None:
            positions = positions_from_padding(key_mask)
            key_mask = torch.cat([key_mask, torch.ones(B, N, dtype=torch.bool, device=prompts.device)], dim=1)
        else:
            positions = torch.arange(P, device=prompts.device).expand(B, -1)
        self.key_mask = key_mask
        # prompt then completion: completion token j sits at the last prompt position + j + 1
        self.seq_positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(N, device=prompts.device)], 1)
        self.out = torch.full((B, N), pad_id, dtype=torch.long, device=prompts.device)
        self.finished = torch.zeros(B, dtype=torch.bool, device=prompts.device)
        self.num_generated, self.nfe, self.is_finished = 0, 0, False
        self.prefilled = 0  # sequence slots (prompt, then completion) the cache holds
        self.pending = 1  # tokens at the end of `out` the next pass takes (more after a jump forward)
        self.lengths = [0] * B  # committed tokens per row (up to and including its stop token)
        self.row_nfe = [0] * B  # passes each row needed
        self.row_done = [False] * B

    def next_passes(self) -> list[ForwardPass]:
        forward = None if self.is_finished else self._next_pass()
        return [] if forward is None else asking([forward], self.top)

    def _next_pass(self) -> ForwardPass | None:
        """The pass that brings the cache up to the sequence so far (prompt and the tokens placed): the
        prefill, whole or its next chunk (base.Decoder.prefill_chunk), the one token (or a jump
        forward's few) of a decode step, or after an eviction the recomputation of all of it. The logits
        of its last position pick the next token once the cache holds the whole sequence."""
        P, start, end = self.prompts.shape[1], self.prefilled, self.prompts.shape[1] + self.num_generated
        if self.num_cached_tokens is None:  # at least the last prompt token runs: its logits pick token 1
            self._room(P)
            start = self.prefilled = self.num_cached_tokens = 0 if self.prefix_cache is None else \
                self.prefix_cache.load(self.prompts[0].tolist(), self.kv, P - 1)
        is_prefill = start < P + self.num_generated - self.pending  # more than a decode step's tokens
        end = self.next_chunk(start, end, self.prompts.shape[0] if is_prefill else 0)
        if end is None:
            return None  # waits for a step with room
        self._room(end)
        self.prefilled = end
        ids = self.prompts[:, start:end] if end <= P else self.out[:, start - P:end - P] if start >= P else \
            torch.cat([self.prompts[:, start:], self.out[:, :end - P]], 1)
        return self.runner.causal_pass(ids, self.seq_positions[:, start:end], self.key_mask, start, self.kv)

    def evict(self) -> bool:
        """Drop the cache (its pages go back) and keep the rest: resumed, it recomputes the cache of the
        prompt and the tokens placed so far, as a prefill, and goes on where it was (its sampler's
        state and grammar untouched, what it sent never taken back)."""
        self.kv, self.prefilled = None, 0
        if self.num_generated == 0:
            self.num_cached_tokens = None  # its prefill again, the prefix cache's help too
        return True

    def _room(self, slots: int) -> None:
        """A cache of at least `slots` slots (a new one after an eviction; PoolFull, nothing changed,
        when the pool has no room: the engine preempts a request and asks again)."""
        self.kv = self.cache.room(self.kv, slots)

    def reserve(self) -> None:
        self._room(self.prompts.shape[1] + self.params.max_tokens)

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        """Sample the next token from the last position's outputs (B, 1)."""
        p, P = self.params, self.prompts.shape[1]
        if not outputs or self.prefilled < P + self.num_generated:  # a chunk, or none: nothing to sample
            self.nfe += len(outputs)
            return StepOutput([[] for _ in self.lengths], self.lengths, self.row_done, self.row_nfe, self.nfe, False)
        [out] = outputs
        self.nfe += 1
        if self.num_generated == 0 and self.prefix_cache is not None:
            self.prefix_cache.store(self.prompts[0].tolist(), self.kv)
        out = constrain(out[:, -1:], self.num_generated, self.output_rules)
        token = pick_tokens(out[:, -1], p.temperature, self.generator, p.top_k, p.top_p)  # (B,)
        if self.grammar is not None:
            token = self._keep(token)
        self.row_nfe = [n + (not done) for n, done in zip(self.row_nfe, self.row_done, strict=True)]
        new = self._append(token)
        self.pending = 1
        while self.grammar is not None and not self.is_finished and (forced := self._forced()) is not None:
            new = [ids + more for ids, more in zip(new, self._append(forced), strict=True)]  # no pass of their own
            self.pending += 1
        return StepOutput(new, self.lengths, self.row_done, self.row_nfe, self.nfe, self.is_finished)

    def _append(self, token: torch.Tensor) -> list[list[int]]:
        """Put the next token (B,) of every row (a stopped row's: padding); each row's new committed ids."""
        token = torch.where(self.finished, self.pad_id, token)
        self.out[:, self.num_generated] = token
        self.num_generated += 1
        if not self.params.ignore_eos:
            self.finished |= torch.isin(token, self.stop_ids)
        if self.num_generated == self.params.max_tokens or bool(self.finished.all()):
            self.is_finished, self.kv = True, None
        # Every token placed is final; a row that had stopped commits nothing more.
        new = [[] if done else [t] for t, done in zip(token.tolist(), self.row_done, strict=True)]
        self.lengths = [n + len(ids) for n, ids in zip(self.lengths, new, strict=True)]
        self.row_done = self.finished.tolist() if self.num_generated < self.params.max_tokens else [True] * len(new)
        return new

    def _keep(self, token: torch.Tensor) -> torch.Tensor:
        """The sampled tokens (B,) as the grammar keeps them (constraint.py's walk over one column)."""
        B, live = token.shape[0], ~self.finished
        kept, _ = self.grammar.step(torch.full((B, 1), self.grammar.mask_id), token[:, None], live[:, None],
                                    torch.full((B, 1), self.num_generated), rows=live, is_free=False)
        return kept[:, 0]

    def _forced(self) -> torch.Tensor | None:
        """The next token of every running row when the grammar forces each of them (rows move together)."""
        forced = []
        for row, done in zip(self.grammar.rows, self.row_done, strict=True):
            token = None if done else row.forced()
            if not done and token is None:
                return None
            forced.append(token if token is not None else self.pad_id)
        B, live = len(forced), torch.tensor([not done for done in self.row_done])
        kept, decided = self.grammar.step(torch.full((B, 1), self.grammar.mask_id), torch.tensor(forced)[:, None],
                                          torch.zeros(B, 1, dtype=torch.bool), torch.full((B, 1), self.num_generated),
                                          rows=live)
        return kept[:, 0].to(self.out.device) if bool(decided[live].all()) else None
