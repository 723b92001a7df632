"""Byte-level BPE tokenizers (GPT-2 style) trained with the `tokenizers` library, with the special
tokens the runtime needs, and the tokenizer_config.json that names them."""
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, EOS, MASK = "<|pad|>", "<|endoftext|>", "<|mask|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, EOS, MASK, IM_START, IM_END]  # ids 0..4, in this order
# A code model completes what it is given: chat turns are joined as plain text; the assistant's
# turn is an open continuation.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}# {{ m['content'] }}\n"
                 "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on `texts`; special tokens take ids 0..4."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {name: tok.token_to_id(token) for name, token in
            (("pad", PAD), ("eos", EOS), ("mask", MASK), ("im_start", IM_START), ("im_end", IM_END))}


def save_tokenizer(tok: Tokenizer, out: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    """Write tokenizer.json and a tokenizer_config.json naming the special tokens and the template."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
              "mask_token": MASK, "chat_template": chat_template, "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
