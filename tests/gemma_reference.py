"""Tiny DiffusionGemma checkpoints written by transformers itself (DiffusionGemmaForBlockDiffusion's
save_pretrained), and transformers' own generate and forward to check kstep against.

The model: 3 text layers (sliding, sliding, full), 4 query heads; sliding layers head dim 8 with 2
key/value heads, the full layer head dim 16 with 1 (keys as values: no v_proj), proportional partial
rotary; a 4-expert top-2 MoE beside the dense MLP; window 8 (a prompt of 10+ tokens overflows it);
canvas 8; a byte-level BPE tokenizer. transformers initialises every norm, scale and layer scalar to
exactly one: they are perturbed (and the encoder's layer scalars made to differ from the decoder's)
so that a wrong mapping shows."""
import json
from pathlib import Path

import pytest
import torch

from kstep.random_checkpoint import CHAT_TEMPLATE, TOKENIZER_TEXT
from kstep.train.bpe import save_tokenizer, train_byte_level_bpe

pytest.importorskip("transformers")
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.generation import LogitsProcessorList, TopKLogitsWarper  # noqa: E402

CANVAS, WINDOW = 8, 8
STOP_IDS = [1, 4]  # the tokenizer's <|endoftext|> and <|im_end|>: kstep stops at both


def hf_config(vocab_size: int, init_std: float = 0.02, **text) -> DiffusionGemmaConfig:
    text_config = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                       num_global_key_value_heads=1, sliding_window=WINDOW, max_position_embeddings=512,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_experts=4,
                       top_k_experts=2, moe_intermediate_size=16, use_bidirectional_attention="vision",
                       initializer_range=init_std, **text)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=64)
    return DiffusionGemmaConfig(text_config=text_config, vision_config=vision, canvas_length=CANVAS,
                                initializer_range=init_std)


def perturb(model) -> None:
    """Norm weights, router scales and layer scalars off one; encoder scalars unlike the decoder's."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.dim() == 1 and ("norm" in name or "scale" in name or "layer_scalar" in name) \
                    and "vision" not in name and "inv_freq" not in name and "embed_scale" not in name:
                t.mul_(torch.empty(t.shape).uniform_(0.7, 1.3, generator=g))


def write_gemma_checkpoint(out: Path, init_std: float = 0.02, seed: int = 0,
                           generation: dict | None = None) -> tuple[Path, "DiffusionGemmaForBlockDiffusion"]:
    """(path, the transformers model in float32 eval mode) with tokenizer.json and a
    generation_config.json (eos ids, pad, and any `generation` entries)."""
    out = Path(out)
    tokenizer = train_byte_level_bpe([TOKENIZER_TEXT], vocab_size=320)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(hf_config(tokenizer.get_vocab_size(), init_std)).eval()
    perturb(model)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out, CHAT_TEMPLATE)
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen.update({"eos_token_id": STOP_IDS, "pad_token_id": 0, **(generation or {})})
    gen_path.write_text(json.dumps(gen, indent=2))
    return out, model


def hf_generate(model, prompts: torch.Tensor, seed: int, max_new_tokens: int, top1: bool = True, **config):
    """transformers' generate after torch.manual_seed(seed): (sequences, tokens_per_forward, the
    decoder passes of each canvas), counted with a hook on the decoder."""
    steps: list[int] = []
    hook = model.model.decoder.register_forward_hook(lambda *_: steps.append(1))
    encoder_hook = model.model.encoder.register_forward_hook(lambda *_: steps.append(0))
    processors = LogitsProcessorList([TopKLogitsWarper(top_k=1)]) if top1 else None
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(prompts, max_new_tokens=max_new_tokens, logits_processor=processors,
                                 eos_token_id=STOP_IDS, pad_token_id=0, **config)
    finally:
        hook.remove()
        encoder_hook.remove()
    per_canvas: list[int] = []  # the encoder runs once per canvas, before its decoder passes
    for is_decoder in steps:
        if is_decoder:
            per_canvas[-1] += 1
        else:
            per_canvas.append(0)
    return out.sequences[:, prompts.shape[1]:], out.tokens_per_forward, per_canvas


def hf_forward(model, prompt: torch.Tensor, canvas: torch.Tensor, sc_logits: torch.Tensor | None = None):
    """Logits (B, L, V) of one decoder pass over `canvas` after an encoder pass over `prompt`, and the cache."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    T = prompt.shape[1]
    positions = torch.arange(T, T + canvas.shape[1])[None]
    with torch.no_grad():
        out = model(input_ids=prompt, cache=cache, decoder_input_ids=canvas, self_conditioning_logits=sc_logits,
                    decoder_position_ids=positions)
    return out.logits, cache
