"""Writes the shipped held-out prompt set (kstep/eval/prompts.py reads it): the bundled default
model's held-out standard-library files (its recorded data split), cut into functions whose
signature + docstring is the prompt and whose body is the reference.

    python -m kstep.train.held_out_prompts
"""
import json
from pathlib import Path

from kstep.bundled import resolve_model
from kstep.eval.prompts import CODE_PROMPTS
from kstep.train import data
from kstep.train.corpus import function_examples


def write_code_prompts(out: Path = CODE_PROMPTS, model: str = "default") -> int:
    """Write the prompt set to `out`; the number of prompts written."""
    held_out = set(json.loads((resolve_model(model) / "data_split.json").read_text())["held_out"])
    files = [f for f in data.corpus_files("stdlib") if f.rel in held_out]
    examples = [e for e in function_examples(files) if 80 < len(e.prompt) < 500 and 40 < len(e.body) < 800]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for e in examples:
            f.write(json.dumps({"prompt": e.prompt, "body": e.body, "source": f"{e.file}:{e.name}"}) + "\n")
    return len(examples)


if __name__ == "__main__":
    print(write_code_prompts())
