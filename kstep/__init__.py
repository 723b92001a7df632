"""kstep: an inference runtime for masked diffusion LMs, with an honest autoregressive baseline."""
from kstep.llm import LLM, load
from kstep.outputs import GenerationResult
from kstep.params import GenerationParams

__all__ = ["LLM", "GenerationParams", "GenerationResult", "load"]
__version__ = "0.1.0"
