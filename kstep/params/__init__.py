"""Per-request knobs: their declaration and resolution (generation.py), the diffusion kinds' policy,
blocks and steps (denoising.py), and the range checks every edge shares (validation.py). Plain
Python, no torch: the scheduler and request bookkeeping import it."""
from kstep.params.denoising import DEFAULT_NUM_DRAFT_TOKENS, SELF_DRAFT, UnmaskPolicy
from kstep.params.generation import CACHE_MODES, REMASKING_RULES, GenerationParams, knob_applies, user_knobs
from kstep.kinds import (AUTOREGRESSIVE, BLOCK_DIFFUSION, DIFFUSION, MODES, SELF_SPECULATION,  # the kinds, for the
                         UNIFORM_DIFFUSION)  # knobs' users' convenience

__all__ = ["AUTOREGRESSIVE", "BLOCK_DIFFUSION", "CACHE_MODES", "DEFAULT_NUM_DRAFT_TOKENS", "DIFFUSION", "MODES",
           "REMASKING_RULES", "SELF_DRAFT", "SELF_SPECULATION", "UNIFORM_DIFFUSION", "GenerationParams",
           "UnmaskPolicy", "knob_applies", "user_knobs"]
