"""A GGUF file's metadata and tensors through gguf-py's reader (a memory map: nothing is executed,
nothing unpickled)."""
from pathlib import Path

import gguf
import numpy as np


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.reader = _Reader(self.path, "r")
        except (ValueError, OSError) as e:
            raise ValueError(f"{self.path}: not a GGUF file gguf-py can read ({e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise ValueError(f"{self.path}: no general.architecture in its metadata")

    def get(self, key: str, default=None):
        """A metadata value as Python data (a string, a number, a list), or `default`."""
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def arch_get(self, suffix: str, default=None):
        """`{arch}.{suffix}`, the architecture's own keys (e.g. `llama.block_count`)."""
        return self.get(f"{self.arch}.{suffix}", default)

    def matrix_types(self) -> dict[str, int]:
        """How many matrices (2-d tensors and more) of each type the file holds, most common first."""
        kinds: dict[str, int] = {}
        for tensor in self.tensors.values():
            if len(tensor.shape) >= 2:
                kinds[tensor.tensor_type.name] = kinds.get(tensor.tensor_type.name, 0) + 1
        return dict(sorted(kinds.items(), key=lambda kind_count: -kind_count[1]))


class _Reader(gguf.GGUFReader):
    """gguf-py's reader over a plain array view of its memory map: it parses the metadata with one
    small slice per value, and numpy's memmap subclass costs more per slice than the parse itself
    (a 49,152-token vocabulary: 2.7 s against 0.9). The map stays open through the view's base."""

    @property
    def data(self):
        return self._plain

    @data.setter
    def data(self, value):
        self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value
