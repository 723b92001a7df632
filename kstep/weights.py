"""Checkpoint I/O: config.json + safetensors (single file or sharded index) <-> `Transformer`.

Tensors are read with safetensors only (never pickle), mapped by the family's declared names,
shape-checked, and copied into parameters allocated once on the target device and dtype.
"""
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from kstep.gguf.tensors import GGUFTensors
from kstep.gguf.view import gguf_tensors
from kstep.layers.quantized import quantize_model
from kstep.models import ModelConfig, Transformer
from kstep.models.parts import Part, parts_of
from kstep.registry import BLOCK_DIFFUSION, DIFFUSION, FAMILIES, family_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]

# Mask tokens of published diffusion tokenizers: Fast-dLLM v2 names its mask id nowhere else.
MASK_TOKENS = ("|<MASK>|", "<|MASK|>", "<MASK>", "<|mask|>", "[MASK]")


def mask_id_from_tokenizer(path: Path) -> int | None:
    """The mask token's id from the tokenizer files a checkpoint ships: tokenizer_config.json's
    `mask_token` (or a known mask token's name) looked up in tokenizer.json's added tokens, in
    tokenizer_config.json's `added_tokens_decoder`, or in added_tokens.json (slow-tokenizer
    checkpoints with no tokenizer.json)."""
    names = list(MASK_TOKENS)
    config = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    named = config.get("mask_token")
    named = named.get("content") if isinstance(named, dict) else named
    names = ([named] if named else []) + names
    added: dict[str, int] = {}
    if (path / "added_tokens.json").is_file():
        added.update({k: v for k, v in read_json(path / "added_tokens.json").items() if isinstance(v, int)})
    added.update({t.get("content"): int(i) for i, t in (config.get("added_tokens_decoder") or {}).items()
                  if isinstance(t, dict) and str(i).isdigit()})
    if (path / "tokenizer.json").is_file():
        added.update({t.get("content"): t.get("id") for t in read_json(path / "tokenizer.json").get("added_tokens", [])})
    return next((added[n] for n in names if n in added), None)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def read_model_config(path: Path) -> ModelConfig:
    """Parse PATH/config.json (plus generation_config.json's eos ids) into a ModelConfig."""
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint {path}: no config.json")
    raw = read_json(path / "config.json")
    family = family_for(raw)
    try:
        cfg = family.parse_config(raw)
    except KeyError as e:
        raise ValueError(f"checkpoint {path}: config.json lacks the key {e.args[0]!r}") from None
    if cfg.mask_token_id is None and family.kind in (DIFFUSION, BLOCK_DIFFUSION):
        cfg.mask_token_id = mask_id_from_tokenizer(path)
        if cfg.mask_token_id is None:
            raise ValueError(f"checkpoint {path}: a {family.name} (diffusion) checkpoint needs a mask token id "
                             "(config.json mask_token_id, or a mask token in its tokenizer)")
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = read_json(gen_path).get("eos_token_id")
        extra = [] if eos is None else eos if isinstance(eos, list) else [eos]
        cfg.eos_token_ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
    return cfg


def _layout(cfg: ModelConfig):
    return FAMILIES[cfg.family].layout


