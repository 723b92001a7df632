"""A GGUF file's tensors under their Hugging Face names, one at a time: the name through gguf-py's
own tables (`get_tensor_name_map`), the data as stored for F32 / F16 / BF16 and dequantized by
gguf-py for the quantized types, and llama.cpp's rope permutation of the query and key rows undone
for the architectures its converter permutes (LlamaModel.permute: llama, llada)."""
import mmap
import re
from pathlib import Path

import numpy as np
import torch
import gguf


PERMUTED = ("llama", "llada")  # llama.cpp's "normal" rope: its converter reorders q / k rows per head
_ARCHES = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
FLOATS = ("F32", "F16", "BF16")  # stored as they are read; every other type is dequantized
CHUNK_BYTES = 16 << 20  # float32 rows dequantized at a time
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")  # one expert's weight: a slice of the stacked one


class GGUFTensors:
    """safetensors' `safe_open` handle, for a GGUF file: get_tensor / get_slice by Hugging Face name.
    Reads the file through its own memory map at the offsets gguf-py found when the view was written
    (view.py: `tensors`), so a load does not parse the file's metadata again (a 151,000-token
    vocabulary took gguf-py's reader 2-4 s), and hands each tensor's pages back once the next is read."""

    def __init__(self, source: Path, arch: str, table: dict, config: dict):
        self.source, self.arch, self.table, self.config = source, arch, table, config
        layers = config.get("num_hidden_layers") or config["n_layers"]  # LLaDA's config names it n_layers
        self.names = gguf.get_tensor_name_map(_ARCHES[arch], layers)
        self._map = np.memmap(source, mode="c")  # private: writable views for torch, the file untouched
        self._bytes = self._map.view(np.ndarray)  # slicing a plain array costs a tenth of a memmap's
        self._stacked: tuple[str | None, torch.Tensor | None] = (None, None)
        self._read_last: tuple[int, int] | None = None

    def gguf_name(self, name: str) -> str | None:
        """The file's tensor for a Hugging Face tensor name, or None where the file has none (an
        expert's: the layer's stacked tensor)."""
        expert = EXPERT.fullmatch(name)
        asked = f"{expert[1]}.{expert[3]}.weight" if expert else name
        found = self.names.get_name(asked, try_suffixes=(".weight", ".bias"))
        return found if found in self.table else None

    def get_tensor(self, name: str) -> torch.Tensor:
        expert = EXPERT.fullmatch(name)
        if expert is None:
            return self._read(name, self.gguf_name(name))
        stacked = self.gguf_name(name)  # (experts, out, in): the converter's torch.stack of each expert's
        if self._stacked[0] != stacked:  # one stacked tensor dequantized for all its experts
            self._stacked = (stacked, self._read(name, stacked))
        return self._stacked[1][int(expert[2])]

    def _read(self, name: str, stored: str) -> torch.Tensor:
        self._release()  # the tensor before this one has been copied by now
        entry = self.table[stored]
        shape = tuple(reversed(entry["shape"]))  # GGML lists the innermost dimension first
        raw = self._bytes[entry["offset"]:entry["offset"] + entry["bytes"]]
        self._read_last = (entry["offset"], entry["bytes"])
        if entry["type"] == "F32":
            values = torch.from_numpy(raw.view(np.float32))
        elif entry["type"] == "F16":
            values = torch.from_numpy(raw.view(np.float16))
        elif entry["type"] == "BF16":
            values = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
        else:
            values = self._dequantize(stored, entry, torch.empty(shape))
        values = values.reshape(shape)
        return _unpermute(values, self._heads(name)) if self._permuted(name) else values

    def read_into(self, name: str, target: torch.Tensor) -> bool:
        """Dequantize a quantized tensor straight into `target` (no whole-tensor temporaries); False where
        it does not apply (a float tensor, an expert's, a permuted one, another shape): get_tensor then."""
        stored = None if EXPERT.fullmatch(name) or self._permuted(name) else self.gguf_name(name)
        entry = self.table.get(stored) if stored else None
        if entry is None or entry["type"] in FLOATS or not target.is_contiguous() \
                or tuple(target.shape) != tuple(reversed(entry["shape"])):
            return False
        self._release()
        self._read_last = (entry["offset"], entry["bytes"])
        self._dequantize(stored, entry, target)
        return True

    def _dequantize(self, stored: str, entry: dict, out: torch.Tensor) -> torch.Tensor:
        """gguf-py's dequantization of a tensor into `out` (its shape), CHUNK_BYTES of float32 rows at a
        time: whole, a large tensor's temporaries would be several times its size (a 151,936-row
        embedding's: 0.5 GB each)."""
        kind = gguf.GGMLQuantizationType[entry["type"]]
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        width = out.shape[-1]
        raw = self._bytes[entry["offset"]:entry["offset"] + entry["bytes"]]
        rows = raw.reshape(-1, width // block * block_bytes)
        into, step = out.view(-1, width), max(1, CHUNK_BYTES // (width * 4))
        try:
            for start in range(0, rows.shape[0], step):
                into[start:start + step].copy_(torch.from_numpy(gguf.quants.dequantize(rows[start:start + step], kind)))
        except NotImplementedError:
            raise ValueError(f"{self.source}: tensor {stored} is {kind.name}, which gguf-py cannot "
                             "dequantize") from None
        return out

    def _permuted(self, name: str) -> bool:
        """Whether the converter permuted this tensor's rows (llama.cpp's "normal" rope: llama, llada)."""
        return self.arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"))

    def _release(self) -> None:
        """Let the last tensor's pages of the file go (read again from the file if touched): the file's
        weights do not count twice in the process's memory while it loads."""
        if self._read_last is not None and self._map._mmap is not None:
            offset, size = self._read_last
            first = offset // mmap.PAGESIZE * mmap.PAGESIZE
            self._map._mmap.madvise(mmap.MADV_DONTNEED, first, offset + size - first)
        self._read_last = None

    def get_slice(self, name: str) -> torch.Tensor:
        """The whole tensor, which a caller indexes (a tensor-parallel rank's share)."""
        return self.get_tensor(name)

    def _heads(self, name: str) -> int:
        heads = self.config.get("num_attention_heads") or self.config["n_heads"]
        kv_heads = self.config.get("num_key_value_heads") or self.config.get("n_kv_heads") or heads
        return kv_heads if "k_proj" in name else heads

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._release()


def _unpermute(values: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's LlamaModel.permute: within each head, rows (2, half) back from (half, 2)."""
    rows = values.shape[0]
    return values.reshape(heads, rows // heads // 2, 2, *values.shape[1:]).transpose(1, 2).reshape(values.shape)
