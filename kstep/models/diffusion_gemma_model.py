"""The DiffusionGemma network (transformers 5.24 `DiffusionGemmaForBlockDiffusion`, text path), inference
only: one layer stack run per pass in the encoder mode (causal, writes the KV cache: the prompt's
prefill, the commit of a finished canvas) or the decoder mode (bidirectional over [cached prefix;
canvas], never changes the prefix). A packed pass may mix both: each sequence is a `Segment` with its
own mode, so the engine runs one request's commit with another's denoising pass.

Owns the embedding (scaled by sqrt(d_model) in the weight dtype), the decoder's input (the canvas
embedding plus the self-conditioning MLP of the previous pass's soft embedding, rms-normed without a
weight), the rotary tables of each layer kind (sliding: every frequency; full: "proportional", the
first fraction of the frequencies of the full head dim, the rest not rotating), the tied head with
its float32 tanh soft-cap, and the soft embedding itself, softmax(logits) @ E * sqrt(d_model): the
[canvas, d_model] signal a request keeps between passes instead of [canvas, vocab] logits.
The runner owns the caches; the decoder (decoding/uniform_diffusion.py) decides what runs.
Tensor parallel (`tp` set by kstep/distributed/sharding_gemma.py): the embedding holds this rank's
vocabulary rows, the head's logits are gathered to rank 0, and the soft embedding is computed from
each rank's slice of the probabilities (`soft_embedding_share`, driven by the tensor-parallel runner).
"""
import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers.attention import KVCache, Segment
from kstep.layers.labels import labelled
from kstep.layers.mlp import SwiGLU
from kstep.models.diffusion_gemma import DiffusionGemmaConfig
from kstep.models.diffusion_gemma_layers import (ACTIVATIONS, DECODER, ENCODER, FULL, SLIDING, Layer, Norm, key_views,
                                                 rms)
from kstep.models.transformer import embedding, vocab_parallel_embed