def _tensor_files(path: Path, wanted: list[str], gguf_file: GGUFTensors | None) -> dict[str, Path]:
    """checkpoint tensor name -> file holding it (of a GGUF file: the `wanted` names it holds)."""
    if gguf_file is not None:
        return {name: gguf_file.source for name in wanted if gguf_file.gguf_name(name) is not None}
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / file for name, file in read_json(index)["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"checkpoint {path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


# A shard is reopened after this many bytes have been read from it: the pages of a memory-mapped file
# count as the process's memory while mapped, so reading a whole multi-GB shard through one mapping
# would hold the weights twice at the peak.
REOPEN_BYTES = 256 * 1024 * 1024


def load_weights(model: Transformer, path: Path, names: dict | None = None, zeros: set[str] = frozenset()) -> None:
    """Fill every parameter of `model` from the checkpoint at `path`, or raise naming what is wrong.
    Tensors are copied one at a time into the parameters, in the checkpoint's dtype converted to the
    parameter's (a bf16 checkpoint loaded as bf16 is never widened). `names`: the parts to read (a
    tensor-parallel rank's slices; default the family's whole map); `zeros`: parameters left as
    they are (zero)."""
    names = parts_of(names if names is not None else _layout(model.cfg).checkpoint_names(model.cfg))
    gguf_file = gguf_tensors(path)  # a GGUF file's view: its tensors read in place
    files = _tensor_files(path, [part.tensor for parts in names.values() for part in parts], gguf_file)
    params = {name: p for name, p in model.named_parameters() if name not in zeros}
    if set(names) != set(params):
        raise RuntimeError(f"internal: name map and model disagree on {set(names) ^ set(params)}")
    by_file: dict[Path, list[tuple[str, Part]]] = {}
    for ours, parts in names.items():
        for part in parts:
            if part.tensor not in files:
                raise ValueError(f"checkpoint {path}: missing tensor {part.tensor!r} "
                                 f"(expected shape {list(_target(params[ours], part).shape)})")
            by_file.setdefault(files[part.tensor], []).append((ours, part))
    with torch.no_grad():
        for file, wanted in by_file.items():
            wanted.sort(key=lambda item: item[1].tensor)  # neighbouring tensors sit near each other on disk
            if gguf_file is not None:  # it lets each tensor's pages go once read (gguf/tensors.py)
                with gguf_file:
                    for ours, part in wanted:
                        _copy_part(gguf_file, params[ours], part, path)
                continue
            start = 0
            while start < len(wanted):
                with safe_open(file, framework="pt") as f:
                    read = 0
                    while start < len(wanted) and read < REOPEN_BYTES:
                        ours, part = wanted[start]
                        read += _copy_part(f, params[ours], part, path)
                        start += 1


def _target(param: torch.Tensor, part: Part) -> torch.Tensor:
    """The view of `param` that `part` fills, in the tensor's orientation."""
    view = param[part.index] if part.index else param
    return view.transpose(-1, -2) if part.transpose else view


def _copy_part(f, param: torch.Tensor, part: Part, path: Path) -> int:
    whole = part.rows is None and part.cols is None
    if whole and isinstance(f, GGUFTensors) and f.read_into(part.tensor, _target(param, part)):
        return param.numel() * param.element_size()  # a quantized tensor, dequantized straight into it
    rows = slice(*part.rows) if part.rows else slice(None)
    if part.cols is not None:  # only these bytes are read: a rank never holds the whole tensor
        tensor = f.get_slice(part.tensor)[rows, part.cols[0]:part.cols[1]]
    elif part.rows is None:
        tensor = f.get_tensor(part.tensor)
    else:
        tensor = f.get_slice(part.tensor)[rows]
    target = _target(param, part)
    if tuple(tensor.shape) != tuple(target.shape):
        what = part.tensor if part.rows is None and part.cols is None else f"{part.tensor} {part.rows} x {part.cols}"
        raise ValueError(f"checkpoint {path}: tensor {what!r} has shape {list(tensor.shape)},"
                         f" expected {list(target.shape)}")
    target.copy_(tensor)
    return tensor.numel() * tensor.element_size()


def build_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, reshape=None) -> Transformer:
    """An uninitialised model on `device`/`dtype` (no random init: weights are loaded next). The
    dtype is set on the meta device, so no float32 copy is ever allocated; float32-only tensors
    (the rotary tables, a router's expert bias) stay float32. `reshape(model)`: changes the meta
    model's shapes before memory is allocated (a tensor-parallel rank's share)."""
    with torch.device("meta"):
        model = (FAMILIES[cfg.family].network or Transformer)(cfg).to(dtype)
    if reshape is not None:
        reshape(model)
    for module in model.modules():
        for name in getattr(module, "keeps_float32", ()):
            if getattr(module, name) is not None:
                setattr(module, name, nn.Parameter(getattr(module, name).float(), requires_grad=False))
    allocate(model, torch.device(device))
    model.reset_rotary(device)
    return model.eval().requires_grad_(False)


def allocate(model: nn.Module, device: torch.device) -> None:
    """Module.to_empty without its `empty_like` of meta tensors, whose first call imports
    torch.fx's symbolic shapes (1 s of start-up): each parameter and buffer gets uninitialised
    memory of its shape and dtype on `device`."""
    made: dict[int, nn.Parameter] = {}  # a parameter two modules share stays shared
    for module in model.modules():
        for group in getattr(module, "fuse_groups", ()):  # one tensor, each linear's weight a block of its rows
            linears = [getattr(module, name) for name in group]
            weights = [m.weight for m in linears]
            if all(type(m) is nn.Linear and w.shape[1:] == weights[0].shape[1:] and w.dtype == weights[0].dtype
                   and id(w) not in made for m, w in zip(linears, weights)):
                joint = torch.empty((sum(w.shape[0] for w in weights), *weights[0].shape[1:]),
                                    dtype=weights[0].dtype, device=device)
                for m, rows in zip(linears, joint.split([w.shape[0] for w in weights])):
                    made[id(m.weight)] = nn.Parameter(rows, requires_grad=m.weight.requires_grad)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                           requires_grad=p.requires_grad)
            setattr(module, name, made[id(p)])
        for name, b in list(module.named_buffers(recurse=False)):
            module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def load_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               quantize: str | None = None) -> Transformer:
    """The checkpoint's model; `quantize` (int8 / int4): each layer quantized as soon as its weights are in,
    so the load holds one layer in float at a time beside the quantized ones (a quantized GGUF file's
    model never exists whole in float32), then the rest (the LM head) as quantize_model does."""
    path = Path(path)
    model = build_model(read_model_config(path), device, dtype)
    if quantize is None:
        load_weights(model, path)
    else:
        names = _layout(model.cfg).checkpoint_names(model.cfg)
        parts = [(layer, f"layers.{i}.") for i, layer in enumerate(model.layers)] + [(model, None)]
        for module, prefix in parts:  # each layer, then what is outside them (the embedding, the head)
            ours = {k: v for k, v in names.items() if (k.startswith(prefix) if prefix else not k.startswith("layers."))}
            load_weights(model, path, ours, zeros={name for name, _ in model.named_parameters()} - set(ours))
            quantize_model(module, quantize)  # the float weights go with the replaced linears
    model.fuse_projections()
    return model


