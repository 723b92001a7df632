"""Small random-weight checkpoints in each family's real on-disk layout, for tests and demos.

They are written exactly as a real checkpoint is (config.json + model.safetensors + tokenizer.json
+ tokenizer_config.json) and read back through the normal loader. Their output is noise.
"""
from pathlib import Path

import torch

from kstep.models import ModelConfig, Transformer
from kstep.registry import AUTOREGRESSIVE, BLOCK_DIFFUSION, FAMILIES
from kstep.train.bpe import (
    EOS,
    MASK,
    PAD,
    SPECIAL_TOKENS,
    save_tokenizer,
    train_byte_level_bpe,
)
from kstep.weights import save_checkpoint

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


def tiny_config(family: str, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                n_kv_heads: int = 2, ffn_dim: int = 128, max_positions: int = 1024) -> ModelConfig:
    # LLaDA/OLMo pad the embedding to a multiple of 128 rows; the padding must never be sampled.
    embedding_size = -(-vocab_size // 128) * 128 if family == "llada" else vocab_size
    entry = FAMILIES[family]
    return ModelConfig(
        family=family, attention=entry.attention, vocab_size=vocab_size, embedding_size=embedding_size,
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=d_model // n_heads,
        ffn_dim=ffn_dim, norm_eps=1e-5, rope_theta=10000.0, max_positions=max_positions,
        mask_token_id=SPECIAL_TOKENS.index(MASK) if entry.kind != AUTOREGRESSIVE else None,
        qkv_bias=family in ("qwen2", "dream", "fast_dllm_v2"), qk_norm=family == "sdar",
        block_size=4 if entry.kind == BLOCK_DIFFUSION else None, pad_token_id=SPECIAL_TOKENS.index(PAD), eos_token_ids=(SPECIAL_TOKENS.index(EOS),))


def write_random_checkpoint(out: str | Path, family: str = "llada", seed: int = 0, **sizes) -> Path:
    """Write a random-weight checkpoint with a byte-level tokenizer into `out`; returns the path."""
    out = Path(out)
    corpus = [TOKENIZER_TEXT]  # any fixed text will do: the merges only shape the tokenizer
    tokenizer = train_byte_level_bpe(corpus, vocab_size=sizes.pop("vocab_size", 500))
    cfg = tiny_config(family, tokenizer.get_vocab_size(), **sizes)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 if name == "embed.weight" else 0.2)
            else:
                p.uniform_(0.8, 1.2)  # norms: not exactly one, so a wrong norm is caught
    save_checkpoint(model, out)
    save_tokenizer(tokenizer, out, CHAT_TEMPLATE)
    (out / "README.md").write_text(f"# Random weights ({family})\n\nWritten by `kstep random-checkpoint` "
                                   f"(seed {seed}). The weights are random: the output is noise.\n")
    return out
