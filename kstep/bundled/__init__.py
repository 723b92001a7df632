"""The models that ship inside the package, trained here with `kstep train` (see each model card).

`default` is the diffusion coder (llada layout), `default-ar` its autoregressive twin (llama
layout, same size, tokenizer, data and budget), `default-draft` a small AR draft model.
"""
from pathlib import Path

BUNDLED_DIR = Path(__file__).parent
BUNDLED_MODELS = ("default", "default-ar", "default-draft")


def resolve_model(name_or_path: str | Path) -> Path:
    """A bundled model's directory for its name; any other value is taken as a checkpoint path."""
    if str(name_or_path) in BUNDLED_MODELS:
        path = BUNDLED_DIR / str(name_or_path)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"bundled model {name_or_path!r} is not installed at {path}")
        return path
    return Path(name_or_path)
