"""The decoder-only transformer every family is built from (inference only).

Owns the layer stack and the LM head. It does not own caches (the runner allocates them) or decide
what is attended to (the caller passes positions and a mask): that is how one set of weights code
serves both causal AR models and bidirectional diffusion models.
"""
import torch
from torch import nn

from kstep.layers import cpu_decode
from kstep.layers.attention import Attention, KVCache, Segment
from kstep.layers.labels import labelled
from kstep.layers.linear import linear
from kstep.layers.mlp import SwiGLU
from kstep.layers.moe import RouterSpec, SparseMoE
from kstep.layers.norm import RMSNorm, add_rms_norm
from kstep.layers.rotary import RotaryEmbedding
from kstep.models.config import ModelConfig


def feed_forward(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """A layer's feed-forward: dense SwiGLU, or the sparse MoE block where the config says so."""
    moe = cfg.moe
    if moe is None or not moe.is_sparse(layer_idx):
        return SwiGLU(cfg.d_model, cfg.ffn_dim, cfg.mlp_bias)
    spec = RouterSpec(moe.router, moe.top_k, moe.renormalize, moe.n_group, moe.topk_group, moe.scaling, moe.has_bias)
    return SparseMoE(cfg.d_model, moe.num_experts, moe.expert_dim, spec, moe.shared_dim, moe.logits_in_float32)


def vocab_parallel_embed(embed: nn.Embedding, ids: torch.Tensor, vocab_start: int, tp) -> torch.Tensor:
    """ids (N,) -> (N, D): this rank's rows of the embedding (from `vocab_start`) for the ids it
    holds, zeros elsewhere, summed over the ranks of `tp` (exact: one rank adds each row, the rest 0)."""
    local = ids - vocab_start
    rows = embed.weight.shape[0]
    mine = ((local >= 0) & (local < rows))[:, None]  # (N, 1)
    return tp.all_reduce(embed(local.clamp(0, rows - 1)) * mine.to(embed.weight.dtype))


def embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its normal_ init when built on the meta device (weights.build_model,
    which loads the weights next): that init on meta imports torch._dynamo, 1.3 s of `kstep
    generate`'s start-up. Elsewhere unchanged, so seeded random checkpoints keep their weights."""
    if torch.empty(0).is_meta:
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.qkv_bias, cfg.out_bias,
                              cfg.norm_eps if cfg.qk_norm else None)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = feed_forward(cfg, layer_idx)

    def forward(self, x, cos, sin, segments, layer_idx, is_causal, q_scale=None):
        if not x.is_cuda:  # one token on a CPU: the whole block in one C call, where it can
            layer = cpu_decode.plan(self, x, segments, layer_idx, q_scale)
            if layer is not None:
                return cpu_decode.forward(layer, x, cos, sin, segments[0], layer_idx)
        x, h = add_rms_norm(x, self.attn(self.attn_norm(x), cos, sin, segments, layer_idx, is_causal, q_scale),
                            self.mlp_norm)
        return x + self.mlp(h)


class Transformer(nn.Module):
    always_writes_kv = False  # a plain pass runs without a cache (models/network.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = embedding(cfg.embedding_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.embedding_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rotary_width, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Tensor parallel (kstep/distributed/sharding.py): the group, and the first vocabulary row here.
        self.tp, self.vocab_start = None, 0

    def reset_rotary(self, device: torch.device | str) -> None:
        """(Re)build the float32 rotary tables on `device` (after meta init or a dtype cast)."""
        self.rotary = RotaryEmbedding(self.cfg.rotary_width, self.cfg.max_positions, self.cfg.rope_theta,
                                      self.cfg.rope_scaling).to(device)

    def fuse_projections(self) -> None:
        """Inference only: fused q/k/v and gate/up matmuls (the parameters stay as they are; see
        fuse_linears); experts in their inference layout."""
        for layer in self.layers:
            layer.attn.fuse()
            layer.mlp.fuse()

    def kv_geometry(self) -> list[tuple[int, int]]:
        """Per layer, its cache's (key/value heads, head dim) (tensor parallel: this rank's heads)."""
        return [(layer.attn.n_kv_heads, self.cfg.head_dim) for layer in self.layers]

    def allocate_kv(self, batch: int, length: int) -> KVCache:
        """A cache of its own, for the model called alone (training, the references' checks); a runner's
        decoders take theirs from its KV pool (runner/kv_pool.py)."""
        w = self.embed.weight
        return KVCache.of_its_own(self.kv_geometry(), batch, length, w.device, w.dtype)

    def packed_hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                             segments: list[Segment]) -> torch.Tensor:
        """Final-norm hidden states (N, D) for the packed tokens input_ids (N,) at positions (N,);
        `segments` say which tokens form which sequence (each attends only within itself)."""
        x = self.embed(input_ids) if self.tp is None else \
            vocab_parallel_embed(self.embed, input_ids, self.vocab_start, self.tp)  # (N, D)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        cos, sin = self.rotary.tables(positions)  # (N, hd) each
        q_scale = self.rotary.query_scales(positions)  # (N,) or None
        stack = None if x.is_cuda else cpu_decode.plan_stack(self.layers, x, segments, q_scale)
        if stack is not None:  # one token on a CPU: every block in one C call
            return self.norm(cpu_decode.forward_stack(stack, x, cos, sin, segments[0]))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, segments, i, self.cfg.is_causal, q_scale)
        return self.norm(x)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                      caches: KVCache | None = None, cache_start: int = 0, cache_len: int | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, D) for one batch input_ids (B, T) at positions (B, T)."""
        B, T = input_ids.shape
        segment = Segment(0, B, T, mask, caches, cache_start, cache_len)
        return self.packed_hidden_states(input_ids.reshape(-1), positions.reshape(-1), [segment]).view(B, T, -1)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on (..., D) -> this rank's vocabulary columns: all of them (padding cut) on one
        device; tensor parallel, its slice of the padded vocabulary (`vocab_columns` says which ids,
        and how many of them are real)."""
        with labelled("kstep.lm_head"):
            weight = self.embed.weight if self.lm_head is None else getattr(self.lm_head, "weight", None)
            if self.tp is not None:
                out = linear(hidden, weight)
            elif self.lm_head is None or isinstance(self.lm_head, nn.Linear):
                out = linear(hidden, weight[: self.cfg.vocab_size])
            else:  # a quantized head computes the padded rows too
                out = self.lm_head(hidden)[..., : self.cfg.vocab_size]
        return out if self.cfg.logits_scale == 1.0 else out * self.cfg.logits_scale

    def vocab_columns(self) -> tuple[int, int]:
        """(first id, number of real ids) of this rank's `local_logits` columns."""
        if self.tp is None:
            return 0, self.cfg.vocab_size
        return self.vocab_start, max(0, min(self.embed.weight.shape[0], self.cfg.vocab_size - self.vocab_start))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """LM head on (..., D) hidden states -> (..., vocab_size); padded embedding rows are dropped.
        Tensor parallel: every rank's vocabulary slice, gathered on rank 0 (the others get None)."""
        out = self.local_logits(hidden)
        if self.tp is None:
            return out
        out = self.tp.gather_last_dim(out)  # the vocabulary is cut after the gather
        return None if out is None else out[..., : self.cfg.vocab_size]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
                caches: list | None = None, cache_start: int = 0) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, positions, mask, caches, cache_start))
