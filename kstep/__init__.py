"""kstep: an inference runtime for masked diffusion LMs, with an honest autoregressive baseline.

`load` / `LLM` import torch on first use, so the plain-Python parts (params, outputs, the
scheduler and request bookkeeping) import without it."""
from kstep.outputs import GenerationResult
from kstep.params import GenerationParams

__all__ = ["LLM", "GenerationParams", "GenerationResult", "load"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "load"):
        from kstep import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'kstep' has no attribute {name!r}")
