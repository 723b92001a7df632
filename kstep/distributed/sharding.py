"""How a model is split over the ranks of a tensor-parallel group (Megatron-LM's scheme, nano-vllm's
shape), and which slice of each checkpoint tensor a rank reads.

- Attention: query heads split evenly (column-parallel q; the output projection row-parallel, one
  all-reduce); key/value heads split too, or replicated when there are fewer of them than ranks
  (each rank keeps the one its query heads use: LLaDA2's 4 KV heads at TP 8).
- Dense MLP: gate/up column-parallel, down row-parallel (one all-reduce).
- MoE (expert parallel, dInfer's pattern): whole experts placed on ranks (E / N each, contiguous),
  tokens replicated, the router replicated; shared experts split as a dense MLP; routed and shared
  partial outputs summed by one all-reduce per MoE layer.
- Embedding and LM head: vocabulary-parallel (rows split, the vocabulary padded to a multiple of N;
  an embedding lookup is one all-reduce, the head's logits one gather to rank 0).
- Norms, rotary, the router: replicated.
Row-parallel biases are added once (rank 0 holds them, the others zeros).

The model is built as always (on meta), then `shard_model` gives each sharded parameter its local
shape before memory is allocated, and `shard_names` turns the family's name map into the slices
this rank reads, so a rank never holds more than its share plus one tensor. DiffusionGemma, whose
layers differ, has its own plan on these helpers (sharding_gemma.py)."""
from dataclasses import dataclass, replace

import torch
from torch import nn

from kstep.models.parts import Part, parts_of

COLUMN = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.shared.gate_proj",
          "mlp.shared.up_proj")
ROW = ("attn.o_proj", "mlp.down_proj", "mlp.shared.down_proj")


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's share of a model: its rank of `size`, and the ranges it holds."""
    rank: int
    size: int
    heads: tuple[int, int]           # query heads [start, end)
    kv_heads: tuple[int, int]        # key/value heads
    ffn: tuple[int, int]             # dense MLP hidden units
    shared: tuple[int, int]          # shared-expert hidden units
    experts: tuple[int, int]         # routed experts
    vocab: tuple[int, int]           # embedding / head rows (of the padded vocabulary)
    head_dim: int

    def span(self, module: str) -> tuple[int, int, int]:
        """(start, end, unit) of the module's split dimension, in rows or columns of its weight."""
        if module.startswith("attn.") and module != "attn.o_proj":
            heads = self.heads if module == "attn.q_proj" else self.kv_heads
            return heads[0], heads[1], self.head_dim
        if module == "attn.o_proj":
            return self.heads[0], self.heads[1], self.head_dim
        return (*(self.shared if ".shared." in module else self.ffn), 1)


def split(total: int, size: int, rank: int, what: str, unit: str) -> tuple[int, int]:
    if total % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the {total} {unit} of {what}")
    share = total // size
    return rank * share, (rank + 1) * share


def kv_span(n_heads: int, n_kv_heads: int, heads: tuple[int, int], size: int, rank: int,
            what: str = "the model's") -> tuple[int, int]:
    """The key/value heads of the rank holding query `heads`: split, or replicated when fewer than
    the ranks (the one this rank's query heads share); a ValueError when neither divides the other."""
    if n_kv_heads % size == 0:
        return split(n_kv_heads, size, rank, "the model", "key/value heads")
    if size % n_kv_heads == 0:
        group = n_heads // n_kv_heads
        return heads[0] // group, heads[0] // group + 1
    raise ValueError(f"tensor_parallel_size {size} and {what} {n_kv_heads} key/value heads: one must divide the other")


