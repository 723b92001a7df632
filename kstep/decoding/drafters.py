"""Where speculative decoding's draft tokens come from.

`ModelDrafter`: a small AR model with its own KV cache, one pass per draft token (Leviathan et al.);
its passes are steps of the speculative decoder, so the engine packs and counts them like any other.
`NgramDrafter`: no model at all: the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens (n = 4 down to 1), as vLLM's n-gram proposer and transformers' prompt lookup
decoding. Its proposals cost no forward pass, which matters when a small draft model's pass costs
nearly as much as the target's (per-pass overhead, not weight bytes, dominates small models).

`SelfDrafter`: no second model either: a tri-mode model (Nemotron-Labs-Diffusion) drafts for itself,
LinearSpec (its `linear_spec_generate`): one bidirectional pass over [last committed token; gamma
masks] against its own cache fills every mask (the output at j predicts the token at j).

They yield (drafts (B, gamma), their distributions (B, gamma, V) at temperature > 0 else None); the
rejection rule in `speculative.py` makes the output the target's distribution whatever they propose
(the self drafter's None at temperature > 0 selects LinearSpec's own rule there).
"""
import torch
import torch.nn.functional as F

from kstep.decoding.kv_growth import GrowingCache
from kstep.decoding.sampling import pick_tokens, sample_tokens, sampling_probs, suppress_stop_tokens
from kstep.params import GenerationParams
from kstep.runner.model_runner import ForwardPass, ModelRunner
from kstep.runner.pass_output import PassOutput

NGRAM_MAX, NGRAM_MIN = 4, 1
NGRAM = "ngram"  # the --draft name that selects NgramDrafter
SELF = "self"  # the target drafts for itself (SelfDrafter): a tri-mode model's linear_spec mode


class ModelDrafter:
    """Proposes with a draft model whose cache slots mirror the target's (same `real` mask)."""
    has_passes, is_target = True, False

    def __init__(self, runner: ModelRunner, prompts: torch.Tensor, positions: torch.Tensor,
                 key_mask: torch.Tensor | None, real: torch.Tensor, params: GenerationParams,
                 stop_ids: torch.Tensor, generator: torch.Generator | None):
        self.runner, self.prompts, self.positions, self.key_mask, self.real = runner, prompts, positions, key_mask, real
        self.params, self.stop_ids, self.generator = params, stop_ids, generator
        self.cache = GrowingCache(runner, prompts.shape[0], real.shape[1])
        self.kv = None
        self.num_passes = 0

    def room(self, slots: int) -> None:
        """A cache of at least `slots` slots (grown as the target's is; PoolFull, nothing changed)."""
        self.kv = self.cache.room(self.kv, slots)

    def prefill_pass(self, start: int, end: int) -> ForwardPass:
        """The prompt's columns [start, end) into the draft's cache (its logits are not needed: the
        target picks token 1)."""
        self.num_passes += 1
        return self.runner.causal_pass(self.prompts[:, start:end], self.positions[:, start:end], self.key_mask,
                                       start, self.kv)

    def start(self, history: list[list[int]], gamma: int) -> None:
        """Begin proposing gamma tokens after `history`: per row the committed tokens after the prompt
        (at least one each). The draft catches up on the last two committed tokens (the second may be
        the target's bonus token, which it never saw), then proposes one token per pass."""
        P = self.prompts.shape[1]
        self.gamma = gamma
        self.num_committed = torch.tensor([len(h) for h in history], device=self.prompts.device)
        self.ids = torch.tensor([[*self.prompts[b, -1:].tolist(), *h][-2:] for b, h in enumerate(history)],
                                device=self.prompts.device)
        self.write_start = P + self.num_committed - 2
        self.drafts: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []

    @property
    def is_done(self) -> bool:
        return len(self.drafts) == self.gamma

    def next_pass(self) -> ForwardPass:
        P = self.prompts.shape[1]
        offsets = torch.arange(self.ids.shape[1], device=self.ids.device)
        positions = self.positions[:, -1:] + (self.write_start - P + 1)[:, None] + offsets
        self.num_passes += 1
        return self.runner.ragged_causal_pass(self.ids, positions, self.write_start, self.real, self.kv)

    def absorb(self, out: PassOutput) -> None:
        """Sample the next draft token from a draft pass's logits (B, T, V)."""
        p = self.params
        logits = out.logits[:, -1:]  # (B, 1, V)
        if p.min_tokens:  # propose what the target may emit (its stops are suppressed there too)
            logits = suppress_stop_tokens(logits, self.stop_ids, (self.num_committed + len(self.drafts))[:, None],
                                          p.min_tokens)
        logits = logits[:, -1]
        token = sample_tokens(logits, p.temperature, self.generator, p.top_k, p.top_p)
        self.drafts.append(token)
        if p.temperature > 0:
            self.probs.append(sampling_probs(logits, p))
        self.write_start = self.write_start + self.ids.shape[1]
        self.ids = token[:, None]

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.stack(self.drafts, 1), torch.stack(self.probs, 1) if self.probs else None

    def release(self) -> None:
        self.kv = None


