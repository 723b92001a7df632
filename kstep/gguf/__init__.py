"""GGUF files (llama.cpp's format) as kstep checkpoints, read with ggml-org's own gguf-py: a file's
metadata becomes the config.json, tokenizer.json and tokenizer_config.json a checkpoint directory
holds (a small directory in kstep's cache, `view.py`), and its tensors are read from the file itself,
one at a time, under the names the family's Hugging Face layout gives them (`tensors.py`)."""
