"""Paths in what training records (train_config.json, model cards): as a user types them in a
checkout, never the absolute paths of the machine that trained the model."""
from pathlib import Path

PATH_KNOBS = ("out", "tokenizer", "init_from", "distill_data")  # train flags that name files


def portable_path(value: str) -> str:
    """A path as a user types it in a checkout: relative to the repository (runs go under `runs/`),
    never the absolute path of the machine that trained the model."""
    path = Path(value)
    if not path.is_absolute():
        return value
    if path.is_relative_to(Path.cwd()):
        return str(path.relative_to(Path.cwd()))
    parts = path.parts
    return str(Path(*parts[parts.index("runs"):]) if "runs" in parts else Path("runs", path.name))
