"""Per-request generation knobs, validated here and nowhere else.

Sampling knobs serve both decoders; `steps`, `block_length`, `remasking` and `cfg_scale` are the
masked-diffusion knobs of LLaDA's `generate()` (`gen_length` is `max_tokens`).
"""
from dataclasses import dataclass, replace

from kstep.decoding.unmask import UNMASK_RULES

DEFAULT_BLOCK_LENGTH = 32  # LLaDA-Instruct's recommended semi-autoregressive block


@dataclass(slots=True, frozen=True)
class GenerationParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    steps: int | None = None          # diffusion forward passes; None = max_tokens (one token per pass)
    block_length: int | None = None   # None = 32 when it divides max_tokens, else max_tokens
    remasking: str = "low_confidence"
    cfg_scale: float = 0.0

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.remasking not in UNMASK_RULES:
            raise ValueError(f"remasking {self.remasking!r} is not a known unmask rule "
                             f"(choose from {', '.join(UNMASK_RULES)})")
        if self.cfg_scale < 0:
            raise ValueError(f"cfg_scale must be >= 0, got {self.cfg_scale}")
        if self.block_length is not None and self.block_length <= 0:
            raise ValueError(f"block_length must be a positive integer, got {self.block_length}")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"steps must be a positive integer, got {self.steps}")

    def resolved_for_diffusion(self) -> "GenerationParams":
        """Fill the diffusion defaults and check the block/step arithmetic of LLaDA's sampler."""
        block = self.block_length
        if block is None:
            block = DEFAULT_BLOCK_LENGTH if self.max_tokens % DEFAULT_BLOCK_LENGTH == 0 else self.max_tokens
        if self.max_tokens % block:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be a multiple of block_length ({block})")
        num_blocks = self.max_tokens // block
        steps = self.max_tokens if self.steps is None else self.steps
        if steps % num_blocks:
            raise ValueError(f"steps ({steps}) must divide evenly across the {num_blocks} blocks "
                             f"(max_tokens {self.max_tokens} / block_length {block})")
        if steps // num_blocks > block:
            raise ValueError(f"steps per block ({steps // num_blocks}) exceeds block_length ({block}): "
                             f"at most one forward pass per token")
        return replace(self, block_length=block, steps=steps)

    @property
    def num_blocks(self) -> int:
        return self.max_tokens // self.block_length
