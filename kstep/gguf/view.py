"""A GGUF file as a checkpoint directory: its config.json, tokenizer.json, tokenizer_config.json and
generation_config.json written from its metadata into kstep's cache (a few MB at most, once per
file version), with `gguf_file.json` naming the file, whose tensors are read in place (weights.py)."""
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from kstep.gguf.config import hf_config
from kstep.gguf.reader import GGUFFile
from kstep.gguf.tensors import FLOATS, GGUFTensors
from kstep.gguf.vocab import tokenizer_files

MARKER = "gguf_file.json"
# The code that writes a view: another version of it (a kstep upgrade) writes a new directory.
WRITERS = tuple(Path(__file__).with_name(name) for name in ("view.py", "config.py", "vocab.py", "reader.py"))


def cache_root() -> Path:
    base = os.environ.get("KSTEP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kstep")
    return Path(base) / "gguf"


def gguf_in(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf file of a directory with no
    config.json; None for anything else."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}): "
                             "name one")
        return found[0] if found else None
    return None


def gguf_view(path: Path) -> Path:
    """The checkpoint directory of the GGUF file at `path`, written on first use."""
    path = path.resolve()
    stat = path.stat()
    code = b"".join(writer.read_bytes() for writer in WRITERS)
    key = hashlib.sha256(code + f"\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    view = cache_root() / f"{path.stem}-{key}"
    if (view / MARKER).is_file():
        return view
    file = GGUFFile(path)
    config = hf_config(file)
    tokenizer, tokenizer_config = tokenizer_files(file)
    files = {"config.json": config, "tokenizer.json": tokenizer, "tokenizer_config.json": tokenizer_config,
             "generation_config.json": {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                                        if k in config},
             MARKER: {"file": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "arch": file.arch,
                      **_quantization(file), "tensors": _tensor_table(file)}}
    view.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=view.parent, prefix=".staging-"))
    try:
        for name, content in files.items():
            (staging / name).write_text(json.dumps(content, ensure_ascii=False))
        try:
            staging.rename(view)  # whole, for a process starting alongside
        except OSError:
            if not (view / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return view


def gguf_source(view: Path) -> Path | None:
    """The GGUF file a view directory reads its tensors from (None: not a view)."""
    recorded = _recorded(view)
    return None if recorded is None else Path(recorded["file"])


def gguf_tensors(view: Path) -> GGUFTensors | None:
    """A view's tensors, read from its GGUF file (None: not a view)."""
    recorded = _recorded(view)
    if recorded is None:
        return None
    return GGUFTensors(Path(recorded["file"]), recorded["arch"], recorded["tensors"],
                      json.loads((view / "config.json").read_text()))


def _recorded(view: Path) -> dict | None:
    marker = view / MARKER
    if not marker.is_file():
        return None
    recorded = json.loads(marker.read_text())
    source = Path(recorded["file"])
    if not source.is_file() or source.stat().st_size != recorded["size"]:
        raise FileNotFoundError(f"{view}: its GGUF file {source} is gone or has changed (load the file again)")
    return recorded


def _tensor_table(file: GGUFFile) -> dict:
    """Where gguf-py found each tensor (type, GGML shape, byte offset and size): a load reads no metadata."""
    return {t.name: {"type": t.tensor_type.name, "shape": [int(n) for n in t.shape], "offset": int(t.data_offset),
                     "bytes": int(t.n_bytes)} for t in file.tensors.values()}


def _quantization(file: GGUFFile) -> dict:
    """The kstep type nearest a quantized file's matrices that keeps their memory size: int8 for 8-bit
    types (Q8_0), int4 below; none for float files. And the types, for the notice."""
    kinds = file.matrix_types()
    quantized = [kind for kind in kinds if kind not in FLOATS]
    if not quantized:
        return {}
    mode = "int8" if all(kind.startswith("Q8") for kind in quantized) else "int4"
    return {"quantize": mode, "types": ", ".join(f"{kind} x {n}" for kind, n in kinds.items())}


@functools.cache
def default_quantization(view: Path) -> str | None:
    """A quantized GGUF file's default `quantize` (None: a float file, or not a view), said once on stderr."""
    marker = view / MARKER
    recorded = json.loads(marker.read_text()) if marker.is_file() else {}
    mode = recorded.get("quantize")
    if mode is not None:
        faster = " (--quantize int8: up to 1.25x faster on a CPU, in about twice the memory)" if mode == "int4" else ""
        sys.stderr.write(f"kstep: {Path(recorded['file']).name} holds quantized matrices ({recorded['types']}): they "
                         f"run as {mode}, kstep's nearest type that keeps their memory size{faster}\n")
    return mode
