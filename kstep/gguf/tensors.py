"""A GGUF file's tensors under their Hugging Face names, one at a time: the name through gguf-py's
own tables (`get_tensor_name_map`), the data as stored for F32 / F16 / BF16 and dequantized by
gguf-py for the quantized types, and llama.cpp's rope permutation of the query and key rows undone
for the architectures its converter permutes (LlamaModel.permute: llama, llada)."""
import re

import numpy as np
import torch
import gguf

from kstep.gguf.reader import GGUFFile

PERMUTED = ("llama", "llada")  # llama.cpp's "normal" rope: its converter reorders q / k rows per head
_ARCHES = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")  # one expert's weight: a slice of the stacked one


class GGUFTensors:
    """safetensors' `safe_open` handle, for a GGUF file: get_tensor / get_slice by Hugging Face name."""

    def __init__(self, file: GGUFFile, config: dict):
        self.file, self.config = file, config
        layers = config.get("num_hidden_layers") or config["n_layers"]  # LLaDA's config names it n_layers
        self.names = gguf.get_tensor_name_map(_ARCHES[file.arch], layers)
        self._stacked: tuple[str | None, torch.Tensor | None] = (None, None)

    def gguf_name(self, name: str) -> str | None:
        """The file's tensor for a Hugging Face tensor name, or None where the file has none (an
        expert's: the layer's stacked tensor)."""
        expert = EXPERT.fullmatch(name)
        asked = f"{expert[1]}.{expert[3]}.weight" if expert else name
        found = self.names.get_name(asked, try_suffixes=(".weight", ".bias"))
        return found if found in self.file.tensors else None

    def get_tensor(self, name: str) -> torch.Tensor:
        expert = EXPERT.fullmatch(name)
        if expert is None:
            return self._read(name, self.gguf_name(name))
        stacked = self.gguf_name(name)  # (experts, out, in): the converter's torch.stack of each expert's
        if self._stacked[0] != stacked:  # one stacked tensor dequantized for all its experts
            self._stacked = (stacked, self._read(name, stacked))
        return self._stacked[1][int(expert[2])]

    def _read(self, name: str, stacked_or_own: str) -> torch.Tensor:
        stored = self.file.tensors[stacked_or_own]
        shape = tuple(reversed(stored.shape.tolist()))  # GGML lists the innermost dimension first
        kind = stored.tensor_type
        if kind == gguf.GGMLQuantizationType.F32:
            values = torch.from_numpy(np.array(stored.data).view(np.float32))  # a copy: the map is read-only
        elif kind == gguf.GGMLQuantizationType.F16:
            values = torch.from_numpy(np.array(stored.data).view(np.float16))
        elif kind == gguf.GGMLQuantizationType.BF16:
            values = torch.from_numpy(np.array(stored.data).view(np.int16)).view(torch.bfloat16)
        else:
            try:
                values = torch.from_numpy(gguf.quants.dequantize(stored.data, kind))
            except NotImplementedError:
                raise ValueError(f"{self.file.path}: tensor {stored.name} is {kind.name}, which gguf-py cannot "
                                 "dequantize") from None
        values = values.reshape(shape)
        self.file.reader.release(stored.data)  # copied (or dequantized) above: its pages may go
        if self.file.arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                         "k_proj.bias")):
            values = _unpermute(values, self._heads(name))
        return values

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
        return None


def _unpermute(values: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's LlamaModel.permute: within each head, rows (2, half) back from (half, 2)."""
    rows = values.shape[0]
    return values.reshape(heads, rows // heads // 2, 2, *values.shape[1:]).transpose(1, 2).reshape(values.shape)
