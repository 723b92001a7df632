"""How DiffusionGemma (kstep/models/diffusion_gemma_model.py) is split over a tensor-parallel group:
sharding.py's scheme, per layer where its layers differ.

- Attention: query heads split; each layer's key/value heads split, or replicated when it has fewer
  than the ranks (the full layers' one head at N = 2: each rank keeps the one its query heads use;
  their values are the raw keys, so k_proj alone is read); q_norm/k_norm replicated; o_proj
  row-parallel, its all-reduce before post_attn_norm (the norm of a partial sum is not the sum of norms).
- The layer's dense MLP and the self-conditioning MLP (`sc_mlp`): gate/up column-parallel, down
  row-parallel, one all-reduce each (the layer's before post_mlp_norm).
- The MoE: whole experts per rank (E / N, contiguous), the router replicated, tokens replicated; the
  ranks' float32 shares summed by one all-reduce before post_moe_norm. So three all-reduces a layer.
- The tied embedding: vocabulary-parallel (padded to a multiple of N): the lookup one all-reduce, the
  head's logits one gather to rank 0, where the decoder samples over the whole vocabulary; the
  self-conditioning signal from each rank's vocabulary slice (runner.py, `soft_embedding`).
- Norms, layer scalars, the router, rotary: replicated. No biases (config.json's attention_bias is refused).

The model is built on meta, `shard_model` gives each sharded parameter its local shape, and
`shard_names` narrows checkpoint_names (kstep/models/diffusion_gemma.py) to this rank's slices: the
experts' stacked (E, out, in) tensors are read by rows of their first dim."""
from dataclasses import dataclass, replace

from torch import nn

from kstep.distributed.sharding import kv_span, narrow_rows, resize_linear, shard_experts, shard_mlp, split, \
    vocab_part
from kstep.models.parts import Part, parts_of

COLUMN = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "sc_mlp.gate_proj",
          "sc_mlp.up_proj")
ROW = ("attn.o_proj", "mlp.down_proj", "sc_mlp.down_proj")


@dataclass(frozen=True, slots=True)
class GemmaShard:
    """One rank's share of a DiffusionGemma: its rank of `size`, and the ranges it holds."""
    rank: int
    size: int
    heads: tuple[int, int]                     # query heads [start, end), every layer
    kv_heads: tuple[tuple[int, int], ...]      # each layer's key/value heads
    head_dims: tuple[int, ...]                 # each layer's head dim
    ffn: tuple[int, int]                       # hidden units of the dense MLPs and sc_mlp
    experts: tuple[int, int]                   # routed experts
    vocab: tuple[int, int]                     # embedding rows (of the padded vocabulary)

    def span(self, layer: int | None, module: str) -> tuple[int, int]:
        """[start, end) of the module's split dimension, in rows (column-parallel) or columns (row-parallel)."""
        if module.startswith("attn."):
            heads = self.kv_heads[layer] if module in ("attn.k_proj", "attn.v_proj") else self.heads
            return heads[0] * self.head_dims[layer], heads[1] * self.head_dims[layer]
        return self.ffn


def plan_shard(cfg, rank: int, size: int) -> GemmaShard:
    """This rank's share of a DiffusionGemma of config `cfg` (a ValueError naming the numbers when
    `size` does not divide the heads, a layer's key/value heads (nor they it), the experts or the MLPs)."""
    heads = split(cfg.n_heads, size, rank, "the model", "attention heads")
    kv = tuple(kv_span(cfg.n_heads, n, heads, size, rank, f"layer {i}'s") for i, n in enumerate(cfg.layer_kv_heads))
    ffn = split(cfg.ffn_dim, size, rank, "the MLP", "hidden units")
    experts = split(cfg.moe.num_experts, size, rank, "the MoE layers", "experts")
    rows = -(-cfg.embedding_size // size)  # the vocabulary padded to a multiple of the ranks
    return GemmaShard(rank, size, heads, kv, tuple(cfg.layer_head_dims), ffn, experts,
                      (rank * rows, (rank + 1) * rows))


def shard_model(model: nn.Module, shard: GemmaShard, group) -> None:
    """Give a meta-built DiffusionGemma its local shapes and the group's collectives (module note)."""
    rows, heads, hidden = shard.vocab[1] - shard.vocab[0], shard.heads[1] - shard.heads[0], shard.ffn[1] - shard.ffn[0]
    weight = model.embed.weight
    model.embed.weight = nn.Parameter(weight.new_empty(rows, weight.shape[1]), requires_grad=False)
    model.tp, model.vocab_start = group, shard.vocab[0]
    shard_mlp(model.sc_mlp, hidden)
    model.sc_mlp.reduce = group.all_reduce
    for layer, (k0, k1), hd in zip(model.layers, shard.kv_heads, shard.head_dims):
        attn = layer.attn
        resize_linear(attn.q_proj, out_features=heads * hd)
        resize_linear(attn.k_proj, out_features=(k1 - k0) * hd)
        if attn.v_proj is not None:  # full layers have none: their values are the keys
            resize_linear(attn.v_proj, out_features=(k1 - k0) * hd)
        resize_linear(attn.o_proj, in_features=heads * hd)
        attn.n_heads, attn.n_kv_heads, attn.reduce = heads, k1 - k0, group.all_reduce
        shard_mlp(layer.mlp, hidden)
        layer.mlp.reduce = group.all_reduce
        shard_experts(layer.experts, shard)
        layer.reduce = group.all_reduce


def shard_names(names: dict, shard: GemmaShard, cfg) -> tuple[dict[str, list[Part]], set[str]]:
    """checkpoint_names narrowed to this rank's slices; and the parameters left zero (the embedding
    of a rank whose rows are all padding)."""
    out, zeros = {}, set()
    for ours, parts in parts_of(names).items():
        path = ours.split(".")
        layer = int(path[1]) if path[0] == "layers" else None
        local = ".".join(path[2:-1] if layer is not None else path[:-1])  # the module within its layer
        if local in COLUMN:
            start, end = shard.span(layer, local)
            out[ours] = [narrow_rows(p, start, end) for p in parts]
        elif local in ROW:
            start, end = shard.span(layer, local)
            out[ours] = [replace(p, cols=(start, end)) for p in parts]
        elif local == "experts":  # stored (E, out, in): this rank's experts are rows of the first dim
            out[ours] = [narrow_rows(p, *shard.experts) for p in parts]
        elif ours == "embed.weight":
            if (part := vocab_part(parts[0], shard.vocab, cfg.embedding_size)) is None:
                zeros.add(ours)
                continue
            out[ours] = [part]
        else:
            out[ours] = parts
    return out, zeros
