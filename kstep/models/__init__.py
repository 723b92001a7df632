"""Architectures: the one `Transformer` every family is built from, and each checkpoint layout's
config/tensor-name mapping (llada.py, llama.py, dream.py, fast_dllm_v2.py, sdar.py,
llada2_moe.py, llada_moe.py). Which layout a checkpoint has, and how
it decodes, is the registry's business (kstep/registry.py)."""
from kstep.models.config import ModelConfig, MoEConfig
from kstep.models.transformer import Transformer

__all__ = ["ModelConfig", "MoEConfig", "Transformer"]
