"""How a diffusion request's knobs become what its decoder runs: the unmask policy, the blocks and
steps, the cache, self-speculation's drafts (GenerationParams.resolve calls these for the masked-
and block-diffusion kinds). Plain Python, no torch; the defaults live here.

`p`: a GenerationParams (params.py), resolved by returning a copy (dataclasses.replace)."""
from dataclasses import dataclass, replace
from typing import Literal

from kstep.params.validation import check_dream_schedule, check_pass_bound, check_self_speculation

DEFAULT_BLOCK_LENGTH = 32  # LLaDA-Instruct's recommended semi-autoregressive block
# The fast default (Fast-dLLM's dual cache + confidence threshold): `kstep eval` measured it to hold
# quality against the exact sampler on held-out prompts (docs/benchmarks.md, "Quality: `kstep eval`").
# `exact=True` is the reference sampler.
DEFAULT_CACHE = "dual"
DEFAULT_THRESHOLD = 0.9
DEFAULT_NUM_DRAFT_TOKENS = 4  # speculative decoding, when a draft is loaded; self-speculation's too
SELF_DRAFT = "self"  # `draft`: the model drafts for itself (decoding/self_speculation.py)
DEFAULT_MAX_POST_STEPS = 16  # LLaDA2.1's token editing


@dataclass(slots=True, frozen=True)
class UnmaskPolicy:
    """How many masks a diffusion step unmasks: `fixed` (the linear schedule, `value` passes per
    block), `threshold` (every mask with confidence >= value, at least one; block diffusion: > value,
    at least the schedule's count), `factor` (Fast-dLLM's factor rule). Chosen once, when params
    are resolved; `decoding/unmask.py` holds the strategies."""
    kind: Literal["fixed", "threshold", "factor"]
    value: float


def resolve_block_diffusion(p: "GenerationParams") -> "GenerationParams":
    """Blocks are the checkpoint's (filled in from it when not given) and aligned to position 0,
    so any max_tokens fits. Policy: a threshold (default 0.9; with `steps`, at least the
    schedule's count per pass, SDAR's dynamic rule); `steps` alone: that fixed count schedule per
    block; `exact`: one token per pass (steps = block_length)."""
    if p.block_length is None:
        raise ValueError("block_length: a block-diffusion model needs its block size (from its config)")
    exact = p.exact or p.draft == SELF_DRAFT  # self-speculation is the exact sampler's, in fewer passes
    if p.exact and p.cache == "dual":
        raise ValueError("cache 'dual': exact on a block model is its reference sampler, which caches its "
                         "finished blocks and runs no block cache")
    if p.remasking == "entropy" and p.steps is None and not exact:
        raise ValueError("remasking 'entropy' scores negative entropy, which a threshold cannot compare: "
                         "give steps (a fixed schedule)")
    if p.cache == "prefix":
        raise ValueError("cache 'prefix' is the canvas models' (LLaDA, Dream): a block model always caches "
                         "its finished blocks; Fast-dLLM v2 takes cache 'dual' (its block cache) or 'none'")
    sub = p.sub_block_length or p.block_length
    if p.block_length % sub:
        raise ValueError(f"sub_block_length ({sub}) must divide block_length ({p.block_length})")
    if p.editing_threshold is None and p.max_post_steps is not None:
        raise ValueError("max_post_steps counts token-editing passes: give editing_threshold too")
    if p.editing_threshold is not None and (exact or p.steps is not None):
        raise ValueError("editing_threshold: token editing unmasks by threshold, at least one per pass "
                         "(LLaDA2.1): it takes no exact or steps")
    steps = p.block_length if exact else p.steps
    if steps is not None and steps > p.block_length:
        raise ValueError(f"steps ({steps}) per block exceeds block_length ({p.block_length})")
    if p.threshold is not None or (steps is None and not exact):
        policy = UnmaskPolicy("threshold", DEFAULT_THRESHOLD if p.threshold is None else p.threshold)
    else:
        policy = UnmaskPolicy("fixed", steps)
    threshold = policy.value if policy.kind == "threshold" else None
    post = None if p.editing_threshold is None else check_pass_bound(
        "max_post_steps", DEFAULT_MAX_POST_STEPS if p.max_post_steps is None else p.max_post_steps,
        p.block_length, f"a block of {p.block_length}", DEFAULT_MAX_POST_STEPS)
    drafts = check_self_speculation(p, steps or p.block_length, DEFAULT_NUM_DRAFT_TOKENS)
    return replace(p, steps=steps, threshold=threshold, policy=policy, sub_block_length=sub, max_post_steps=post,
                   fused_commit=p.fused_commit and not exact, cache=p.cache or "none", exact=exact,
                   num_draft_tokens=drafts, is_resolved=True)


def resolve_diffusion(p: "GenerationParams", whole_canvas_reference: bool) -> "GenerationParams":
    """Defaults: the dual cache, and the 0.9 confidence threshold unless `steps` or `factor`
    chooses the policy; `exact` turns both off (one forward pass per token unless steps). Checks
    the block/step arithmetic of LLaDA's sampler."""
    # `exact` is the fixed schedule: without a cache the reference sampler, with a prefix or dual cache
    # that schedule run with Fast-dLLM's cache; self-speculation gives its tokens in fewer passes
    speculative = p.draft == SELF_DRAFT
    exact = p.exact or speculative
    uncached = exact and p.cache in (None, "none")
    cache = "none" if uncached else p.cache or DEFAULT_CACHE
    block = p.block_length
    if block is None and uncached and whole_canvas_reference:
        block = p.max_tokens
    if block is None:
        block = DEFAULT_BLOCK_LENGTH if p.max_tokens % DEFAULT_BLOCK_LENGTH == 0 else p.max_tokens
    if p.max_tokens % block:
        raise ValueError(f"max_tokens ({p.max_tokens}) must be a multiple of block_length ({block})")
    num_blocks = p.max_tokens // block
    steps = p.max_tokens if p.steps is None else p.steps
    check_pass_bound("steps", steps, p.max_tokens, f"the completion (max_tokens {p.max_tokens})")
    if steps % num_blocks:
        raise ValueError(f"steps ({steps}) must divide evenly across the {num_blocks} blocks "
                         f"(max_tokens {p.max_tokens} / block_length {block})")
    if steps // num_blocks > block and not whole_canvas_reference:
        raise ValueError(f"steps per block ({steps // num_blocks}) exceeds block_length ({block}): "
                         f"at most one forward pass per token")
    if p.threshold is not None:
        policy = UnmaskPolicy("threshold", p.threshold)
    elif p.factor is not None:
        policy = UnmaskPolicy("factor", p.factor)
    elif p.steps is None and not exact:
        if p.remasking == "entropy":
            raise ValueError("remasking 'entropy' scores negative entropy, which the default confidence "
                             "threshold cannot compare: give steps (a fixed schedule)")
        policy = UnmaskPolicy("threshold", DEFAULT_THRESHOLD)
    else:
        policy = UnmaskPolicy("fixed", steps // num_blocks)
    if whole_canvas_reference:
        check_dream_schedule(cache, policy.kind, block, steps // num_blocks)
    drafts = check_self_speculation(p, steps // num_blocks, DEFAULT_NUM_DRAFT_TOKENS, takes_cache=True)
    threshold = policy.value if policy.kind == "threshold" else None
    return replace(p, block_length=block, steps=steps, cache=cache, threshold=threshold, policy=policy,
                   exact=p.exact or uncached, num_draft_tokens=drafts, is_resolved=True)
