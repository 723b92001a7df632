"""Range checks for values a user sends (CLI flags, HTTP fields, Python arguments): a ValueError
that names the value and the rule, never an assert. Plain Python, no torch."""
import math

# No knob may ask for more forward passes than this many per position it refines (Dream's steps per
# completion token, LLaDA2.1's editing passes per block position, DiffusionGemma's passes per canvas
# position): every reference default stays far below it (Dream 1, LLaDA2.1 0.5, DiffusionGemma 0.19),
# and past it a request only holds its slot. `kstep serve --max-request-passes` caps the total too.
MAX_PASSES_PER_POSITION = 4
MAX_SEED = 2**63 - 1  # a torch generator's seed, as OpenAI's int64 `seed`


def check_int(name: str, value, low: int | None, high: int | None = None, rule: str | None = None) -> None:
    if value is None:
        return
    bad = not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low) or \
        (high is not None and value > high)
    if bad:
        rule = rule or ("an integer" if low is None else "a positive integer" if low == 1 else f"an integer >= {low}")
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def check_number(name: str, value, low: float, high: float | None = None, exclusive_low: bool = False) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (value <= low if exclusive_low else value < low) or (high is not None and value > high):
        low_text = f"> {low}" if exclusive_low else f">= {low}"
        raise ValueError(f"{name} must be {low_text}" + (f" and <= {high}" if high is not None else "") +
                         f", got {value}")


def check_pass_bound(name: str, passes: int, positions: int, what: str, default: int = 0) -> int:
    """`passes`, which a knob that multiplies passes asks for: at most MAX_PASSES_PER_POSITION per
    position (and always its reference `default`)."""
    limit = max(MAX_PASSES_PER_POSITION * positions, default)
    if passes > limit:
        raise ValueError(f"{name} ({passes}) exceeds its limit of {limit}: at most {MAX_PASSES_PER_POSITION} "
                         f"passes per position of {what}")
    return passes


def check_dream_schedule(cache: str, policy: str, block: int, steps_per_block: int) -> None:
    """Dream's two samplers' own arithmetic (decoding/dream.py), for its resolved cache and unmask policy."""
    if cache != "none" and policy == "fixed" and steps_per_block < 2:
        raise ValueError(f"steps gives {steps_per_block} pass per block: Dream's block sampler (cache "
                         f"{cache}) needs at least 2 (its first pass commits one token)")
    if cache == "none" and policy == "threshold" and block % steps_per_block:
        raise ValueError(f"a threshold without a cache is Dream's confidence_threshold: block_length ({block}) "
                         f"must be a multiple of the steps per block ({steps_per_block})")



def check_self_speculation(params, steps_per_block: int, default_drafts: int, takes_cache: bool = False
                           ) -> int | None:
    """The drafts per pass of a `draft="self"` request (decoding/self_speculation.py), None without
    one: lossless only where the sampler is deterministic (greedy, a fixed schedule, a score that is
    not random); a ValueError naming the field otherwise. `takes_cache`: a canvas model's prefix and
    dual caches (the drafts run as window passes against copies of the block start's cache)."""
    if params.draft is None:
        if params.num_draft_tokens:
            raise ValueError("num_draft_tokens: a diffusion model drafts for itself: give draft 'self' too")
        return None
    # what the request chose itself first, then the sampling a server may default (OpenAI's temperature 1)
    refused = {"threshold": params.threshold is not None, "factor": params.factor is not None,
               "remasking": params.remasking == "random", "cfg_scale": params.cfg_scale != 0,
               "alg_temp": bool(params.alg_temp), "time_budget": params.time_budget is not None,
               "temperature": params.temperature != 0}
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"{name} {getattr(params, name)!r}: draft 'self' gives the exact sampler's tokens (a "
                             f"fixed schedule, greedy: temperature 0) in fewer passes, so it takes no {name}"
                             + (" (over HTTP, send temperature 0)" if name == "temperature" else ""))
    if params.cache not in (None, "none") and not takes_cache:
        raise ValueError(f"cache {params.cache!r}: draft 'self' on a block model is its exact sampler's, which takes "
                         "no cache (its finished blocks are cached either way)")
    drafts = default_drafts if params.num_draft_tokens is None else params.num_draft_tokens
    check_int("num_draft_tokens", drafts, 1, steps_per_block, f"[1, the {steps_per_block} passes of a block] "
              "with draft 'self'")
    return drafts
