"""kstep: an inference runtime for masked diffusion LMs, with an honest autoregressive baseline.

`load` / `LLM` import torch on first use, so the plain-Python parts (params, outputs, the
scheduler and request bookkeeping) import without it."""
import os

# torch's CPU allocator backs allocations of 2 MB and more with transparent huge pages when this is
# set before its first allocation (it reads it once): loading a 2 GB checkpoint then faults 1,000
# pages in instead of 500,000 (a 0.5B model's weights: 3.8 s -> 2.8 s to load, measured). A no-op
# where torch was imported first, or where the kernel's THP setting is "never".
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from kstep.outputs import GenerationResult  # noqa: E402
from kstep.params import GenerationParams  # noqa: E402
from kstep.structured.spec import StructuredSpec  # noqa: E402

__all__ = ["LLM", "GenerationParams", "GenerationResult", "StructuredSpec", "load"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "load"):
        from kstep import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'kstep' has no attribute {name!r}")
