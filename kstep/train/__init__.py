"""`kstep train`: the tools that make the bundled models (corpus, tokenizer, objectives, loop)."""
