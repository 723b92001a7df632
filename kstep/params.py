"""Per-request generation knobs, validated here and nowhere else.

Sampling knobs serve both decoders; `steps`, `block_length`, `remasking` and `cfg_scale` are the
masked-diffusion knobs of LLaDA's `generate()` (`gen_length` is `max_tokens`).
"""
from dataclasses import dataclass, replace

from kstep.decoding.unmask import UNMASK_RULES

DEFAULT_BLOCK_LENGTH = 32  # LLaDA-Instruct's recommended semi-autoregressive block
# The fast default (Fast-dLLM's dual cache + confidence threshold): `kstep eval` measured it to hold
# quality against the exact sampler on held-out prompts (README). `exact=True` is LLaDA's sampler.
DEFAULT_CACHE = "dual"
DEFAULT_THRESHOLD = 0.9
CACHE_MODES = ("none", "prefix", "dual")


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
    cache: str | None = None          # none | prefix | dual (Fast-dLLM's caches); None = dual
    threshold: float | None = None    # unmask every mask with confidence >= threshold (and the best one);
                                      # None = 0.9 unless steps or factor fix the policy
    exact: bool = False               # LLaDA's reference sampler: no cache, fixed schedule (steps)
    factor: float | None = None       # Fast-dLLM's factor rule instead of a fixed count per step
    early_stop: bool = True           # stop a row once an end-of-sequence token has nothing masked before it
    ignore_eos: bool = False          # always produce max_tokens (benchmarks): no stop at end-of-sequence
    min_tokens: int = 0               # no end-of-sequence/stop token among the first min_tokens (vLLM's min_tokens)
    num_draft_tokens: int = 0         # AR speculative decoding: draft tokens per target pass (0 = off)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
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
        if self.cache is not None and self.cache not in CACHE_MODES:
            raise ValueError(f"cache {self.cache!r} is not a cache mode (choose from {', '.join(CACHE_MODES)})")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.factor is not None and self.factor <= 0:
            raise ValueError(f"factor must be > 0, got {self.factor}")
        if (self.threshold is not None or self.factor is not None) and self.remasking == "entropy":
            raise ValueError("threshold and factor compare confidences with probabilities; remasking 'entropy' "
                             "scores negative entropy: use low_confidence, margin or random")
        if not isinstance(self.num_draft_tokens, int) or not 0 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be an integer in [0, 16], got {self.num_draft_tokens!r}")
        if self.threshold is not None and self.factor is not None:
            raise ValueError("threshold and factor are two unmask policies: give one, not both")
        if self.exact and (self.cache not in (None, "none") or self.threshold is not None or self.factor is not None):
            raise ValueError("exact is LLaDA's reference sampler (no cache, fixed schedule): it takes no cache, "
                             "threshold or factor")

    def resolved_for_diffusion(self) -> "GenerationParams":
        """Fill the diffusion defaults and check the block/step arithmetic of LLaDA's sampler.

        Defaults: the dual cache, and the 0.9 confidence threshold unless `steps` or `factor` chooses
        the policy; `exact` turns both off (LLaDA's sampler, one forward pass per token unless steps)."""
        cache, threshold = ("none", None) if self.exact else (self.cache or DEFAULT_CACHE, self.threshold)
        if not self.exact and threshold is None and self.factor is None and self.steps is None:
            threshold = DEFAULT_THRESHOLD
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
        return replace(self, block_length=block, steps=steps, cache=cache, threshold=threshold)

    @property
    def num_blocks(self) -> int:
        return self.max_tokens // self.block_length
