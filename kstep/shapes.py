"""Published models' shapes, by name: the sizes of a family's network as the real checkpoint has
them (`kstep random-checkpoint --shape NAME` writes random weights at that shape; the cost model's
floors use them without any weights). Sizes only: what the weights are is the checkpoint's.

Sources: each model's config.json (Qwen2.5-0.5B/1.5B, Qwen3-1.7B, LLaDA-8B); LLaDA2.0-mini and
LLaDA-MoE-7B-A1B from the research note (shared/research/moe_dllms.md: dFactory's config copies, the
paper); Nemotron-Labs-Diffusion-3B from its config.json as quoted by the ports that pin it (e.g. the
Rust runtime's TEXT_3B fixture, the mlx-lm AR plan: hidden 3072, 26 layers, 32/8 heads of 128).
`llada-1b` and `llada2-2b` are scaled-down layouts of LLaDA-8B / LLaDA2.0-mini (the
published layout, fewer layers and a narrower width) for measurements that must fit this machine.
"""
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Shape:
    families: tuple[str, ...]   # layouts the shape is published in (others may take it: its sizes only)
    sizes: dict = field(default_factory=dict)   # random_checkpoint.random_config keyword arguments
    note: str = ""


_QWEN_VOCAB, _LLADA2_VOCAB = 151936, 157184

SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape(("qwen2", "fast_dllm_v2", "llama", "dream"), dict(
        d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=_QWEN_VOCAB, tie=True,
        max_positions=32768), "Qwen2.5-0.5B (Fast-dLLM v2's parent family; Dream-7B is Qwen2.5-7B's layout)"),
    "qwen2.5-1.5b": Shape(("qwen2", "fast_dllm_v2", "llama"), dict(
        d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960, vocab_size=_QWEN_VOCAB, tie=True,
        max_positions=32768), "Qwen2.5-1.5B; Fast-dLLM v2 1.5B has this shape"),
    "qwen3-1.7b": Shape(("sdar",), dict(
        d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144, vocab_size=_QWEN_VOCAB,
        tie=True, max_positions=32768), "Qwen3-1.7B; SDAR-1.7B has this shape"),
    "llada-1b": Shape(("llada",), dict(
        d_model=2048, n_layers=12, n_heads=16, n_kv_heads=16, ffn_dim=6144, vocab_size=126464, max_positions=4096),
        "LLaDA-8B's layout (d 4096, 32 layers, ffn 12288) at d 2048, 12 layers, ffn 6144: 1.2B"),
    "llada2-mini": Shape(("llada2_moe",), dict(
        d_model=2048, n_layers=20, n_heads=16, n_kv_heads=4, head_dim=128, ffn_dim=5120, vocab_size=_LLADA2_VOCAB,
        num_experts=256, top_k=8, expert_dim=512, shared_dim=512, n_group=8, topk_group=4, dense_layers=1,
        max_positions=16384), "LLaDA2.0-mini (and 2.1): 16B total, 1.4B active"),
    "llada2-2b": Shape(("llada2_moe",), dict(
        d_model=1536, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=128, ffn_dim=5120, vocab_size=_LLADA2_VOCAB,
        num_experts=64, top_k=8, expert_dim=512, shared_dim=512, n_group=8, topk_group=4, dense_layers=1,
        max_positions=16384), "LLaDA2.0-mini's layout at d 1536, 12 layers, 64 experts: 2.3B total"),
    "lladamoe-7b": Shape(("llada_moe",), dict(
        d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_dim=8192, vocab_size=_LLADA2_VOCAB,
        num_experts=64, top_k=8, expert_dim=1024, max_positions=8192), "LLaDA-MoE-7B-A1B: 7B total, 1.4B active"),
    "lladamoe-1b": Shape(("llada_moe",), dict(
        d_model=1024, n_layers=8, n_heads=16, n_kv_heads=16, ffn_dim=4096, vocab_size=_LLADA2_VOCAB,
        num_experts=64, top_k=8, expert_dim=512, dense_layers=0, max_positions=8192),
        "LLaDA-MoE-7B-A1B's layout at d 1024, 8 layers (all sparse, as llama.cpp's converter takes it), experts "
        "of 512: 1.1B total, 0.4B active"),
    "nemotron-3b": Shape(("nemotron_labs_diffusion",), dict(
        d_model=3072, n_layers=26, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=9216, vocab_size=131072,
        max_positions=262144), "Nemotron-Labs-Diffusion-3B (YaRN x16 over 16384; queries 32 x 128 = 4096 > d 3072)"),
}


def shape_sizes(name: str) -> dict:
    if name not in SHAPES:
        raise ValueError(f"shape {name!r} is not known (choose from {', '.join(SHAPES)})")
    return dict(SHAPES[name].sizes)
