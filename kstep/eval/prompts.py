"""Prompt sets for `kstep eval` and the benchmarks: JSONL files a user gives, and the shipped default:
held-out standard-library functions, signature + docstring as the prompt and the real body as the
reference, from files the bundled models never trained on (their recorded data split). The default
ships as `kstep/bundled/prompts/code_prompts.jsonl`, written by `python -m kstep.train.held_out_prompts`,
so every machine gets the same set."""
import json
from pathlib import Path

CODE_PROMPTS = Path(__file__).resolve().parents[1] / "bundled" / "prompts" / "code_prompts.jsonl"


def prompt_rows(path: str | None, count: int | None) -> list[dict]:
    """The first `count` rows of a prompt file (default: the shipped held-out functions)."""
    if count is not None and count <= 0:
        raise ValueError(f"--num-prompts must be positive, got {count}")
    if path is not None and not Path(path).is_file():
        raise ValueError(f"--prompts {path!r}: no such file")
    rows = read_prompt_file(path or CODE_PROMPTS)
    return rows[:count] if count else rows


def read_prompt_file(path: str | Path) -> list[dict]:
    """JSONL, one object per line with at least "prompt" (str); HumanEval files also carry
    "task_id", "test" and "entry_point"."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path}:{number}: each line must be an object with a non-empty 'prompt' string")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def held_out_code_prompts(count: int | None = None) -> list[str]:
    """The shipped held-out prompts (the first `count`, or all)."""
    rows = read_prompt_file(CODE_PROMPTS)
    return [r["prompt"] for r in rows[:count]]
