"""What a step costs on this device: the time-budget planner's table (planner.py reads it).

A step is a forward pass and what the decoder does with it (sampling, unmasking): on a tiny model the
latter is most of it. seconds = a + b * tokens + c * tokens * attended (+ d * experts(tokens) for an
MoE model: a pass reads the union of the experts its tokens chose), least squares on relative errors
over the steps timed, then scaled at each pass width by the mean measured/fitted ratio there
(interpolated in log(tokens) between widths). The samples: a calibration, kept for good (whole-
sequence passes of a few lengths for the shape, then steps of a short real decoding of the model's
own family), and the steps `LLM.generate` and the engine run alone (`observe_step`), the last
PER_WIDTH of each width.

Stable: plans read a frozen fit, so the same request planned twice on an idle machine gets the same
answer. The fit is redone only when the steps drift from it: the median measured/predicted ratio of
the last WINDOW steps of one width above 1 + SLOWER or below 1 - FASTER. That width then keeps only
those steps (the machine changed: the older ones describe another machine). Noise does not move it.

The margin: a plan may predict `margin()` of its budget. A fit's error is not the whole story: a
whole request's time scatters around its prediction (on a 2-core CPU, +-10-15% for a request of a
tiny model, whose steps are milliseconds). So the margin is learnt from the requests that ran a
plan alone to (nearly) its worst case: 1 / the 95th percentile of their measured/predicted seconds,
which makes 95% of them land within budget whatever this machine's scatter (MARGIN until
OUTCOME_STEP are known; recomputed every OUTCOME_STEP requests, so plans stay put in between).
"""
import math
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from kstep.decoding.base import Decoder
from kstep.params import GenerationParams
from kstep.runner.model_runner import execute_passes

WINDOW = 32          # steps of one width whose median ratio to the fit decides a drift
SLOWER, FASTER = 0.05, 0.10  # drift: slower than the fit by 5% (budgets at risk), faster by 10% (budget wasted)
PER_WIDTH = 64       # observed steps kept per width
MAX_WIDTHS = 128     # widths kept (a prefill's width is its prompt's length): the least recently seen go
CALIBRATION_STEPS = 96   # steps of real decoding the calibration times (fewer when they take over...)
CALIBRATION_SECONDS = 3.0  # ... this long)
MARGIN = 0.9         # the share of a budget a plan may predict, until the outcomes say otherwise
OUTCOMES, OUTCOME_STEP = 64, 8  # planned requests' measured/predicted seconds kept; margin recomputed every 8
MARGIN_RANGE = (0.5, 0.95)

Sample = tuple[int, int, float]  # (tokens, attended, seconds)


