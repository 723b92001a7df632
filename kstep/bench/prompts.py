"""The benchmarks' default prompts: held-out standard-library functions (signature + docstring),
from the files the bundled models never trained on (their recorded data split)."""
import json

from kstep.bundled import resolve_model


def held_out_code_prompts(count: int, min_chars: int = 80, max_chars: int = 400, model: str = "default") -> list[str]:
    from kstep.train import data
    from kstep.train.corpus import function_examples
    split = resolve_model(model) / "data_split.json"
    if not split.is_file():
        raise FileNotFoundError(f"{split} is missing: held-out prompts need a trained model's data split")
    held_out = set(json.loads(split.read_text())["held_out"])
    files = [f for f in data.corpus_files("stdlib") if f.rel in held_out]
    examples = [e.prompt for e in function_examples(files) if min_chars < len(e.prompt) < max_chars]
    if len(examples) < count:
        raise ValueError(f"only {len(examples)} held-out prompts of {min_chars}-{max_chars} characters, not {count}")
    step = len(examples) / count  # spread over the files, not the first few
    return [examples[int(i * step)] for i in range(count)]
