"""`kstep bench structured --engines --batch N`: the grammar's host time per constrained AR step of a
batch of N rows, against one AR step of that batch (a random model of `--step-shape`, float32)
measured in the same run.

Row i keeps the sample's i-th compiled schema (cycled) and walks a valid instance of it (the
completion search's from the grammar's start, tokenized; a row that ends its instance starts it
again), so its states are real ones. Per step, as the AR decoder does: the masks of every row at its
frontier column (`mask`), then each row's forced token asked for and its sampled token taken
through the grammar (`admit`, as constraint.py's `step` does; the token is the instance's next).
Two ways to mask, on the same trajectories, their trials interleaved: `per-row`, kstep's before
issue 44 (each row's mask computed alone, unpacked to a byte per token, stacked and applied over the
block), and `packed` (one packed bitmask filled for every row at once by llguidance's parallel
filler, applied at the frontier)."""
import statistics
import time

import torch

from kstep.structured.constraint import Constraint
from kstep.structured.grammar import Grammar
from kstep.structured.matcher import RowMatcher
from kstep.structured.search import bits, closing_bytes

PATHS = ("per-row", "packed")


def per_row_mask(constraint: Constraint, logits: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """Constraint.mask as it was before issue 44 (the baseline): a (V,) bool mask per row, stacked."""
    masks = []
    for row in constraint.rows:
        if row.is_free or row.is_closed:
            masks.append(row.allowed())
            continue
        allowed = torch.from_numpy(bits(row.tokens.compute_bitmask(), row.vocab_size).astype(bool))
        if row.trigger is not None:
            allowed[row.stop_ids] = True
        masks.append(allowed)
    allowed = torch.stack(masks).to(logits.device)  # (B, V)
    frontier = torch.tensor(constraint.frontier(), device=logits.device)[:, None]  # (B, 1)
    at_frontier = (torch.as_tensor(output_index, device=logits.device) == frontier).expand(logits.shape[:2])
    return logits.masked_fill(at_frontier[..., None] & ~allowed[:, None, :], float("-inf"))


def instances(grammars: list[Grammar]) -> list[list[int]]:
    """A valid instance of each grammar, as its model tokens (the engines bench's)."""
    found = [closing_bytes(g.matcher(g.bytes)) or b"" for g in grammars]
    return [list(g.tokens.tokenize_bytes(text)) for g, text in zip(grammars, found, strict=True)]


class BatchWalk:
    """N rows, each on its grammar's instance (module note), as one decoder batch's constraint."""

    def __init__(self, grammars: list[Grammar], tokens: list[list[int]], batch: int, vocab_size: int, stop_id: int):
        usable = [(g, t) for g, t in zip(grammars, tokens, strict=True) if t]
        self.rows = [usable[i % len(usable)] for i in range(batch)]
        self.vocab_size, self.stop_id = vocab_size, stop_id
        self.constraint = Constraint(usable[0][0], batch, 1 << 30, [stop_id], vocab_size, None)
        self.constraint.rows = [self._fresh(g) for g, _ in self.rows]
        self.offsets = [0] * batch

    def _fresh(self, grammar: Grammar) -> RowMatcher:
        return RowMatcher(grammar, [self.stop_id], self.vocab_size)

    def start_at(self, skip: int) -> None:
        """Row i advanced by (skip + i) tokens along its instance, untimed: the rows at varied states."""
        for b in range(len(self.rows)):
            for _ in range(skip + b):
                self._take(b)
                self._restart(b)

    def _take(self, b: int) -> None:
        """Row b takes its instance's next token."""
        if not self.constraint.rows[b].admit(self.rows[b][1][self.offsets[b]], 1 << 30):
            raise RuntimeError("internal: a grammar refused its own instance")
        self.offsets[b] += 1

    def _restart(self, b: int) -> None:
        """A row at its instance's end starts it again (a new request's row: untimed)."""
        if self.offsets[b] == len(self.rows[b][1]):
            self.constraint.rows[b], self.offsets[b] = self._fresh(self.rows[b][0]), 0

    def step(self, path: str, logits: torch.Tensor) -> tuple[float, float]:
        """One AR step's grammar work for the batch: (mask seconds, admit seconds: each row's forced
        token asked for, then its sampled token taken)."""
        c = self.constraint
        index = torch.tensor(c.frontier())[:, None]  # (B, 1): each row at its frontier
        start = time.perf_counter()
        (per_row_mask if path == "per-row" else Constraint.mask)(c, logits, index)
        masked = time.perf_counter()
        for b, row in enumerate(c.rows):
            row.forced()
            self._take(b)
        admitted = time.perf_counter()
        for b in range(len(self.rows)):
            self._restart(b)
        return masked - start, admitted - masked


def measure(grammars: list[Grammar], vocab_size: int, stop_id: int, batch: int, steps: int = 32,
            trials: int = 3) -> dict:
    """Per path: the median over interleaved trials of the median step's mask, admit and total seconds."""
    tokens = instances(grammars)
    logits = torch.randn(batch, 1, vocab_size)
    per_trial: dict[str, list[dict]] = {path: [] for path in PATHS}
    for trial in range(trials):
        for path in PATHS:
            walk = BatchWalk(grammars, tokens, batch, vocab_size, stop_id)
            walk.start_at(trial)
            times = [walk.step(path, logits) for _ in range(steps)]
            per_trial[path].append({"mask": statistics.median(m for m, _ in times),
                                    "admit": statistics.median(a for _, a in times),
                                    "total": statistics.median(m + a for m, a in times)})
    return {path: {key: statistics.median(t[key] for t in runs) for key in ("mask", "admit", "total")}
            for path, runs in per_trial.items()}


def ar_batch_step_seconds(shape: str, batch: int, family: str = "qwen2", context: int = 256,
                          repeats: int = 5) -> float:
    """One AR decode step of `batch` rows of a random `family` model of `shape`, float32 on the CPU."""
    from kstep.bench.passes import median_seconds, random_model
    from kstep.runner.model_runner import ModelRunner
    runner = ModelRunner(random_model(family, shape, torch.float32))
    kv = runner.allocate_kv(batch, context + 64)
    vocab = runner.cfg.vocab_size

    def make():
        ids = torch.randint(0, vocab, (batch, 1))
        return runner.causal_pass(ids, torch.full((batch, 1), context), None, context, kv)
    with torch.inference_mode():
        return median_seconds(runner, make, repeats)


def format_table(result: dict, step_seconds: float | None, batch: int, vocab_size: int) -> str:
    head = (f"| grammar per AR step, batch {batch}, vocab {vocab_size} | mask ms | admit ms | total ms |"
            + (" mask / AR step | total / AR step |" if step_seconds else "") + "\n|---|---:|---:|---:|"
            + ("---:|---:|" if step_seconds else ""))
    lines = [head]
    for path in PATHS:
        r = result[path]
        line = f"| {path} | {r['mask'] * 1e3:.2f} | {r['admit'] * 1e3:.2f} | {r['total'] * 1e3:.2f} |"
        if step_seconds:
            line += f" {r['mask'] / step_seconds:.1%} | {r['total'] / step_seconds:.1%} |"
        lines.append(line)
    return "\n".join(lines)
