"""Time budgets (`time_budget`): a completion ready by a deadline, by choosing how many passes to run.

What a pass costs on this device is a per-model fit, seconds = a + b * tokens + c * tokens * attended
(a fixed cost, the weights' work per token, attention's work per token and attended position),
least squares over passes it timed, scaled at each pass width by what the passes of that width
measured against the line: a calibration on first use, then every pass `LLM.generate` runs
(`observe`, so the table follows the machine). From it, `plan` predicts a decoding's time and
picks the most passes that fit:
- a diffusion model (LLaDA, Dream: the canvas; block diffusion): its default adaptive decoding when
  even its worst case (one token per pass) fits, unchanged; otherwise the most passes per block that
  fit (at least one): LLaDA/Dream run that fixed schedule; a block model keeps its threshold with
  that many passes as a cap (each pass: everything above the threshold, at least the schedule's count);
- an AR model can only stop early: `max_tokens` is capped to what fits (finish_reason "length").
A budget below what one pass per block (AR: one token) takes is an error naming that minimum.
"""
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kstep.params import AUTOREGRESSIVE, BLOCK_DIFFUSION, GenerationParams


class PassCosts:
    """Seconds per forward pass of one model on its device, fitted to timed passes. An MoE model
    (`experts`: tokens -> distinct experts a pass of that many tokens reads per sparse layer) gets
    a fourth term, d * experts(tokens): the weights a pass reads grow with the union of the experts
    its tokens chose, which is not linear in the tokens."""

    def __init__(self, max_samples: int = 512, experts: Callable[[float], float] | None = None):
        self.experts = experts
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=max_samples)
        self._coef: torch.Tensor | None = None
        self._fitted_on = -1
        self._seen = 0
        self._ratios: list[tuple[int, float]] = []

    def observe(self, tokens: int, attended: int, seconds: float) -> None:
        self.samples.append((tokens, attended, seconds))
        self._seen += 1

    def observe_step(self, passes: list, seconds: float) -> None:
        """A step of one single-row pass (its whole step: pass, sampling, unmasking) refreshes the table."""
        if len(passes) == 1 and passes[0].ids.shape[0] == 1:
            p = passes[0]
            attended = p.mask.shape[-1] if p.mask is not None else p.ids.shape[1]
            if p.mode is not None:  # a two-mode pass (DiffusionGemma) attends to its cached prefix too
                attended = p.cache_len
            self.observe(p.ids.shape[1], attended, seconds)

    def calibrate(self, model, device: torch.device, max_positions: int, repeats: int = 3) -> None:
        """Time whole-sequence passes of a few lengths (random ids), the median of `repeats` each (a
        budget is for a typical pass: on a shared CPU the best of three runs 10-25% under it)."""
        vocab = model.cfg.vocab_size
        for length in (1, 4, 8, 16, 32, 128, 512):  # a block model's passes are 4-32 tokens
            length = min(length, max_positions)
            ids = torch.randint(0, vocab, (1, length), device=device)
            positions = torch.arange(length, device=device)[None]
            runs = []
            with torch.inference_mode():
                for _ in range(repeats + 1):  # the first warms up
                    start = time.perf_counter()
                    model(ids, positions)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    runs.append(time.perf_counter() - start)
            self.observe(length, length, statistics.median(runs[1:]))

    @property
    def is_calibrated(self) -> bool:
        return len(self.samples) >= 3

    def predict(self, tokens: float, attended: float) -> float:
        if self._fitted_on != self._seen:
            self._fit()
        line = float(sum(c * f for c, f in zip(self._coef.tolist(), self._features(tokens, attended))))
        return line * self._correction(tokens)

    def _fit(self) -> None:
        rows = torch.tensor([self._features(t, s) for t, s, _ in self.samples], dtype=torch.float64)
        seconds = torch.tensor([[x] for _, _, x in self.samples], dtype=torch.float64)
        # Least squares on relative errors (each row over its seconds: a budget cares about a pass's
        # error relative to its time, and a 512-token prefill would otherwise set the line for the
        # 1-32-token passes of decoding), then no negative terms (a cost cannot fall with more work).
        weight = 1 / seconds.clamp(min=1e-9)
        coef = torch.linalg.lstsq(rows * weight, seconds * weight).solution.squeeze(1).clamp(min=0)
        if float(coef.sum()) == 0:
            coef = torch.zeros(rows.shape[1], dtype=torch.float64)
            coef[0] = float(seconds.mean())
        self._coef, self._fitted_on = coef, self._seen
        # The line's shape is wrong where kernels change: on a CPU a pass of 4 tokens costs about
        # twice one of 1 and about what one of 16 does (bench passes). So the line is scaled by
        # its measured/fitted ratio at each token count timed, interpolated in log(tokens).
        ratios: dict[int, list[float]] = {}
        for (t, s, x), line in zip(self.samples, (rows @ coef).tolist()):
            if line > 0:
                ratios.setdefault(t, []).append(x / line)
        self._ratios = sorted((t, sum(r) / len(r)) for t, r in ratios.items())

    def _correction(self, tokens: float) -> float:
        points = self._ratios
        if not points:
            return 1.0
        if tokens <= points[0][0]:
            return points[0][1]
        for (t0, r0), (t1, r1) in zip(points, points[1:]):
            if tokens <= t1:
                w = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
                return r0 + w * (r1 - r0)
        return points[-1][1]

    def _features(self, tokens: float, attended: float) -> list[float]:
        base = [1.0, tokens, tokens * attended]
        return base if self.experts is None else base + [self.experts(tokens)]


