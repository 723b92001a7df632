"""Sparse Mixture-of-Experts feed-forward (Shazeer et al. 2017, arXiv:1701.06538): a router picks k
of E experts per token; the token's output is the sum of their SwiGLU outputs weighted by the
router, plus the shared experts every token runs (DeepSeekMoE, arXiv:2401.06066).

Owns the routing strategies, the stacked expert weights and the dispatch. It does not decide which
layers are sparse (the model config does) nor how a checkpoint names the experts (models/).

Routing strategies, one each (`ROUTERS`), all in float32 as the references compute them:
- `softmax`: probabilities over all experts, the k largest, renormalised to sum to one or not
  (LLaDA-MoE: not, and an expert bias, when the checkpoint has one, is added to the probabilities
  and so to the weights too; Qwen3-MoE / SDAR-MoE: renormalised).
- `sigmoid_grouped` (LLaDA2, DeepSeek-V3's auxiliary-loss-free balancing, arXiv:2408.15664):
  sigmoid scores; an expert bias added for *choosing* only; experts in `n_group` groups ranked by
  the sum of their two best biased scores, the best `topk_group` groups kept; the k best biased
  scores among those; weights are the unbiased scores renormalised (when k > 1), times
  `routed_scaling_factor`.

Dispatch: the (token, expert) pairs are sorted by expert and every expert that some token chose
runs one matmul over all of its tokens (on a GPU `torch._grouped_mm`, one launch; on a CPU a loop
over the active experts through kstep/layers/linear.py, measured faster there), so a packed pass of
many requests reads each chosen expert's weights once.
Expert outputs are weighted and summed in float32 (as the references combine), then cast back.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers.labels import labelled
from kstep.layers.linear import linear, wants_in_out
from kstep.layers.mlp import SwiGLU

ROUTERS = ("softmax", "sigmoid_grouped")
HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


@dataclass(slots=True)
class Routing:
    """Each token's chosen experts and their combine weights."""
    expert_ids: torch.Tensor   # (N, k) long
    weights: torch.Tensor      # (N, k) float32


@dataclass(slots=True, frozen=True)
class RouterSpec:
    kind: str                            # one of ROUTERS
    top_k: int
    renormalize: bool = True             # softmax: weights renormalised over the chosen k
    n_group: int = 1                     # sigmoid_grouped: expert groups, and how many are kept
    topk_group: int = 1
    scaling: float = 1.0                 # routed_scaling_factor
    has_bias: bool = False               # an expert bias (expert_bias) in the checkpoint

    def __post_init__(self):
        if self.kind not in ROUTERS:
            raise ValueError(f"router {self.kind!r} is not one of {', '.join(ROUTERS)}")


