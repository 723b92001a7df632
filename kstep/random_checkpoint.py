"""Random-weight checkpoints in each family's real on-disk layout: tiny ones for tests and demos,
published models' shapes (kstep/shapes.py) for measuring at real sizes.

They are written exactly as a real checkpoint is (config.json + safetensors, sharded with
model.safetensors.index.json past `shard_bytes` + tokenizer.json + tokenizer_config.json, and a
generation_config.json where the family ships one or entries are asked for) and read back through
the normal loader; a DiffusionGemma one also loads in transformers (tests/test_try_families.py).
Weights are drawn one parameter at a time and written as they complete, so writing a multi-GB
checkpoint never holds the model in memory. Their output is noise.
"""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kstep.models import ModelConfig, MoEConfig, Transformer
from kstep.models.diffusion_gemma import DiffusionGemmaConfig
from kstep.models.diffusion_gemma_layers import FULL, SLIDING
from kstep.registry import AUTOREGRESSIVE, BLOCK_DIFFUSION, FAMILIES
from kstep.shapes import shape_sizes
from kstep.train.bpe import (
    EOS,
    IM_END,
    MASK,
    PAD,
    SPECIAL_TOKENS,
    save_tokenizer,
    train_byte_level_bpe,
)
from kstep.weights import assemble_tensors

# The tokenizer's training text: fixed, so the tiny checkpoints (and the tests on them) do not change
# whenever a source file does.
TOKENIZER_TEXT = """def write_random_checkpoint(out, family="llada", seed=0, **sizes):
    \"\"\"Write a random-weight checkpoint with a byte-level tokenizer into `out`; returns the path.\"\"\"
    out = Path(out)
    tokenizer = train_byte_level_bpe(corpus, vocab_size=sizes.pop("vocab_size", 500))
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.normal_(0.0, 0.5 if name == "embed.weight" else 0.2)
        else:
            p.uniform_(0.8, 1.2)  # norms: not exactly one, so a wrong norm is caught
    return out


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()
"""

# A ChatML-style template, so that tests exercise a template with end-of-turn markers.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# The MoE families' routers (kstep/layers/moe.py) and whether their checkpoints carry an expert bias.
MOE_ROUTERS = {"llada2_moe": ("sigmoid_grouped", True, True), "llada_moe": ("softmax", False, False)}
DEFAULT_SHARD_BYTES = 2 * 1024 ** 3
# Sizes a family's network has no place for: asked for explicitly, they are an error, not ignored.
MOE_SIZES = {"num_experts", "top_k", "expert_dim", "shared_dim", "n_group", "topk_group", "dense_layers"}
UNUSED_SIZES = {"llada2_moe": set(), "llada_moe": {"n_group", "topk_group"},
                "diffusion_gemma": {"shared_dim", "n_group", "topk_group", "dense_layers"}}
# Tiny block sizes (4 unless here): LLaDA2's is its released 32; Nemotron's 8 (a block's first token is
# an AR step, so 4 would leave 3 to denoise and 3 drafts to a LinearSpec round).
BLOCK_SIZES = {"llada2_moe": 32, "nemotron_labs_diffusion": 8}
GEMMA_WINDOW = GEMMA_CANVAS = 16  # a prompt of 16+ tokens overflows the window; 32 tokens: two canvases


