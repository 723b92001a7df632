"""Sequence-level distillation data (Kim & Rush 2016, arXiv:1606.07947; dParallel, d3LLM): an AR
teacher's own greedy completions of training-split prompts, for a diffusion student. Deterministic
targets (one completion per prompt, the teacher's most likely) are what let a student become sure
enough to unmask several tokens per pass.

The prompts are the training split's documented functions (signature + docstring, as the
benchmarks' held-out prompts are built). A completion is cut where the function ends (as `kstep
eval` cuts it), at a token boundary of the teacher's own tokens, and kept for training when prompt +
completion parses. Rows are appended as JSONL as they are made, so a stopped run resumes where it
left off.
"""
import ast
import json
import random
from pathlib import Path

from tqdm import tqdm

from kstep.eval.metrics import function_part
from kstep.train.corpus import function_examples
from kstep.train.data import corpus_files


def training_prompts(corpus: str = "stdlib", seed: int = 0, max_body_lines: int = 3) -> list[str]:
    """The training split's function prompts, deduplicated, in a fixed shuffled order: every
    documented function's signature + docstring, and the same followed by its first 1..max_body_lines
    body lines (the teacher continues from there: more targets from the same functions)."""
    prompts = set()
    for ex in function_examples([f for f in corpus_files(corpus) if not f.is_held_out], min_body_lines=1):
        prompts.add(ex.prompt)
        lines = ex.body.split("\n")  # the body starts with the newline that ends the docstring line
        for k in range(1, max_body_lines + 1):
            if len(lines) > k + 1 and lines[k].strip():
                prompts.add(ex.prompt + "\n".join(lines[:k + 1]))
    prompts = sorted(prompts)
    random.Random(seed).shuffle(prompts)
    return prompts


def parses(prompt: str, completion: str) -> bool:
    try:
        ast.parse(prompt + completion)
    except (SyntaxError, ValueError):
        return False
    return True


def function_tokens(tokenizer, prompt: str, token_ids: list[int]) -> list[int]:
    """The leading tokens that spell the function's body (where `function_part` cuts the text); []
    when the cut falls inside a token."""
    body = function_part(prompt, tokenizer.decode(token_ids))
    for k in range(len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:k])
        if text == body:
            return token_ids[:k]
        if len(text) > len(body):
            return []
    return []


def distill(teacher: str, out: Path, max_tokens: int, batch_size: int, limit: int | None = None,
            corpus: str = "stdlib") -> Path:
    """Append the teacher's greedy completions of the training prompts to `out` (JSONL)."""
    from kstep.llm import load
    llm = load(teacher)
    prompts = training_prompts(corpus)[:limit]
    done = sum(1 for _ in open(out)) if out.is_file() else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f, tqdm(total=len(prompts), initial=done, desc="distill", unit="prompt") as bar:
        for start in range(done, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            # As ids the student will see: token healing would give text back and the rows would repeat it.
            results = llm.generate(batch, max_tokens=max_tokens, temperature=0.0, token_healing=False)
            for prompt, result in zip(batch, results, strict=True):
                ids = function_tokens(llm.tokenizer, prompt, result.token_ids)
                text = llm.tokenizer.decode(ids)
                row = {"prompt": prompt, "completion": text, "prompt_ids": llm.encode_prompt(prompt),
                       "completion_ids": ids, "finish_reason": result.finish_reason,
                       "parses": len(ids) > 0 and parses(prompt, text)}
                f.write(json.dumps(row) + "\n")
            f.flush()
            bar.update(len(batch))
    return out