class LoadedCosts:
    """A pass's cost when it joins a running batch whose steps take `load` seconds: the batch's step
    (its passes, every request's sampling and unmasking) plus this request's own pass."""

    def __init__(self, costs: PassCosts, load: float):
        self.costs, self.load = costs, load

    def predict(self, tokens: float, attended: float) -> float:
        return self.costs.predict(tokens, attended) + self.load


@dataclass(frozen=True, slots=True)
class Plan:
    params: GenerationParams         # resolved, what runs
    predicted_seconds: float         # the plan's predicted time (the worst case when decoding is adaptive)
    passes: int                      # the passes it plans for (the worst case when adaptive)


def predicted_seconds(costs: "PassCosts | LoadedCosts", kind: str, params: GenerationParams, prompt_len: int,
                      suffix_len: int = 0, passes: int | None = None,
                      max_tokens: int | None = None) -> tuple[float, int]:
    """(seconds, passes) of one decoding: `passes` in total (diffusion; default: one per token)."""
    n = max_tokens or params.max_tokens
    if kind == AUTOREGRESSIVE:
        seconds = costs.predict(prompt_len, prompt_len) + sum(costs.predict(1, prompt_len + i) for i in range(1, n))
        return seconds, n
    block = params.block_length
    blocks = max(1, -(-n // block))
    passes = passes if passes is not None else n + (blocks if kind == BLOCK_DIFFUSION else 0)
    if kind == BLOCK_DIFFUSION:  # a prefill, then block passes against the finished blocks (P + N/2 on average);
        attended = prompt_len + n / 2 + block  # with fused commits each block's first pass also runs the last block
        fused = blocks if params.fused_commit else 0
        return (costs.predict(prompt_len, prompt_len) + fused * costs.predict(2 * block, attended)
                + (passes - fused) * costs.predict(block, attended)), passes
    length = prompt_len + n + suffix_len
    full = costs.predict(length, length)
    if params.cache in (None, "none"):
        return passes * full, passes
    window = block if params.cache == "dual" else (n + block) / 2 + suffix_len
    return blocks * full + max(0, passes - blocks) * costs.predict(window, length), passes


MARGIN = 0.9  # plan for 90% of the budget: the fit's error on this machine is about +-10%


def plan(costs: PassCosts, kind: str, params: GenerationParams, prompt_len: int, suffix_len: int,
         budget: float, resolve, load: float = 0) -> Plan:
    """The decoding that fits `budget` seconds (module note); `resolve` re-resolves changed params;
    `load`: seconds per step of the running batch it joins (0 when idle)."""
    costs = LoadedCosts(costs, load) if load else costs
    given, budget = budget, budget * MARGIN
    worst, passes = predicted_seconds(costs, kind, params, prompt_len, suffix_len)
    if worst <= budget:
        return Plan(params, worst, passes)
    if kind == AUTOREGRESSIVE:  # the time of n tokens grows with n: the last n whose running total fits
        total, n = costs.predict(prompt_len, prompt_len), 0
        while n < params.max_tokens and total <= budget:
            n += 1
            total += costs.predict(1, prompt_len + n)
        if n == 0:
            raise ValueError(f"time_budget {given:g} s is below the {total / MARGIN:.3g} s even one token "
                             "takes here (AR: a budget can only cap max_tokens)")
        changed = resolve(replace(params, max_tokens=n, min_tokens=min(params.min_tokens, n), policy=None,
                                  is_resolved=False))
        return Plan(changed, *predicted_seconds(costs, kind, changed, prompt_len, max_tokens=n))
    bl = params.block_length
    blocks = max(1, -(-params.max_tokens // bl))
    # Fixed schedules, most passes first: k per block. A block model keeps its sub-blocks while k
    # allows one pass per sub-block at least, then unmasks the whole block (fewer passes, coarser).
    candidates = [(k, params.sub_block_length) for k in range(bl, 0, -1)]
    if kind == BLOCK_DIFFUSION:
        sub = params.sub_block_length or bl
        candidates = [(k, sub) for k in range(bl, bl // sub - 1, -1)] + [(k, bl) for k in range(bl // sub - 1, 0, -1)]
    for k, sub in candidates:
        total = k if kind == BLOCK_DIFFUSION else k * blocks  # block diffusion's steps are per block (SDAR's)
        steps_passes = k * blocks + (0 if kind != BLOCK_DIFFUSION or params.fused_commit else blocks)
        seconds, _ = predicted_seconds(costs, kind, params, prompt_len, suffix_len, passes=steps_passes)
        if seconds <= budget:
            # A block model keeps its threshold: with steps, each pass unmasks everything above it and at
            # least the schedule's count, so `total` caps its passes and confident blocks take fewer.
            keep = kind == BLOCK_DIFFUSION and params.policy is not None and params.policy.kind == "threshold"
            try:
                changed = resolve(replace(params, steps=total, threshold=params.policy.value if keep else None,
                                          factor=None, policy=None, sub_block_length=sub, is_resolved=False))
            except ValueError:  # a schedule the family does not take (Dream's cached sampler: >= 2 per block)
                continue
            return Plan(changed, seconds, steps_passes)
    minimum, _ = predicted_seconds(costs, kind, params, prompt_len, suffix_len, passes=blocks)
    raise ValueError(f"time_budget {given:g} s is below the {minimum / MARGIN:.3g} s even one pass per block "
                     "takes here")
