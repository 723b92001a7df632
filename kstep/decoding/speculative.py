"""Speculative decoding for the AR path (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318): a small draft model proposes `num_draft_tokens` (gamma) tokens one by one; the
target scores all of them in one pass; each draft token d is kept with probability
min(1, p(d) / q(d)), the first rejected one is replaced by a sample from norm(max(0, p - q)), and
if all are kept a bonus token is sampled from the target's next distribution. The output
distribution is exactly the target's (p and q are the distributions the plain decoders sample
from: temperature, top-k, top-p applied); at temperature 0 it is the target's greedy output.

Rows accept different numbers of tokens, so each row keeps its own length: its tokens live at its
own cache slots, and a rejected suffix is "rolled back" by moving the row's length back (its stale
slots are masked out and overwritten by the next pass). Cache invariant per row: every committed
token except the last is in both caches.
"""
import torch
import torch.nn.functional as F

from kstep.decoding.sampling import filter_logits, sample_tokens
from kstep.params import GenerationParams
from kstep.runner.model_runner import ForwardPass, ModelRunner, positions_from_padding


def sampling_probs(logits: torch.Tensor, params: GenerationParams) -> torch.Tensor:
    """(..., V) -> the float64 distribution `sample_tokens` draws from at params.temperature > 0."""
    logits = logits.double()
    if params.top_k is not None or params.top_p is not None:
        kept = filter_logits(logits / params.temperature, params.top_k, params.top_p)
        logits = logits.masked_fill(torch.isinf(kept), float("-inf"))
    return F.softmax(logits / params.temperature, dim=-1)


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
    q_next = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], 1).gather(1, index).squeeze(1)
    residual = (p_next - q_next).clamp(min=0)  # after all g kept, q_next = 0: the bonus comes from p
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-300), p_next)
    return num_kept, torch.multinomial(residual, 1, generator=generator).squeeze(-1)


