"""Quality metrics on (prompt, completion) pairs of Python code.

- parses: the prompt joined with the completion's complete lines is valid Python (a fixed-length
  canvas usually ends mid-line, so the last partial line is dropped);
- judge NLL: an AR model's per-token negative log-likelihood of the completion given the prompt
  (generative perplexity, as the MDLM/SEDD papers report it);
- distinct ratio: distinct tokens / tokens, low for degenerate repetition.
"""
import ast

import torch

from kstep.llm import LLM


def parses(prompt: str, completion: str) -> bool:
    body = completion if completion.endswith("\n") else completion[: completion.rfind("\n") + 1]
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
