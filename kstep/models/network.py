"""What a model runner drives (runner/model_runner.py): the interface every family's network
offers, so the runner never probes a model for what it can do. `Transformer` (models/transformer.py)
is every family's but DiffusionGemma's, which is its own (models/diffusion_gemma_model.py)."""
from typing import Protocol

import torch
from torch import nn

from kstep.layers.attention import KVCache, Segment
from kstep.models.config import ModelConfig


class Network(Protocol):
    cfg: ModelConfig
    embed: nn.Embedding        # its rows' device and dtype are the model's
    tp: object | None          # the tensor-parallel group that holds the other shards (None: one device)
    always_writes_kv: bool     # every pass writes a KV cache, a plain one too (DiffusionGemma's attention)

    def kv_geometry(self) -> list[tuple[int, int]]:
        """Per layer, its cache's (key/value heads, head dim): a KV pool's storage (runner/kv_pool.py)."""

    def allocate_kv(self, batch: int, length: int) -> KVCache:
        """A zeroed KV cache of its own, `length` slots, for the network called alone (not a runner's)."""

    def packed_hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                             **modes) -> torch.Tensor:
        """Final-norm hidden states (N, D) of the packed tokens (N,) (a two-mode network: per segment `modes`)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(..., D) -> (..., vocab_size); tensor parallel: on rank 0, None on the others."""

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., D) -> this rank's vocabulary columns (top-token passes, runner/top_tokens.py)."""

    def vocab_columns(self) -> tuple[int, int]:
        """(first id, number of real ids) of `local_logits`' columns."""
