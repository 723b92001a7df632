"""Hugging Face ids (`org/name`, `org/name@revision`) as checkpoint directories, resolved by
huggingface_hub: the local cache first; else, unless HF_HUB_OFFLINE is set, a download of only the
files kstep reads (safetensors, config, tokenizer, generation config: never a pickle, never code).

A repository of GGUF files (`org/name:QUANT`, as llama.cpp's `-hf` takes it) gives one file: the one
whose name carries QUANT (case-insensitive), or without one, Q4_K_M where there is one, else the first
(llama.cpp's rule; a repository with no config.json or no safetensors is taken as such). Only that file is downloaded."""
import os
import re
from pathlib import Path

# the files a checkpoint directory needs (weights.py, tokenizer.py); nothing executable, no pickles
FILES = ["*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?(@[\w./-]+)?")
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default


def is_hub_id(text: str) -> bool:
    """Whether `text` reads as `org/name[:quant][@revision]` (and names no file or directory here)."""
    return HUB_ID.fullmatch(text) is not None and not Path(text).exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


class NotACheckpoint(FileNotFoundError):
    """The repository's snapshot has no config.json."""


class NoSuchFile(FileNotFoundError):
    """No GGUF file of the repository is the one asked for."""


def hub_model(model_id: str) -> Path:
    """The checkpoint directory of a Hugging Face id, or its GGUF file (`:QUANT`, or a repository
    without a config.json); FileNotFoundError naming the id and why where neither is found."""
    repo, _, revision = model_id.partition("@")
    repo, _, quant = repo.partition(":")
    if not quant:
        try:
            return hub_snapshot(repo + (f"@{revision}" if revision else ""))
        except NotACheckpoint:
            pass
    return hub_gguf(model_id, repo, quant or None, revision or None)


def hub_snapshot(model_id: str) -> Path:
    """The checkpoint directory of a Hugging Face id, or FileNotFoundError naming the id and why."""
    from huggingface_hub import snapshot_download
    repo, _, revision = model_id.partition("@")
    return _checked(model_id, _fetch(model_id, lambda local: snapshot_download(
        repo, revision=revision or None, allow_patterns=FILES, local_files_only=local)))


def hub_gguf(model_id: str, repo: str, quant: str | None, revision: str | None) -> Path:
    """The GGUF file of a repository `quant` picks (see the module's docstring)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError

    def fetch(local: bool) -> str:
        if local:  # what the cache holds of the repository at that revision
            try:
                folder = snapshot_download(repo, revision=revision, allow_patterns=["*.gguf"], local_files_only=True)
            except IncompleteSnapshotError as e:  # the other quants' files, listed by the hub, never fetched
                folder = e.snapshot_path
            folder = Path(folder)
            return str(folder / pick_gguf(model_id, [str(f.relative_to(folder)) for f in folder.rglob("*.gguf")],
                                          quant))
        name = pick_gguf(model_id, HfApi().list_repo_files(repo, revision=revision), quant)
        return hf_hub_download(repo, name, revision=revision)
    return Path(_fetch(model_id, fetch))


def pick_gguf(model_id: str, names: list[str], quant: str | None) -> str:
    """The file of `names` a quant picks: its name carries `quant` between separators; without one,
    DEFAULT_QUANT's, else the first. NoSuchFile naming what there is where none does (or a split file)."""
    files = sorted(n for n in names if n.lower().endswith(".gguf") and "mmproj" not in n.lower())

    def carries(name: str, q: str) -> bool:
        return re.search(rf"(^|[-_.]){re.escape(q)}([-_.]|$)", Path(name).stem, re.I) is not None
    chosen = [n for n in files if carries(n, quant)] if quant else \
        ([n for n in files if carries(n, DEFAULT_QUANT)] or files[:1])
    if not chosen:
        there = ", ".join(Path(n).name for n in files) or "no GGUF files"
        raise NoSuchFile(f"model {model_id!r}: no GGUF file for {quant or 'any quant'} (there: {there})")
    if re.search(r"-\d{5}-of-\d{5}$", Path(chosen[0]).stem):
        raise NoSuchFile(f"model {model_id!r}: {chosen[0]} is one part of a split GGUF; kstep reads whole "
                                "files (join them with llama.cpp's llama-gguf-split --merge)")
    return chosen[0]


def _fetch(model_id: str, fetch) -> str:
    """fetch(local=True) (the cache), else, online, fetch(local=False); FileNotFoundError naming the id."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    try:
        return fetch(True)
    except (LocalEntryNotFoundError, NoSuchFile) as e:
        cached = f" ({e})" if isinstance(e, NoSuchFile) else ""
    if _offline():
        raise FileNotFoundError(f"model {model_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set "
                                f"(download it online once, or give a checkpoint directory){cached}")
    try:
        return fetch(False)
    except NoSuchFile:
        raise
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else ""
        raise FileNotFoundError(f"model {model_id!r} is neither in the Hugging Face cache nor downloadable "
                                f"from the hub: {type(e).__name__}: {why}") from None


def _checked(model_id: str, folder: str) -> Path:
    path = Path(folder)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):  # (a GGUF repository's)
        raise NotACheckpoint(f"model {model_id!r}: the hub's snapshot at {path} has no config.json or no "
                             "safetensors (kstep reads safetensors checkpoints and GGUF files from the hub)")
    return path