class PassCosts:
    """Seconds per step of one model on its device (module note). `experts`: tokens -> distinct
    experts a pass of that many tokens reads per sparse layer (MoE), None for a dense model."""

    def __init__(self, max_samples: int = PER_WIDTH, experts: Callable[[float], float] | None = None):
        self.experts = experts
        self.per_width = max_samples
        self.calibration: list[Sample] = []
        self.observed: OrderedDict[int, deque[Sample]] = OrderedDict()
        self.request_seconds = 0.0   # a request's own cost outside its steps (its decoder, its KV cache)
        self.observed_seconds = 0.0  # the sum of every step observed (a counter for callers)
        self.refits = 0              # fits redone because the steps drifted from the table
        self._calibrating = False
        self._coef: list[float] | None = None
        self._ratios: list[tuple[int, float]] = []
        self._drift: dict[int, deque[float]] = {}
        self._lock = threading.RLock()  # the engine's thread observes while a server's planner predicts
        self.outcomes: deque[float] = deque(maxlen=OUTCOMES)
        self._margin, self._new_outcomes = MARGIN, 0

    @property
    def samples(self) -> list[Sample]:
        return self.calibration + [s for width in self.observed.values() for s in width]

    @property
    def is_calibrated(self) -> bool:
        return not self._calibrating and len(self.calibration) + sum(map(len, self.observed.values())) >= 3

    def observe(self, tokens: int, attended: int, seconds: float) -> None:
        with self._lock:
            width = self.observed.setdefault(tokens, deque(maxlen=self.per_width))
            width.append((tokens, attended, seconds))
            self.observed.move_to_end(tokens)
            if len(self.observed) > MAX_WIDTHS:
                self.observed.popitem(last=False)
            self.observed_seconds += seconds
            if self._coef is not None:
                self._check_drift(tokens, seconds / max(self._predict(tokens, attended), 1e-12))

    def margin(self) -> float:
        """The share of a budget a plan may predict (module note)."""
        return self._margin

    def observe_outcome(self, predicted: float, planned_passes: int, seconds: float, passes: int) -> None:
        """A planned request that ran alone: its predicted and measured seconds, planned and run passes.
        Only one that ran (nearly) its worst case says how far a plan's time can scatter."""
        if passes < 0.9 * planned_passes or predicted <= 0:
            return
        with self._lock:  # as if it had run every planned pass
            self.outcomes.append(seconds * planned_passes / max(passes, 1) / predicted)
            self._new_outcomes += 1
            if self._new_outcomes >= OUTCOME_STEP:
                self._new_outcomes = 0
                high = statistics.quantiles(self.outcomes, n=20, method="inclusive")[-1]  # the 95th percentile
                self._margin = min(max(1 / high, MARGIN_RANGE[0]), MARGIN_RANGE[1])

    def observe_step(self, passes: list, seconds: float) -> None:
        """A step of one single-row pass (its whole step: pass, sampling, unmasking) refreshes the table."""
        if len(passes) == 1 and passes[0].ids.shape[0] == 1:
            p = passes[0]
            attended = p.mask.shape[-1] if p.mask is not None else p.ids.shape[1]
            if p.mode is not None:  # a two-mode pass (DiffusionGemma) attends to its cached prefix too
                attended = p.cache_len
            self.observe(p.ids.shape[1], attended, seconds)

    def calibrate(self, model, device: torch.device, max_positions: int, resolve: Callable | None = None,
                  make_decoder: Callable[..., Decoder] | None = None, repeats: int = 3,
                  forward: Callable | None = None) -> None:
        """Time whole-sequence passes of a few lengths (random ids), the median of `repeats` each (a
        budget is for a typical pass: on a shared CPU the best of three runs 10-25% under it); then,
        given the model's `resolve` and `make_decoder` (LLM's), the steps of real decodings of a
        short request (calibration_request): a budget pays for steps, and on a small model a pass
        alone is a fraction of one. `forward(ids, positions)`: how a whole-sequence pass runs (default
        the model itself; a tensor-parallel model's runner, whose ranks all take part)."""
        forward = forward or model
        self._calibrating = True
        try:
            vocab = model.cfg.vocab_size
            for length in (1, 4, 8, 16, 32, 128, 512):  # a block model's passes are 4-32 tokens
                length = min(length, max_positions)
                ids = torch.randint(0, vocab, (1, length), device=device)
                positions = torch.arange(length, device=device)[None]
                runs = []
                with torch.inference_mode():
                    for _ in range(repeats + 1):  # the first warms up
                        start = time.perf_counter()
                        forward(ids, positions)
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        runs.append(time.perf_counter() - start)
                with self._lock:
                    self.calibration.append((length, length, statistics.median(runs[1:])))
            if make_decoder is not None:
                prompt, n = calibration_request(model.cfg)
                request = GenerationParams(max_tokens=n, min_tokens=n)
                self._time_decodings(lambda: make_decoder([prompt], resolve(request)))
        finally:
            self._calibrating = False
        with self._lock:
            self._fit()

    @torch.inference_mode()
    def _time_decodings(self, decoder: Callable[[], Decoder]) -> None:
        """Step fresh decoders until CALIBRATION_STEPS steps are kept or CALIBRATION_SECONDS pass (the
        first decoder's first two steps warm up, not kept); `request_seconds`: the median time to
        make one (its KV cache), what a request costs besides its steps."""
        kept, made, began, warm_up = 0, [], time.perf_counter(), 2

        def enough() -> bool:
            return kept >= CALIBRATION_STEPS or time.perf_counter() - began >= CALIBRATION_SECONDS

        while not enough():
            start = time.perf_counter()
            try:
                current = decoder()
            except ValueError:  # a context too short for the request (or its knobs refused): the passes alone
                break
            step_start = time.perf_counter()
            made.append(step_start - start)
            while not enough() and (passes := current.next_passes()):
                logits = execute_passes(passes)
                for p in passes:
                    p.runner.synchronize()
                current.update(logits)
                now = time.perf_counter()
                if warm_up:
                    warm_up -= 1
                else:
                    self.observe_step(passes, now - step_start)
                    kept += 1
                step_start = now
        self.request_seconds = statistics.median(made) if made else 0.0

    def predict(self, tokens: float, attended: float) -> float:
        with self._lock:
            if self._coef is None:
                self._fit()
            return self._predict(tokens, attended)

    def _predict(self, tokens: float, attended: float) -> float:
        line = sum(c * f for c, f in zip(self._coef, self._features(tokens, attended)))
        return line * self._correction(tokens)

    def _check_drift(self, tokens: int, ratio: float) -> None:
        """A width whose last WINDOW steps sit off the fit (module note): keep only those, refit."""
        window = self._drift.setdefault(tokens, deque(maxlen=WINDOW))
        window.append(ratio)
        if len(window) < WINDOW:
            return
        median = statistics.median(window)
        if 1 - FASTER <= median <= 1 + SLOWER:
            return
        recent = list(self.observed[tokens])[-WINDOW:]
        self.observed[tokens] = deque(recent, maxlen=self.per_width)
        self.refits += 1
        self._fit()

    def _fit(self) -> None:
        samples = self.samples
        if not samples:
            raise RuntimeError("internal: the pass-cost table has no samples (calibrate first)")
        rows = torch.tensor([self._features(t, s) for t, s, _ in samples], dtype=torch.float64)
        seconds = torch.tensor([[x] for _, _, x in samples], dtype=torch.float64)
        # Least squares on relative errors (each row over its seconds: a budget cares about a step's
        # error relative to its time, and a 512-token prefill would otherwise set the line for the
        # 1-32-token passes of decoding), then no negative terms (a cost cannot fall with more work).
        weight = 1 / seconds.clamp(min=1e-9)
        coef = torch.linalg.lstsq(rows * weight, seconds * weight).solution.squeeze(1).clamp(min=0)
        if float(coef.sum()) == 0:
            coef = torch.zeros(rows.shape[1], dtype=torch.float64)
            coef[0] = float(seconds.mean())
        self._coef = coef.tolist()
        # The line's shape is wrong where kernels change (on a CPU a pass of 4 tokens costs about twice
        # one of 1 and about what one of 16 does) and it cannot know a step's own work: so at each
        # width it is scaled by the mean measured/fitted ratio of that width's steps (of its
        # calibration passes where no step of that width ran: a pass alone is not a step).
        lines = dict(zip(samples, (rows @ coef).tolist()))
        ratios = {}
        for width in {t for t, _, _ in samples}:
            steps = list(self.observed.get(width, ())) or [s for s in self.calibration if s[0] == width]
            values = [s[2] / lines[s] for s in steps if lines[s] > 0]
            if values:  # the mean: a decoding's time is the sum of its steps (occasional slow ones too)
                ratios[width] = statistics.fmean(values)
        self._ratios = sorted(ratios.items())
        self._drift.clear()  # windows measured against the old fit

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


def calibration_request(cfg) -> tuple[list[int], int]:
    """(prompt ids, max_tokens) of a short request whose decoding shows a family's steps: a prompt
    past one block (a prefill, then a partial block) and two blocks or more (commits, fused or not)."""
    block = cfg.block_size or 0
    avoid = {cfg.mask_token_id, cfg.image_token_id, *cfg.eos_token_ids}
    ordinary = [i for i in range(min(cfg.vocab_size, 4096)) if i not in avoid]
    return [ordinary[(7 + 3 * k) % len(ordinary)] for k in range(block + 3 if block else 16)], max(2 * block, 32)


class LoadedCosts:
    """A pass's cost when it joins a running batch whose steps take `load` seconds: the batch's step
    (its passes, every request's sampling and unmasking) plus this request's own pass."""

    def __init__(self, costs: PassCosts, load: float):
        self.costs, self.load = costs, load

    @property
    def request_seconds(self) -> float:
        return self.costs.request_seconds

    def margin(self) -> float:
        return self.costs.margin()

    def predict(self, tokens: float, attended: float) -> float:
        return self.costs.predict(tokens, attended) + self.load