def random_config(family: str, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                  n_kv_heads: int = 2, ffn_dim: int = 128, max_positions: int = 1024, head_dim: int | None = None,
                  tie: bool = False, num_experts: int = 8, top_k: int = 2, expert_dim: int = 32, shared_dim: int = 0,
                  n_group: int = 4, topk_group: int = 2, dense_layers: int = 1) -> ModelConfig:
    """A family's config at these sizes (the MoE sizes apply to the MoE families only: the first
    `dense_layers` layers dense, the rest sparse)."""
    if n_heads > 0 and (head_dim or d_model // n_heads) % 2:  # else a rotary shape error at the first pass
        raise ValueError(f"head_dim {head_dim or d_model // n_heads} is odd: rotary embeddings turn pairs of "
                         "dimensions (set --head-dim, or --d-model / --n-heads, to an even number)")
    if family == "diffusion_gemma":
        return gemma_config(vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, max_positions,
                            num_experts, top_k, expert_dim)
    # LLaDA/OLMo pad the embedding to a multiple of 128 rows; the padding must never be sampled.
    embedding_size = -(-vocab_size // 128) * 128 if family == "llada" else vocab_size
    entry = FAMILIES[family]
    moe = None
    if family in MOE_ROUTERS:
        router, grouped, renormalize = MOE_ROUTERS[family]
        moe = MoEConfig(num_experts, top_k, expert_dim, router, renormalize=renormalize,
                        n_group=n_group if grouped else 1, topk_group=topk_group if grouped else 1,
                        scaling=2.5 if grouped else 1.0, has_bias=grouped, shared_dim=shared_dim,
                        dense_layers=tuple(range(dense_layers)), logits_in_float32=grouped)
    head_dim = head_dim or d_model // n_heads
    rope = entry.layout.random_rope(max_positions) if hasattr(entry.layout, "random_rope") else (10000.0, None)
    return ModelConfig(
        family=family, attention=entry.attention, vocab_size=vocab_size, embedding_size=embedding_size,
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        ffn_dim=ffn_dim, norm_eps=1e-5, rope_theta=rope[0], rope_scaling=rope[1], max_positions=max_positions,
        tie_embeddings=tie,
        mask_token_id=SPECIAL_TOKENS.index(MASK) if entry.kind != AUTOREGRESSIVE else None,
        qkv_bias=family in ("qwen2", "dream", "fast_dllm_v2"), qk_norm=family in ("sdar", "llada2_moe", "llada_moe"),
        out_bias=False, rotary_dim=head_dim // 2 if family == "llada2_moe" else None, moe=moe,
        block_size=BLOCK_SIZES.get(family, 4) if entry.kind == BLOCK_DIFFUSION else None,
        pad_token_id=SPECIAL_TOKENS.index(PAD), eos_token_ids=(SPECIAL_TOKENS.index(EOS),))


def gemma_config(vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int,
                 head_dim: int | None, ffn_dim: int, max_positions: int, num_experts: int, top_k: int,
                 expert_dim: int) -> DiffusionGemmaConfig:
    """DiffusionGemma at these sizes in the released model's pattern (transformers' defaults): every
    sixth layer and the last full attention with twice the head dim, one key/value head and keys as
    values, the others sliding (window 16); a softmax top-k MoE beside the dense MLP in every layer;
    canvas 16 (at most 64 passes: the default 48 fits). `head_dim` is the sliding layers'."""
    head_dim = head_dim or d_model // n_heads
    layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    layer_types[-1] = FULL
    head_dims = tuple(head_dim if kind == SLIDING else 2 * head_dim for kind in layer_types)
    kv_heads = tuple(n_kv_heads if kind == SLIDING else 1 for kind in layer_types)
    return DiffusionGemmaConfig(
        family="diffusion_gemma", attention=FAMILIES["diffusion_gemma"].attention, vocab_size=vocab_size,
        embedding_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, ffn_dim=ffn_dim, norm_eps=1e-6, rope_theta=1e4, max_positions=max_positions,
        tie_embeddings=True, embed_scale=d_model ** 0.5, pad_token_id=SPECIAL_TOKENS.index(PAD),
        eos_token_ids=(SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(IM_END)),
        moe=MoEConfig(num_experts, top_k, expert_dim, router="softmax", shared_dim=ffn_dim),
        layer_types=tuple(layer_types), layer_head_dims=head_dims, layer_kv_heads=kv_heads,
        sliding_window=GEMMA_WINDOW, canvas_length=GEMMA_CANVAS,
        image_token_id=258880)  # the released id: outside a tiny vocabulary, so never in a prompt


SMALL_MODEL = 64_000_000  # parameters: below this a model is built in memory (the values tests have always had)


def random_parameters(cfg: ModelConfig, seed: int):
    """(name, float32 tensor) for each parameter, in order: matrices normal (std 0.2 up to 256 inputs,
    then scaled down as 1/sqrt(inputs), so large shapes keep sane activations), the embedding std
    0.5, vectors (norms, biases, DiffusionGemma's router scales and layer scalars) uniform in [0.8, 1.2]
    (not exactly one, so a wrong norm is caught; the encoder's layer scalars unlike the decoder's).
    A small model is built and initialised from the global generator seeded with `seed` (as kstep
    always wrote them, so the tiny test checkpoints keep their weights); a large one is drawn one
    parameter at a time from its own generator, never held whole."""
    small = cfg.num_params <= SMALL_MODEL
    network = FAMILIES[cfg.family].network or Transformer
    if small:
        torch.manual_seed(seed)
        model, generator = network(cfg), None  # its own init draws from the global generator first
    else:
        with torch.device("meta"):
            model = network(cfg)
        generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        value = p.data.float() if small else torch.empty(p.shape, dtype=torch.float32)
        if p.dim() == 1 or name.endswith(".scalars"):  # DiffusionGemma's (2, 1): encoder's, decoder's layer scalar
            value.uniform_(0.8, 1.2, generator=generator)
        else:
            fan_in = p.shape[-2] if name.endswith(("gate_up", "down")) else p.shape[-1]  # experts: (in, out)
            std = 0.5 if name == "embed.weight" else 0.2 * min(1.0, (256 / fan_in) ** 0.5)
            value.normal_(0.0, std, generator=generator)
        yield name, value


def write_weights(cfg: ModelConfig, out: Path, seed: int, dtype: torch.dtype, shard_bytes: int) -> int:
    """Random weights in `cfg`'s checkpoint layout, sharded past `shard_bytes`; returns the bytes."""
    names = FAMILIES[cfg.family].layout.checkpoint_names(cfg)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    files: list[str] = []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        files.append(name)

    weight_map = {}
    for tensor_name, tensor in assemble_tensors(random_parameters(cfg, seed), names, dtype):
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > shard_bytes:
            flush()
            shards[-1], size = {}, 0
        shards[-1][tensor_name] = tensor
        weight_map[tensor_name] = len(files)
        size += nbytes
        total += nbytes
    if not files:  # one file: the plain layout
        save_file(shards[-1], str(out / "model.safetensors"), metadata={"format": "pt"})
        return total
    flush()
    count = len(files)
    final = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for old, new in zip(files, final):
        (out / old).rename(out / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_random_checkpoint(out: str | Path, family: str = "llada", seed: int = 0, shape: str | None = None,
                            dtype: torch.dtype = torch.float32, shard_bytes: int = DEFAULT_SHARD_BYTES,
                            generation: dict | None = None, **sizes) -> Path:
    """Write a random-weight checkpoint with a byte-level tokenizer into `out`; returns the path.
    `shape`: a published model's sizes (kstep/shapes.py), which `sizes` may override; `generation`:
    generation_config.json entries (decoding defaults the checkpoint ships, e.g. LLaDA2.1's
    `editing_threshold`), over the family's own (DiffusionGemma's)."""
    out = Path(out)
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not known (choose from {', '.join(FAMILIES)})")
    unused = sorted(set(sizes) & UNUSED_SIZES.get(family, MOE_SIZES))
    if unused:
        raise ValueError(f"--{unused[0].replace('_', '-')}: a {family} checkpoint has no such size")
    sizes = {**(shape_sizes(shape) if shape else {}), **sizes}
    corpus = [TOKENIZER_TEXT]  # any fixed text will do: the merges only shape the tokenizer
    tokenizer = train_byte_level_bpe(corpus, vocab_size=min(sizes.get("vocab_size", 500), 500))
    cfg = random_config(family, max(sizes.pop("vocab_size", 0), tokenizer.get_vocab_size()), **sizes)
    layout = FAMILIES[family].layout
    raw = layout.to_raw_config(cfg)
    raw[getattr(layout, "DTYPE_KEY", "torch_dtype")] = str(dtype).removeprefix("torch.")
    own = layout.to_generation_config(cfg) if hasattr(layout, "to_generation_config") else {}
    generation = {**own, **(generation or {})}
    out.mkdir(parents=True, exist_ok=True)  # only now: bad sizes leave no directory behind
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_weights(cfg, out, seed, dtype, shard_bytes)
    save_tokenizer(tokenizer, out, CHAT_TEMPLATE)
    what = f"{family}, shape {shape}" if shape else family
    (out / "README.md").write_text(f"# Random weights ({what})\n\nWritten by `kstep random-checkpoint` "
                                   f"(seed {seed}). The weights are random: the output is noise.\n")
    return out