def plan_shard(cfg, rank: int, size: int) -> Shard:
    """This rank's share of a model of config `cfg` (raises ValueError naming the numbers)."""
    heads = split(cfg.n_heads, size, rank, "the model", "attention heads")
    kv = kv_span(cfg.n_heads, cfg.n_kv_heads, heads, size, rank)
    moe = cfg.moe
    dense = any(moe is None or not moe.is_sparse(i) for i in range(cfg.n_layers))
    ffn = split(cfg.ffn_dim, size, rank, "the MLP", "hidden units") if dense else (0, 0)
    experts = split(moe.num_experts, size, rank, "the MoE layers", "experts") if moe else (0, 0)
    shared = split(moe.shared_dim, size, rank, "the shared experts", "hidden units") if moe and moe.shared_dim \
        else (0, 0)
    rows = -(-cfg.embedding_size // size)  # the vocabulary padded to a multiple of the ranks
    return Shard(rank, size, heads, kv, ffn, shared, experts, (rank * rows, (rank + 1) * rows), cfg.head_dim)


def resize_linear(module: nn.Linear, out_features: int | None = None, in_features: int | None = None) -> None:
    """Give a (meta) nn.Linear its local shape."""
    out_features, in_features = out_features or module.out_features, in_features or module.in_features
    dtype = module.weight.dtype
    module.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta", dtype=dtype),
                                 requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(torch.empty(out_features, device="meta", dtype=dtype), requires_grad=False)
    module.out_features, module.in_features = out_features, in_features


def shard_model(model: nn.Module, shard: Shard, group) -> None:
    """Give a meta-built Transformer its local shapes and the group's collectives (module note)."""
    cfg, hd = model.cfg, model.cfg.head_dim
    heads, kv = shard.heads[1] - shard.heads[0], shard.kv_heads[1] - shard.kv_heads[0]
    rows = shard.vocab[1] - shard.vocab[0]
    model.embed.weight = nn.Parameter(torch.empty(rows, cfg.d_model, device="meta", dtype=model.embed.weight.dtype),
                                      requires_grad=False)
    if model.lm_head is not None:
        resize_linear(model.lm_head, out_features=rows)
    model.tp, model.vocab_start = group, shard.vocab[0]
    for layer in model.layers:
        attn = layer.attn
        resize_linear(attn.q_proj, out_features=heads * hd)
        resize_linear(attn.k_proj, out_features=kv * hd)
        resize_linear(attn.v_proj, out_features=kv * hd)
        resize_linear(attn.o_proj, in_features=heads * hd)
        attn.n_heads, attn.n_kv_heads, attn.reduce = heads, kv, group.all_reduce
        mlp = layer.mlp
        if hasattr(mlp, "experts"):  # SparseMoE: whole experts here, the shared ones split
            shard_experts(mlp.experts, shard)
            mlp.reduce = group.all_reduce
            if mlp.shared is not None:
                shard_mlp(mlp.shared, shard.shared[1] - shard.shared[0])
            continue
        shard_mlp(mlp, shard.ffn[1] - shard.ffn[0])
        mlp.reduce = group.all_reduce


def shard_experts(experts: nn.Module, shard) -> None:
    """Keep the (meta) Experts of `shard.experts` only, and count each rank's (token, expert) pairs."""
    e0, e1 = shard.experts
    experts.gate_up = nn.Parameter(experts.gate_up[e0:e1].clone(), requires_grad=False)
    experts.down = nn.Parameter(experts.down[e0:e1].clone(), requires_grad=False)
    experts.num_experts, experts.first = e1 - e0, e0
    experts.rank_load = torch.zeros(shard.size, dtype=torch.long)  # moved to the device with the model


def shard_mlp(mlp: nn.Module, hidden: int) -> None:
    """A gated MLP's gate/up column-parallel and down row-parallel, `hidden` units here."""
    resize_linear(mlp.gate_proj, out_features=hidden)
    resize_linear(mlp.up_proj, out_features=hidden)
    resize_linear(mlp.down_proj, in_features=hidden)


def shard_names(names: dict, shard: Shard, cfg) -> tuple[dict[str, list[Part]], set[str]]:
    """The family's name map, each part narrowed to this rank's slice; and the parameters left zero
    (row-parallel biases off rank 0)."""
    out, zeros = {}, set()
    for ours, parts in parts_of(names).items():
        module, _, kind = ours.rpartition(".")
        local = module.split(".", 2)[2] if module.startswith("layers.") else module
        if local in ROW and kind == "bias":
            if shard.rank:
                zeros.add(ours)
                continue
            out[ours] = parts
        elif local in ROW:
            start, end, unit = shard.span(local)
            out[ours] = [replace(p, cols=(start * unit, end * unit)) for p in parts]
        elif local in COLUMN:
            start, end, unit = shard.span(local)
            out[ours] = [narrow_rows(p, start * unit, end * unit) for p in parts]
        elif ours in ("embed.weight", "lm_head.weight"):
            if (part := vocab_part(parts[0], shard.vocab, cfg.embedding_size)) is None:
                zeros.add(ours)
                continue
            out[ours] = [part]
        elif local == "mlp.experts":
            e0, e1 = shard.experts
            out[ours] = [replace(p, index=(p.index[0] - e0, *p.index[1:])) for p in parts if e0 <= p.index[0] < e1]
        else:
            out[ours] = parts
    return out, zeros


def vocab_part(part: Part, vocab: tuple[int, int], embedding_size: int) -> Part | None:
    """An embedding's rows `vocab` of the padded vocabulary: the real ones read into the first rows;
    None for a rank whose rows are all padding (left zero)."""
    v0, v1 = vocab
    real = max(0, min(v1, embedding_size) - v0)
    return replace(part, rows=(v0, v0 + real), index=(slice(0, real),)) if real else None


def narrow_rows(part: Part, start: int, end: int) -> Part:
    """A part's rows [start, end) of what it held (a fused tensor's rows are offset by its own)."""
    base = part.rows[0] if part.rows else 0
    return replace(part, rows=(base + start, base + end))
