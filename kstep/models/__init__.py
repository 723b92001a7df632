"""Model families: each module declares how its config.json and tensor names map onto `Transformer`."""
from types import ModuleType

from kstep.models import llada, llama
from kstep.models.config import ModelConfig
from kstep.models.transformer import Transformer

FAMILIES: dict[str, ModuleType] = {"llada": llada, "llama": llama, "qwen2": llama}


def family_for(raw: dict) -> ModuleType:
    """The family module for a checkpoint's config.json, chosen by `architectures`, then `model_type`."""
    for module in (llada, llama):
        if any(a in module.ARCHITECTURES for a in raw.get("architectures") or []):
            return module
    for module in (llada, llama):
        if raw.get("model_type") in module.MODEL_TYPES:
            return module
    known = sorted({a for m in (llada, llama) for a in m.ARCHITECTURES})
    raise ValueError(f"unknown architecture {raw.get('architectures')} / model_type {raw.get('model_type')!r}"
                     f" (supported: {', '.join(known)})")


__all__ = ["FAMILIES", "ModelConfig", "Transformer", "family_for"]
