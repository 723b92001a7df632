"""What rank 0 sends the other ranks of a tensor-parallel group (runner.py): one message per
step, pickled between kstep's own processes (a pipe) or to its Ray actors (an actor call).

Every message carries what happened on rank 0 since the last one: the KV copies to replay
(`replayed`, in order) and the ids of the KV caches and soft embeddings rank
0 dropped (`freed`); then its own work: a pass to run (`Execute`), a soft embedding to make
(`SoftEmbedding`), a reply to give (`Report`), or the loop to leave (`Stop`). No torch work here:
the tensors a pass description holds are on the CPU (each rank has its own device)."""
from dataclasses import dataclass, field, fields

import torch

from kstep.runner.top_tokens import TopRequest


@dataclass(frozen=True, slots=True)
class KVHandle:
    """Rank 0's KV cache as the other ranks know theirs: its id, its length and its rows' page tables
    in rank 0's pool (of `pool_pages` pages of `page_tokens`), as they are when the handle is made
    (a cache grows, and maps a prefix cache's pages, between passes): each rank reads and writes its
    own at the same pages of a pool of the same shape, so rank 0's page books hold for all
    (runner/kv_pool.py)."""
    kv_id: int
    length: int
    tables: tuple[tuple[int, ...], ...]
    pool_pages: int
    page_tokens: int


@dataclass(frozen=True, slots=True)
class CopyKV:
    """Rank 0 copied rows `src_rows` of cache `src` into rows `dst_rows` of `dst`."""
    src: KVHandle
    dst: KVHandle
    src_rows: list[int]
    dst_rows: list[int]


ReplayOp = CopyKV


@dataclass(frozen=True, slots=True)
class PassDescription:
    """A ForwardPass as the other ranks rebuild it (runner.rebuild): the same fields, `runner`
    excepted (each rank's own), its tensors on the CPU, its KV cache by handle and its soft
    embedding by rank 0's id when the ranks hold it (a tensor otherwise). A test keeps these fields
    ForwardPass's."""
    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None
    logits_from: int
    logits_to: int
    kind: str
    kv: KVHandle | None
    cache_start: int
    cache_len: int | None
    cache_slots: torch.Tensor | None
    logits_columns: torch.Tensor | None
    mode: str | None
    soft_embeds: torch.Tensor | int | None
    top: TopRequest | None


# The fields that travel as they are (tensors moved to the receiving rank's device): all but the handles.
PASS_FIELDS = tuple(f.name for f in fields(PassDescription) if f.name not in ("kv", "soft_embeds"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    replayed: list[ReplayOp] = field(default_factory=list)  # to replay first, in order
    freed: list[int] = field(default_factory=list)          # KV caches and soft embeddings rank 0 dropped


@dataclass(frozen=True, slots=True, kw_only=True)
class Execute(Message):
    """Run these passes (one packed step) with rank 0."""
    passes: list[PassDescription]


@dataclass(frozen=True, slots=True, kw_only=True)
class SoftEmbedding(Message):
    """Take part in rank 0's soft embedding `soft_id` of leading shape `lead` (its scatter, then this
    rank's rows), and keep the result under that id."""
    soft_id: int
    lead: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Report(Message):
    """Reply with what this rank holds (a RankReport)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop(Message):
    """Leave the loop: the group is closing."""


@dataclass(frozen=True, slots=True)
class RankReport:
    """What a rank other than 0 holds: the check that it mirrors rank 0."""
    kv_caches: list[int]
    soft_embeds: list[int]
