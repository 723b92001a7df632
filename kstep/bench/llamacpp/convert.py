"""Runs llama.cpp's own converter (`convert_hf_to_gguf.py` of the built tree) on a kstep checkpoint,
as a script in a process of its own:

    python convert.py LLAMA_CPP_SRC CHECKPOINT --outfile OUT.gguf --outtype f32|bf16|q8_0

One thing is added: the converter names a byte-level BPE tokenizer's pre-tokenizer by hashing how it
splits a test string, and knows only published models' tokenizers. kstep's bundled and random
checkpoints' tokenizers split with GPT-2's regex (ByteLevel, use_regex), so an unknown hash is
named "gpt-2" instead of refused. The bench feeds both engines token ids, so the tokenizer does
not enter the comparison."""
import runpy
import sys
from pathlib import Path


def main() -> None:
    src = Path(sys.argv[1])
    sys.path.insert(0, str(src))
    sys.path.insert(0, str(src / "gguf-py"))
    import conversion.base as base

    known = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"
    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [str(src / "convert_hf_to_gguf.py")] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