class NgramDrafter:
    """Proposes by lookup in each row's own text (prompt + committed tokens); an index of n-gram ->
    where its latest earlier occurrence continues, updated as tokens commit, keeps a lookup O(1)."""
    has_passes, is_target = False, False

    def __init__(self, prompts: list[list[int]], vocab_size: int, params: GenerationParams,
                 device: torch.device | str = "cpu"):
        self.context = [list(p) for p in prompts]
        self.device = device
        self.prompt_lengths = [len(p) for p in prompts]
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in prompts]
        self.indexed = [0] * len(prompts)  # positions whose ending n-grams are in the index
        self.vocab_size, self.params, self.num_passes = vocab_size, params, 0

    def _lookup(self, row: int, gamma: int) -> list[int]:
        ctx, index = self.context[row], self.index[row]
        # Index every n-gram ending before the last token: each has a continuation to propose.
        for end in range(self.indexed[row], len(ctx) - 1):
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end + 1 >= n:
                    index[tuple(ctx[end + 1 - n: end + 1])] = end + 1
        self.indexed[row] = max(self.indexed[row], len(ctx) - 1)
        for n in range(min(NGRAM_MAX, len(ctx)), NGRAM_MIN - 1, -1):
            start = index.get(tuple(ctx[-n:]))
            if start is not None:
                return ctx[start: start + gamma]
        return []

    def propose(self, history: list[list[int]], gamma: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to gamma tokens per row; as many for every row as the longest match (0 when no row has
        one: the verification pass is then a plain decode step, so lookup never costs a wider pass
        for nothing). A shorter row is padded with its last token, which the rejection rule keeps
        only where the target agrees."""
        found = []
        for row, committed in enumerate(history):
            ctx = self.context[row]
            ctx.extend(committed[len(ctx) - self.prompt_lengths[row]:])
            found.append(self._lookup(row, gamma))
        width = max(len(f) for f in found)
        drafts = torch.tensor([f + [(f or self.context[row])[-1]] * (width - len(f)) for row, f in enumerate(found)],
                              dtype=torch.long, device=self.device).reshape(len(found), width)
        if self.params.temperature == 0:
            return drafts, None
        # A deterministic proposal is the distribution with all its mass on the draft token.
        return drafts, F.one_hot(drafts, self.vocab_size).double()

    def room(self, slots: int) -> None:
        """No cache of its own."""

    def release(self) -> None:
        pass


class SelfDrafter:
    """LinearSpec's draft: the target's own bidirectional pass over [last committed token; gamma
    masks] at the slots the verification pass then overwrites (the reference does not write them:
    `use_cache=False`), attending to the target's cache before them. One pass fills every mask (the
    reference's default threshold 0); a draft is never the mask token (the reference's would never
    be kept: the verifier does not predict masks)."""
    has_passes, is_target = True, True

    def __init__(self, runner: ModelRunner, kv, real: torch.Tensor, prompts: torch.Tensor, positions: torch.Tensor,
                 mask_id: int, params: GenerationParams, generator: torch.Generator | None):
        self.runner, self.kv, self.real, self.prompts, self.positions = runner, kv, real, prompts, positions
        self.mask_id, self.params, self.generator = mask_id, params, generator
        self.num_passes = 0

    def start(self, history: list[list[int]], gamma: int) -> None:
        """Draft gamma tokens after `history` (per row its committed tokens, at least one each)."""
        device = self.prompts.device
        self.num_committed = torch.tensor([len(h) for h in history], device=device)  # (B,)
        last = torch.tensor([[h[-1]] for h in history], device=device)
        self.ids = torch.cat([last, torch.full((len(history), gamma), self.mask_id, device=device)], 1)  # (B, g+1)
        self.drafts: torch.Tensor | None = None

    @property
    def is_done(self) -> bool:
        return self.drafts is not None

    def next_pass(self) -> ForwardPass:
        P = self.prompts.shape[1]
        offsets = torch.arange(self.ids.shape[1], device=self.ids.device)
        positions = self.positions[:, -1:] + self.num_committed[:, None] + offsets  # the last committed token's on
        self.num_passes += 1
        return self.runner.ragged_causal_pass(self.ids, positions, P + self.num_committed - 1, self.real, self.kv,
                                              is_causal=False, kind="draft")

    def absorb(self, out: PassOutput) -> None:
        """The drafts from the draft pass's outputs (B, g + 1): each mask's own output."""
        p = self.params
        proposal = out[:, 1:].excluding(self.mask_id)  # (B, g)
        self.drafts = pick_tokens(proposal, p.temperature, self.generator, p.top_k, p.top_p)

    def result(self) -> tuple[torch.Tensor, None]:
        return self.drafts, None

    def room(self, slots: int) -> None:
        """Its cache is the target's (grown in place by the speculative decoder)."""

    def release(self) -> None:
        self.kv = None


def check_draft(target, draft) -> None:
    """A draft (an LLM) must be an AR model over the target's vocabulary: its token ids mean the target's."""
    if target.is_diffusion or draft.is_diffusion:
        raise ValueError("speculative decoding needs an autoregressive target and draft "
                         f"({target.path.name}: {target.cfg.family}, draft {draft.path.name}: {draft.cfg.family})")
    same = draft.cfg.vocab_size == target.cfg.vocab_size
    if same and target.tokenizer is not None and draft.tokenizer is not None:
        same = target.tokenizer.vocab() == draft.tokenizer.vocab()
    if not same:
        raise ValueError(f"draft {draft.path} does not share the target's tokenizer/vocabulary")
