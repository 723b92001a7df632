"""Hugging Face ids (`org/name`, `org/name@revision`) as checkpoint directories, resolved by
huggingface_hub: the local cache first; else, unless HF_HUB_OFFLINE is set, a download of only the
files kstep reads (safetensors, config, tokenizer, generation config: never a pickle, never code)."""
import os
import re
from pathlib import Path

# the files a checkpoint directory needs (weights.py, tokenizer.py); nothing executable, no pickles
FILES = ["*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def is_hub_id(text: str) -> bool:
    """Whether `text` reads as `org/name[@revision]` (and names no file or directory here)."""
    return HUB_ID.fullmatch(text) is not None and not Path(text).exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_snapshot(model_id: str) -> Path:
    """The checkpoint directory of a Hugging Face id, or FileNotFoundError naming the id and why."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    repo, _, revision = model_id.partition("@")
    try:
        return _checked(model_id, snapshot_download(repo, revision=revision or None, allow_patterns=FILES,
                                                    local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if _offline():
        raise FileNotFoundError(f"model {model_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set "
                                "(download it online once, or give a checkpoint directory)")
    try:
        return _checked(model_id, snapshot_download(repo, revision=revision or None, allow_patterns=FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else ""
        raise FileNotFoundError(f"model {model_id!r} is neither in the Hugging Face cache nor downloadable "
                                f"from the hub: {type(e).__name__}: {why}") from None


def _checked(model_id: str, folder: str) -> Path:
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {model_id!r}: the hub's snapshot at {path} has no config.json "
                                "(kstep reads safetensors checkpoints from the hub)")
    return path