def inv_freq(head_dim: int, theta: float, fraction: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """(head_dim / 2,) float32: theta^(-2k / head_dim) for the first int(fraction * head_dim / 2)
    frequencies, 0 after them (cos 1, sin 0: those dimensions pass through)."""
    rotated = int(fraction * head_dim // 2)
    freqs = 1.0 / (theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64, device=device).float() / head_dim))
    return torch.cat([freqs, torch.zeros(head_dim // 2 - rotated, device=device)])


class DiffusionGemma(nn.Module):
    always_writes_kv = True  # its attention writes the cache in every pass (models/network.py)

    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.cfg = cfg
        moe = cfg.moe
        self.embed = embedding(cfg.vocab_size, cfg.d_model)
        self.sc_norm = Norm(cfg.d_model, cfg.norm_eps)
        self.sc_mlp = SwiGLU(cfg.d_model, cfg.ffn_dim, bias=False, activation=ACTIVATIONS[cfg.activation])
        self.layers = nn.ModuleList(
            Layer(cfg.d_model, cfg.n_heads, kv, hd, kind == SLIDING, cfg.ffn_dim, moe.num_experts, moe.top_k,
                  moe.expert_dim, cfg.activation, cfg.norm_eps)
            for kind, hd, kv in zip(cfg.layer_types, cfg.layer_head_dims, cfg.layer_kv_heads))
        self.norm = Norm(cfg.d_model, cfg.norm_eps)
        self.reset_rotary(self.embed.weight.device)
        # Tensor parallel (kstep/distributed/sharding_gemma.py): the group, and the first vocabulary row here.
        self.tp, self.vocab_start = None, 0

    def reset_rotary(self, device: torch.device | str) -> None:
        """(Re)build the float32 inverse frequencies of each layer kind on `device`."""
        self.inv_freqs: dict[str, torch.Tensor] = {}
        for kind, theta, fraction in zip((SLIDING, FULL), self.cfg.rope_thetas, self.cfg.rotary_fractions):
            dims = {hd for k, hd in zip(self.cfg.layer_types, self.cfg.layer_head_dims) if k == kind}
            if len(dims) > 1:
                raise ValueError(f"{kind} layers of different head dims ({sorted(dims)}) are not supported")
            if dims:
                self.inv_freqs[kind] = inv_freq(dims.pop(), theta, fraction, device)

    def fuse_projections(self) -> None:
        """Inference only: the gated MLPs' gate and up as one matmul (layers/mlp.py), the experts in
        the memory layout of the dtype (layers/moe.py)."""
        self.sc_mlp.fuse()
        for layer in self.layers:
            layer.mlp.fuse()
            layer.experts.fuse()

    def kv_geometry(self) -> list[tuple[int, int]]:
        """Per layer, its own (key/value heads, head dim) (tensor parallel: this rank's heads); every slot
        is kept (a sliding layer reads only the window of it)."""
        return [(layer.attn.n_kv_heads, hd) for layer, hd in zip(self.layers, self.cfg.layer_head_dims)]

    def allocate_kv(self, batch: int, length: int) -> KVCache:
        """A cache of its own, for the model called alone (the reference's checks); a runner's decoders
        take theirs from its KV pool (runner/kv_pool.py)."""
        w = self.embed.weight
        return KVCache.of_its_own(self.kv_geometry(), batch, length, w.device, w.dtype)

    def _embed_scale(self) -> float:
        """sqrt(d_model) rounded to the weight dtype first, as the reference's (53.0, not 53.07, in bf16)."""
        return float(torch.tensor(self.cfg.d_model ** 0.5).to(self.embed.weight.dtype))

    def soft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) processed logits -> (..., V) probabilities in the model dtype, from the logits
        rounded to it (as the reference stores them between passes)."""
        dtype = self.embed.weight.dtype
        return F.softmax(logits.to(dtype), dim=-1, dtype=torch.float32).to(dtype)

    def soft_embedding(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) processed logits -> (..., D): the next pass's self-conditioning signal."""
        return self.embed_probs(self.soft_probs(logits))

    def embed_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """(..., V) soft_probs -> (..., D): their embedding, scaled."""
        return (probs @ self.embed.weight) * self._embed_scale()

    def soft_embedding_share(self, probs: torch.Tensor) -> torch.Tensor:
        """Tensor parallel: (..., rows) this rank's vocabulary slice of soft_probs -> (..., D), the
        slice times this rank's embedding rows summed over the ranks (vLLM PR #46177: the embedding
        is never gathered), scaled."""
        return self.tp.all_reduce(probs @ self.embed.weight) * self._embed_scale()

    def _inputs(self, ids: torch.Tensor, segments: list[Segment], modes: list[str],
                soft_embeds: list[torch.Tensor | None]) -> torch.Tensor:
        """(N, D) layer-0 input: the scaled embedding (encoder), or the canvas's self-conditioned one (decoder)."""
        x = self.embed(ids) if self.tp is None else vocab_parallel_embed(self.embed, ids, self.vocab_start, self.tp)
        x = x * self._embed_scale()  # (N, D)
        if DECODER not in modes:
            return x
        parts = []
        for seg, mode, soft in zip(segments, modes, soft_embeds):
            part = x[seg.rows]
            if mode == DECODER:
                if soft is not None:  # the first pass of a canvas has none: the MLP of 0 is 0
                    soft = soft.reshape(-1, soft.shape[-1])
                    part = part + self.sc_mlp(rms(soft, self.sc_norm.weight, self.cfg.norm_eps))
                part = rms(part, None, self.cfg.norm_eps)
            parts.append(part)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def packed_hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                             modes: list[str] | None = None,
                             soft_embeds: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Final-norm hidden states (N, D) for packed tokens input_ids (N,) at positions (N,); each
        segment runs in its mode (default: encoder) with its soft embedding (decoder, (b, T, D) or None)."""
        modes = modes or [ENCODER] * len(segments)
        soft_embeds = soft_embeds or [None] * len(segments)
        device = input_ids.device
        x = self._inputs(input_ids, segments, modes, soft_embeds)
        token_modes = torch.cat([torch.full((s.batch * s.length,), int(m == DECODER), device=device)
                                 for s, m in zip(segments, modes)])  # (N,)
        tables = {}
        for kind, freqs in self.inv_freqs.items():
            angles = positions.float()[:, None] * freqs  # (N, hd / 2)
            angles = torch.cat([angles, angles], dim=-1)
            tables[kind] = (angles.cos(), angles.sin())
        views = [key_views(s, m, self.cfg.sliding_window, device) for s, m in zip(segments, modes)]
        for i, (layer, kind) in enumerate(zip(self.layers, self.cfg.layer_types)):
            cos, sin = tables[kind]
            x = layer(x, cos, sin, segments, [v[kind] for v in views], i, token_modes)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Tied head on (..., D) -> (..., V) float32, soft-capped: tanh(logits / cap) * cap. Tensor
        parallel: every rank's vocabulary slice gathered on rank 0 (the decoder samples over the whole
        vocabulary there), the padding cut, then capped; the other ranks get None."""
        if self.tp is not None and hidden.numel() == 0:  # an encoder pass wants no logits: no gather (all ranks know)
            return hidden.new_empty(*hidden.shape[:-1], self.cfg.vocab_size, dtype=torch.float32) \
                if self.tp.rank == 0 else None
        with labelled("kstep.lm_head"):
            out = F.linear(hidden, self.embed.weight)  # (..., V), tensor parallel: (..., rows)
            if self.tp is not None:
                out = self.tp.gather_last_dim(out)
                if out is None:
                    return None
                out = out[..., :self.cfg.vocab_size]
            out = out.float()
        cap = self.cfg.softcap
        if cap is None:
            return out
        if out.requires_grad:  # (training: autograd keeps what the in-place ops would overwrite)
            return torch.tanh(out / cap) * cap
        return out.div_(cap).tanh_().mul_(cap)  # in place, the same bits: no canvas-sized copies (268 MB a row)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: KVCache | None = None,
                      cache_start: int = 0, mode: str = ENCODER, soft: torch.Tensor | None = None,
                      key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) for one batch input_ids (B, T) at positions (B, T), its tokens at cache slots
        [cache_start, cache_start + T) (a fresh cache when none is given); key_mask (B, S) marks real slots."""
        B, T = input_ids.shape
        caches = caches if caches is not None else self.allocate_kv(B, cache_start + T)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        segment = Segment(0, B, T, mask, caches, cache_start)
        return self.packed_hidden_states(input_ids.reshape(-1), positions.reshape(-1), [segment], [mode],
                                         [soft]).view(B, T, -1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask=None, caches: KVCache | None = None,
                cache_start: int = 0) -> torch.Tensor:
        """Logits of an encoder-mode (causal) pass: what the time-budget calibration times."""
        return self.logits(self.hidden_states(input_ids, positions, caches, cache_start))
