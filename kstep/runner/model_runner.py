"""The model runner: owns the model, its KV buffers, and every forward pass.

Decoders ask it for logits; they never touch the model. It builds positions and attention masks
from per-row padding so that a left-padded row computes what it would compute alone. KV buffers
are allocated once per generation (`allocate_kv`), never per step.
"""
import torch

from kstep.models import Transformer


def positions_from_padding(key_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool, True = real token -> (B, L) positions counting real tokens only (pads get 0)."""
    return (key_mask.long().cumsum(-1) - 1).clamp(min=0)


class ModelRunner:
    def __init__(self, model: Transformer):
        self.model = model
        self.cfg = model.cfg
        self.device = model.embed.weight.device
        self.dtype = model.embed.weight.dtype
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def synchronize(self) -> None:
        """Wait for queued device work (for honest timings on CUDA; a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def free_kv(self) -> None:
        self.kv = None

    def allocate_kv(self, batch: int, length: int) -> None:
        """Preallocate the KV cache once per generation: no per-step allocation or concatenation."""
        if length > self.cfg.max_positions:
            raise ValueError(f"prompt + max_tokens ({length}) exceeds the model's context of {self.cfg.max_positions}")
        shape = (batch, self.cfg.n_kv_heads, length, self.cfg.head_dim)
        self.kv = [(torch.empty(shape, device=self.device, dtype=self.dtype),
                    torch.empty(shape, device=self.device, dtype=self.dtype)) for _ in range(self.cfg.n_layers)]

    def _positions(self, key_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
        if key_mask is None:
            return torch.arange(length, device=self.device).expand(batch, -1)
        return positions_from_padding(key_mask)

    @torch.inference_mode()
    def full_logits(self, ids: torch.Tensor, key_mask: torch.Tensor | None, start: int, end: int,
                    write_cache: bool = False) -> torch.Tensor:
        """One bidirectional pass over ids (B, L); logits only for positions [start, end): (B, end-start, V).
        With write_cache, every position's keys/values are stored for later window passes.

        Computing the LM head for the positions that can change, not the whole canvas, keeps
        memory from growing with canvas x vocabulary.
        """
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, L)
        positions = self._positions(key_mask, *ids.shape)
        hidden = self.model.hidden_states(ids, positions, mask, self.kv if write_cache else None, 0)  # (B, L, D)
        return self.model.logits(hidden[:, start:end])

    @torch.inference_mode()
    def window_logits(self, ids: torch.Tensor, key_mask: torch.Tensor | None, start: int, end: int,
                      attend_len: int, num_logits: int) -> torch.Tensor:
        """Bidirectional pass over only ids[:, start:end] of the canvas ids (B, L), attending to cached
        keys/values of slots [0, attend_len) with this window's fresh ones written in place; logits for
        the window's first `num_logits` positions: (B, num_logits, V). Fast-dLLM's prefix cache runs
        the window [block start, L); its DualCache runs the block alone."""
        mask = None if key_mask is None else key_mask[:, None, None, :attend_len]  # (B, 1, 1, S)
        positions = self._positions(key_mask, *ids.shape)[:, start:end]
        hidden = self.model.hidden_states(ids[:, start:end], positions, mask, self.kv, start, attend_len)
        return self.model.logits(hidden[:, :num_logits])

    @torch.inference_mode()
    def causal_logits(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor | None,
                      cache_start: int) -> torch.Tensor:
        """Causal pass of ids (B, T) written into the cache at [cache_start, cache_start+T); logits of
        the last position (B, V). key_mask (B, cache_start+T) marks real (non-pad) cache slots."""
        T, end = ids.shape[1], cache_start + ids.shape[1]
        mask = None if key_mask is None else key_mask[:, None, None, :end]  # (B, 1, 1, S)
        if T > 1 and (mask is not None or cache_start > 0):
            causal = torch.ones(T, end, dtype=torch.bool, device=self.device).tril(cache_start)  # (T, S)
            # Each query may see itself, so a left-pad query never has an all-masked row (NaN on some kernels).
            itself = causal.triu(cache_start)  # (T, S): the diagonal
            mask = causal if mask is None else (mask & causal) | itself  # (B, 1, T, S)
        hidden = self.model.hidden_states(ids, positions, mask, self.kv, cache_start)  # (B, T, D)
        return self.model.logits(hidden[:, -1])
