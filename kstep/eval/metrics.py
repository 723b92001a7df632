"""Quality metrics on (prompt, completion) pairs of Python code.

- parses: the prompt joined with the completion's complete lines is valid Python (a fixed-length
  canvas usually ends mid-line, so the last partial line is dropped);
- judge NLL: an AR model's per-token negative log-likelihood of the completion given the prompt
  (generative perplexity, as the MDLM/SEDD papers report it);
- distinct ratio: distinct tokens / tokens, low for degenerate repetition;
- exact match and edit distance to the held-out body, after cutting the completion where the
  function ends (the first non-blank line back at the prompt's indentation or less).
"""
import ast

import torch

from kstep.llm import LLM


def parses(prompt: str, completion: str) -> bool:
    """prompt + the completion's complete lines is Python, and the completion has code in it (an
    empty body would parse only thanks to the `pass` this check adds for a body cut mid-block)."""
    body = completion if completion.endswith("\n") else completion[: completion.rfind("\n") + 1]
    if not body.strip():
        return False
    for candidate in (prompt + body, prompt + body + "    pass\n"):
        try:
            ast.parse(candidate)
            return True
        except (SyntaxError, ValueError):
            continue
    return False


def distinct_ratio(token_ids: list[int]) -> float:
    return len(set(token_ids)) / len(token_ids) if token_ids else 0.0


@torch.inference_mode()
def judge_nll(judge: LLM, prompt_ids: list[int], completion_ids: list[int]) -> float | None:
    """Mean NLL (nats/token) the AR judge assigns to completion_ids after prompt_ids."""
    if not completion_ids:
        return None
    ids = torch.tensor([prompt_ids + completion_ids], device=judge.device)
    positions = torch.arange(ids.shape[1], device=judge.device)[None]
    logits = judge.model(ids[:, :-1], positions[:, :-1]).float()  # (1, T-1, V)
    targets = ids[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits[0], targets[0], reduction="none")
    return float(nll[len(prompt_ids) - 1:].mean())


def function_part(prompt: str, completion: str) -> str:
    """The completion up to where the function ends: the first non-blank line indented no deeper
    than the prompt's first line (a new def, class or statement at that level)."""
    first = prompt.lstrip("\n").splitlines()[0] if prompt.strip() else ""
    base = len(first) - len(first.lstrip())
    lines = completion.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if i == 0 and not prompt.endswith("\n"):
            continue  # the rest of the prompt's last line
        if line.strip() and len(line) - len(line.lstrip()) <= base:
            return "".join(lines[:i])
    return completion


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between two strings (characters)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def normalized_edit_distance(a: str, b: str) -> float:
    """Edit distance / the longer length: 0 identical, 1 nothing in common."""
    return edit_distance(a, b) / max(len(a), len(b), 1)