def accept_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: keep drafts while they equal the target's argmax; then the target's argmax."""
    best = target_logits.argmax(-1)  # (B, g+1)
    num_kept = (drafts == best[:, :-1]).long().cumprod(-1).sum(-1)
    return num_kept, best.gather(1, num_kept[:, None]).squeeze(-1)


class SpeculativeDecoder:
    """Decodes left-padded prompts (B, P) with the target on `runner` and a draft on `draft_runner`.
    `next_pass` runs the draft's proposals itself and returns the target's verification pass."""

    def __init__(self, runner: ModelRunner, draft_runner: ModelRunner, prompts: torch.Tensor,
                 key_mask: torch.Tensor | None, params: GenerationParams, stop_ids: torch.Tensor, pad_id: int,
                 generator: torch.Generator | None):
        self.runner, self.draft_runner, self.params, self.generator = runner, draft_runner, params, generator
        self.prompts, self.key_mask, self.pad_id = prompts, key_mask, pad_id
        self.stop_ids = set(stop_ids.tolist()) if not params.ignore_eos else set()
        self.gamma = params.num_draft_tokens
        B, P = prompts.shape
        slots = P + params.max_tokens + self.gamma + 1
        self.kv, self.draft_kv = runner.allocate_kv(B, slots), draft_runner.allocate_kv(B, slots)
        self.real = torch.ones(B, slots, dtype=torch.bool, device=prompts.device)
        if key_mask is not None:
            self.real[:, :P] = key_mask
            self.positions = positions_from_padding(key_mask)
        else:
            self.positions = torch.arange(P, device=prompts.device).expand(B, -1)
        self.out: list[list[int]] = [[] for _ in range(B)]
        self.row_finished = [False] * B
        self.row_nfe = torch.zeros(B, dtype=torch.long)
        self.nfe, self.is_finished = 0, False
        self.num_proposed, self.num_kept, self.num_draft_passes = 0, 0, 0
        self.drafts: torch.Tensor | None = None
        self.draft_probs: torch.Tensor | None = None

    # --- state per row ------------------------------------------------------------------------------

    def _last_two(self) -> torch.Tensor:
        """(B, 2): each row's second-to-last and last committed tokens."""
        rows = [[*self.prompts[b, -1:].tolist(), *self.out[b]][-2:] for b in range(len(self.out))]
        return torch.tensor(rows, device=self.prompts.device)

    def _generated(self) -> torch.Tensor:
        return torch.tensor([len(o) for o in self.out], device=self.prompts.device)

    # --- passes -----------------------------------------------------------------------------------

    def next_pass(self) -> ForwardPass | None:
        if self.is_finished:
            return None
        P = self.prompts.shape[1]
        if self.nfe == 0:  # prefill both caches with the prompt; the target's pass picks token 1
            self.draft_runner.logits(self.draft_runner.causal_pass(self.prompts, self.positions, self.key_mask, 0,
                                                                   self.draft_kv))
            return self.runner.causal_pass(self.prompts, self.positions, self.key_mask, 0, self.kv)
        g = self._generated()
        last_position = self.positions[:, -1]  # (B,) the prompt's last position
        # The draft catches up on the last two committed tokens (the second may be a bonus token it
        # never saw), then proposes gamma tokens one pass at a time.
        ids, start = self._last_two(), P + g - 2
        drafts, probs = [], []
        for i in range(self.gamma):
            positions = last_position[:, None] + (start - P + 1)[:, None] + torch.arange(ids.shape[1],
                                                                                         device=ids.device)
            forward_pass = self.draft_runner.ragged_causal_pass(ids, positions, start, self.real, self.draft_kv)
            logits = self.draft_runner.logits(forward_pass)[:, -1]  # (B, V)
            self.num_draft_passes += 1
            token = sample_tokens(logits, self.params.temperature, self.generator, self.params.top_k, self.params.top_p)
            drafts.append(token)
            if self.params.temperature > 0:
                probs.append(sampling_probs(logits, self.params))
            start = start + ids.shape[1]
            ids = token[:, None]
        self.drafts = torch.stack(drafts, 1)  # (B, gamma)
        self.draft_probs = torch.stack(probs, 1) if probs else None
        last = self._last_two()[:, 1:]
        ids = torch.cat([last, self.drafts], 1)  # (B, gamma + 1)
        start = P + g - 1
        positions = last_position[:, None] + g[:, None] + torch.arange(ids.shape[1], device=ids.device)
        return self.runner.ragged_causal_pass(ids, positions, start, self.real, self.kv)

    def update(self, logits: torch.Tensor) -> None:
        """Prefill: sample the first token from (B, 1, V). Otherwise verify: (B, gamma + 1, V)."""
        p = self.params
        self.nfe += 1
        if self.drafts is None:
            new = [[t] for t in sample_tokens(logits[:, -1], p.temperature, self.generator, p.top_k, p.top_p).tolist()]
        else:
            if p.temperature == 0:
                num_kept, following = accept_greedy(logits, self.drafts)
            else:
                num_kept, following = accept_drafts(sampling_probs(logits, p), self.draft_probs, self.drafts,
                                                    self.generator)
            drafts, num_kept, following = self.drafts.tolist(), num_kept.tolist(), following.tolist()
            new = [d[:k] + [f] for d, k, f in zip(drafts, num_kept, following, strict=True)]
            live = [not f for f in self.row_finished]
            self.num_proposed += self.gamma * sum(live)
            self.num_kept += sum(k for k, alive in zip(num_kept, live, strict=True) if alive)
        for b, tokens in enumerate(new):
            if self.row_finished[b]:
                continue
            self.row_nfe[b] += 1
            for token in tokens:
                self.out[b].append(token)
                if token in self.stop_ids or len(self.out[b]) == p.max_tokens:
                    self.row_finished[b] = True
                    break
        self.drafts = self.draft_probs = None
        if all(self.row_finished):
            self.is_finished, self.kv, self.draft_kv = True, None, None

    # --- results ------------------------------------------------------------------------------------

    @property
    def completions(self) -> torch.Tensor:
        width = max(len(o) for o in self.out)
        rows = [o + [self.pad_id] * (width - len(o)) for o in self.out]
        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), width)

    def committed_lengths(self) -> list[int]:
        return [len(o) for o in self.out]

    def stats(self) -> dict[str, float]:
        return {"acceptance_rate": self.num_kept / self.num_proposed if self.num_proposed else 0.0,
                "tokens_per_target_pass": sum(len(o) for o in self.out) / max(1, self.nfe) / len(self.out),
                "draft_passes": self.num_draft_passes}