def softmax_topk(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> Routing:
    """logits (N, E) float32 -> the k most probable experts (LLaDA-MoE's bias, if any, shifts the
    probabilities it chooses and combines with)."""
    probs = logits.softmax(-1)
    if bias is not None:
        probs = probs + bias
    weights, ids = probs.topk(spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return Routing(ids, weights * spec.scaling if spec.scaling != 1.0 else weights)


def sigmoid_grouped_topk(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> Routing:
    """logits (N, E) float32 -> LLaDA2's group-limited choice on biased scores, unbiased weights."""
    N, E = logits.shape
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if spec.n_group > 1:
        groups = choice.view(N, spec.n_group, E // spec.n_group)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)  # (N, n_group)
        kept = group_scores.topk(spec.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // spec.n_group, dim=1), float("-inf"))
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return Routing(ids, weights * spec.scaling)


STRATEGIES = {"softmax": softmax_topk, "sigmoid_grouped": sigmoid_grouped_topk}


class Router(nn.Module):
    """The gate (a linear map to one logit per expert), an optional expert bias, and a strategy."""
    keeps_float32 = ("bias",)  # whatever the model dtype: a bf16 bias would round the choice

    def __init__(self, d_model: int, num_experts: int, spec: RouterSpec, logits_in_float32: bool = True):
        super().__init__()
        if spec.kind == "sigmoid_grouped" and (num_experts % spec.n_group or num_experts // spec.n_group < 2):
            raise ValueError(f"num_experts ({num_experts}) must split into n_group ({spec.n_group}) groups of "
                             "at least 2 experts")
        if spec.kind == "sigmoid_grouped" and spec.topk_group * (num_experts // spec.n_group) < spec.top_k:
            raise ValueError(f"topk_group ({spec.topk_group}) groups hold fewer than top_k ({spec.top_k}) experts")
        if not 1 <= spec.top_k <= num_experts:
            raise ValueError(f"top_k ({spec.top_k}) must be between 1 and num_experts ({num_experts})")
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32)) if spec.has_bias else None
        self.logits_in_float32 = logits_in_float32  # LLaDA2: F.linear in float32; LLaDA-MoE: in the model dtype

    def forward(self, x: torch.Tensor) -> Routing:
        """x (N, D) -> each token's experts and weights."""
        if self.logits_in_float32:
            logits = F.linear(x.float(), self.weight.float())  # (N, E)
        else:
            logits = F.linear(x, self.weight).float()
        bias = None if self.bias is None else self.bias.float()
        return STRATEGIES[self.spec.kind](logits, self.spec, bias)


class Experts(nn.Module):
    """E gated experts (SwiGLU unless `activation` says otherwise: DiffusionGemma's are GeGLU) with
    stacked weights, as parameters gate_up (E, D, 2I) = [gate | up] and down (E, I, D); for
    inference (`fuse`) held (out, in) in memory, as the kernels want them."""

    def __init__(self, num_experts: int, d_model: int, expert_dim: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.num_experts, self.expert_dim, self.activation = num_experts, expert_dim, activation
        self.first: int | None = None  # expert parallel: the global id of this rank's first expert, ...
        self.rank_load: torch.Tensor | None = None  # ... and per rank, the (token, expert) pairs its experts got
        self.gate_up = nn.Parameter(torch.empty(num_experts, d_model, 2 * expert_dim))
        self.down = nn.Parameter(torch.empty(num_experts, expert_dim, d_model))

    def fuse(self) -> None:
        """For inference: each expert's weights stored as kstep/layers/linear.py's kernel for their
        size wants them ((out, in), or (in, out) when small and float32); the parameters' shapes stay."""
        for name in ("gate_up", "down"):
            param = getattr(self, name)
            logical = param.data.transpose(1, 2)  # (E, out, in)
            if wants_in_out(logical[0]):
                param.data = param.data.contiguous()  # (in, out) in memory
            else:
                param.data = logical.contiguous().transpose(1, 2)  # (out, in) in memory

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x (N, D) -> (N, D): each token's routed outputs, weighted and summed in float32."""
        N, k = routing.expert_ids.shape
        flat, weights = routing.expert_ids.reshape(-1), routing.weights.reshape(-1)  # (N*k,)
        pairs = None
        if self.first is not None:  # expert parallel: this rank's experts' pairs only (the others run theirs)
            counts = torch.bincount(flat // self.num_experts, minlength=self.rank_load.shape[0])
            self.rank_load = self.rank_load.to(counts.device) + counts  # (not a buffer: never in a checkpoint)
            flat = flat - self.first
            pairs = ((flat >= 0) & (flat < self.num_experts)).nonzero().squeeze(1)  # (M,)
            flat, weights = flat[pairs], weights[pairs]
        order = flat.argsort(stable=True)
        tokens = (order if pairs is None else pairs[order]) // k  # the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)
        hidden = self._swiglu(x[tokens], counts)  # (M, D) in expert order
        weighted = hidden.float() * weights[order, None]
        out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tokens, weighted)
        return out if self.first is not None else out.to(x.dtype)  # a rank's share: summed over ranks in float32

    def _can_group(self, rows: torch.Tensor) -> bool:
        """torch's grouped matmul (a GPU's path: one launch for every expert) wants matching dtypes
        and rows of whole 16-byte units; on a CPU the loop over linear() measured faster."""
        size = rows.element_size()
        return HAS_GROUPED_MM and rows.is_cuda and rows.dtype == self.gate_up.dtype and \
            all(width * size % 16 == 0 for width in (rows.shape[1], self.expert_dim))

    def _swiglu(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, D) sorted by expert, counts (E,) rows per expert -> (M, D)."""
        if rows.shape[0] == 0:  # expert parallel: no token chose this rank's experts
            return rows
        if self._can_group(rows):
            ends = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(rows, self.gate_up, offs=ends).chunk(2, dim=-1)
            return torch._grouped_mm(self.activation(gate) * up, self.down, offs=ends)
        gate_up, down = self.gate_up.transpose(1, 2), self.down.transpose(1, 2)  # (E, 2I, D), (E, D, I): (out, in)
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts.tolist()):  # one sync per layer: which experts run
            if count:
                gate, up = linear(rows[start:start + count], gate_up[expert]).chunk(2, dim=-1)
                out[start:start + count] = linear(self.activation(gate) * up, down[expert])
                start += count
        return out


class SparseMoE(nn.Module):
    """Router + routed experts (+ shared experts, a SwiGLU every token runs, added after routing).
    `last_routing` keeps the latest pass's choices when `keep_routing` is set (tests, benchmarks)."""

    def __init__(self, d_model: int, num_experts: int, expert_dim: int, spec: RouterSpec,
                 shared_dim: int = 0, logits_in_float32: bool = True):
        super().__init__()
        self.router = Router(d_model, num_experts, spec, logits_in_float32)
        self.experts = Experts(num_experts, d_model, expert_dim)
        self.shared = SwiGLU(d_model, shared_dim, bias=False) if shared_dim else None
        self.keep_routing = False
        self.last_routing: Routing | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # expert parallel: sum the ranks' shares

    def fuse(self) -> None:
        self.experts.fuse()
        if self.shared is not None:
            self.shared.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> (..., D)."""
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        with labelled("kstep.moe"):
            routing = self.router(flat)
            if self.keep_routing:
                self.last_routing = routing
            out = self.experts(flat, routing)
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.reduce is not None:  # routed (float32) and shared partial outputs: one all-reduce, then the cast
            out = self.reduce(out).to(x.dtype)
        return out.view_as(x)
