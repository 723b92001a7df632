"""The models that ship inside the package, trained here with `kstep train` (see each model card).

`default` is the diffusion coder: a block-diffusion model (`fast_dllm_v2` layout, blocks of 8)
converted from `default-ar`, its autoregressive twin (llama layout, same size and tokenizer), and
distilled from it; `default-draft` is a small AR draft model; `llada-coder` is a full-attention
masked-diffusion coder (llada layout) trained from scratch with the same data and budget as
`default-ar` (the subject for LLaDA's exact sampler, its caches and whole-canvas decoding).
"""
from pathlib import Path

BUNDLED_DIR = Path(__file__).parent
BUNDLED_MODELS = ("default", "default-ar", "default-draft", "llada-coder")


def resolve_model(name_or_path: str | Path) -> Path:
    """A bundled model's directory for its name; any other value is taken as a checkpoint path."""
    if str(name_or_path) in BUNDLED_MODELS:
        path = BUNDLED_DIR / str(name_or_path)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"bundled model {name_or_path!r} is not installed at {path}")
        return path
    return Path(name_or_path)
