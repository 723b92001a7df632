"""Token streams for training: files tokenized once, joined with end-of-sequence, sampled as windows."""
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from kstep.train.corpus import (
    HELD_OUT_PERCENT,
    CorpusFile,
    function_examples,
    read_text,
    stdlib_files,
)


def corpus_files(corpus: str) -> list[CorpusFile]:
    """'stdlib' (the interpreter's standard library) or a directory of .py / .txt files."""
    if corpus == "stdlib":
        return stdlib_files()
    root = Path(corpus)
    if not root.is_dir():
        raise ValueError(f"--corpus {corpus!r} is neither 'stdlib' nor a directory")
    files = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".txt")):
        rel = path.relative_to(root).as_posix()
        bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100
        files.append(CorpusFile(path, rel, bucket < HELD_OUT_PERCENT))
    if not files:
        raise ValueError(f"--corpus {corpus!r} holds no .py or .txt files")
    return files


def texts(files: list[CorpusFile]) -> list[str]:
    return [t for t in (read_text(f.path) for f in files) if t]


def tokenize(tok: Tokenizer, docs: list[str], eos_id: int) -> np.ndarray:
    """All documents as one uint16 stream, each followed by end-of-sequence."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16 if tok.get_vocab_size() < 65536 else np.int32)


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len) windows at uniformly random offsets."""
    if len(stream) <= seq_len:
        raise ValueError(f"the corpus has {len(stream)} tokens, fewer than one window of {seq_len}")
    starts = rng.integers(0, len(stream) - seq_len, size=batch)
    return torch.from_numpy(np.stack([stream[s: s + seq_len] for s in starts]).astype(np.int64))


def fixed_windows(stream: np.ndarray, count: int, seq_len: int) -> torch.Tensor:
    """Up to `count` evenly spaced, non-overlapping windows: a fixed held-out set."""
    count = max(1, min(count, len(stream) // seq_len))
    starts = np.linspace(0, len(stream) - seq_len, count).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s: s + seq_len] for s in starts]).astype(np.int64))


def padded_pairs(pairs, eos_id: int, seq_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(prompt ids, completion ids) pairs as training rows: prompt, completion, end-of-sequence, then
    end-of-sequence padding to seq_len (LLaDA's SFT padding). Returns (tokens (N, seq_len),
    prompt_lengths (N,)), or None when no pair fits; a prompt leaving under 8 tokens of room is skipped."""
    rows, prompt_lengths = [], []
    for prompt, completion in pairs:
        if len(prompt) >= seq_len - 8:
            continue
        ids = (prompt + completion + [eos_id])[:seq_len]
        rows.append(ids + [eos_id] * (seq_len - len(ids)))
        prompt_lengths.append(len(prompt))
    if not rows:
        return None
    return np.asarray(rows, dtype=np.int64), np.asarray(prompt_lengths, dtype=np.int64)


def function_pairs(tok: Tokenizer, files: list[CorpusFile], eos_id: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt/completion rows for the prompt/completion objective: signature + docstring, then the body
    (`padded_pairs`)."""
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    pairs = padded_pairs(((encode(ex.prompt), encode(ex.body)) for ex in function_examples(files)), eos_id, seq_len)
    if pairs is None:
        raise ValueError("the corpus has no documented functions for the prompt/completion objective")
    return pairs


def distill_pairs(path: Path, eos_id: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `kstep distill`'s JSONL ({prompt_ids, completion_ids}) that parse (`padded_pairs`)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    pairs = padded_pairs(((r["prompt_ids"], r["completion_ids"]) for r in rows if r.get("parses", True)),
                         eos_id, seq_len)
    if pairs is None:
        raise ValueError(f"--distill-data {path}: no usable rows")
    return pairs