def assemble_tensors(params, names: dict, dtype: torch.dtype | None = None):
    """Yield (checkpoint tensor name, tensor) from (parameter name, tensor) pairs, each checkpoint
    tensor as soon as all its parts have come (experts unstacked, fused rows joined), on the CPU in
    `dtype`: a writer holds one parameter and the tensors not yet written, never the whole model."""
    parts, counts = parts_of(names), {}
    for plist in parts.values():
        for part in plist:
            counts[part.tensor] = counts.get(part.tensor, 0) + 1
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for ours, value in params:
        for part in parts[ours]:
            piece = _target(value.detach(), part).to("cpu", dtype or value.dtype)
            got = pieces.setdefault(part.tensor, [])
            got.append((part.rows[0] if part.rows else 0, piece))
            if len(got) == counts[part.tensor]:
                del pieces[part.tensor]
                yield part.tensor, torch.cat([t for _, t in sorted(got, key=lambda x: x[0])]).contiguous()


def checkpoint_tensors(model: Transformer, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's parameters as its family's checkpoint tensors."""
    names = _layout(model.cfg).checkpoint_names(model.cfg)
    return dict(assemble_tensors(model.named_parameters(), names, dtype))


def save_checkpoint(model: Transformer, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors in the model family's own checkpoint layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = _layout(model.cfg).to_raw_config(model.cfg)
    raw["torch_dtype"] = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(checkpoint_tensors(model, dtype), str(path / "model.safetensors"), metadata={"format": "pt"})
