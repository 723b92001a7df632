"""Time budgets (`time_budget`): a completion ready by a deadline, by choosing how many passes to run.

What a step costs on this device is a per-model fitted table (pass_costs.PassCosts: a calibration on
first use, then the steps `LLM.generate` and the engine run alone; refitted only when they drift
from it, so the same request gets the same answer). From it, `plan` predicts a decoding's time at
its worst case, counted as the family's decoder runs it, and picks the most passes that fit the
share of the budget the requests planned so far say is safe (PassCosts.margin: 90% at first):
- a canvas diffusion model (LLaDA, Dream): its default adaptive decoding when even its worst case
  (one token per pass) fits, unchanged; otherwise the most passes per block that fit, a fixed schedule;
- a block model (SDAR, Fast-dLLM v2, LLaDA2): the same, counted by block.py (its prefill,
  every block's passes and commits, LLaDA2.1's editing passes); coarser means a pass cap per block
  (`steps`, its threshold kept) and, with token editing, fewer post steps first (max_post_steps to 0);
- DiffusionGemma: counted by uniform.py (decoder passes per canvas); coarser means fewer passes per
  canvas (`max_denoising_steps`);
- an AR model can only stop early: `max_tokens` is capped to what fits (finish_reason "length");
  Nemotron-Labs-Diffusion: its `diffusion` mode as a block model (block.causal_context_run),
  `ar` as AR, `linear_spec` as AR at two passes of its block per token (no draft kept).
A budget below what the coarsest setting takes (one pass per block; AR: one token) is an error
naming that minimum: the same number that decides, so a budget above it is always accepted.
"""
from collections.abc import Callable
from dataclasses import dataclass, replace

from kstep.budget.block import BlockRun, coarser_settings, worst_run
from kstep.budget.costs import MARGIN, LoadedCosts, PassCosts
from kstep.budget.uniform import uniform_seconds
from kstep.params import GenerationParams, knob_applies, user_knobs
from kstep.registry import AUTOREGRESSIVE, BLOCK_DIFFUSION, SELF_SPECULATION, UNIFORM_DIFFUSION, BlockRules, Family

__all__ = ["MARGIN", "LoadedCosts", "PassCosts", "Plan", "plan", "predicted_seconds", "run_seconds"]

@dataclass(frozen=True, slots=True)
class Plan:
    params: GenerationParams         # resolved, what runs
    predicted_seconds: float         # the plan's predicted time (the worst case when decoding is adaptive)
    passes: int                      # the passes it plans for (the worst case when adaptive)


Costs = PassCosts | LoadedCosts


def run_seconds(costs: Costs, run: BlockRun) -> float:
    """Predicted seconds of a request that runs `run`'s passes."""
    return costs.request_seconds + sum(count * costs.predict(t, a) for t, a, count in run.groups)


def predicted_seconds(costs: Costs, kind: str, params: GenerationParams, prompt_len: int,
                      suffix_len: int = 0, passes: int | None = None, max_tokens: int | None = None,
                      rules: BlockRules | None = None, max_positions: int | None = None) -> tuple[float, int]:
    """(seconds, passes) of one decoding at its worst: `passes` in total for a canvas model (default:
    one per token, or its fixed schedule's); `rules`: a block model's."""
    n = max_tokens or params.max_tokens
    if kind == AUTOREGRESSIVE:
        seconds = costs.predict(prompt_len, prompt_len) + sum(token_seconds(costs, params, prompt_len + i)
                                                              for i in range(1, n))
        return costs.request_seconds + seconds, n
    if kind == BLOCK_DIFFUSION:
        run = worst_run(params, prompt_len, rules, max_positions)
        return run_seconds(costs, run), run.passes
    block = params.block_length
    blocks = max(1, -(-n // block))
    if passes is None:
        passes = params.steps if params.policy is not None and params.policy.kind == "fixed" else n
    length = prompt_len + n + suffix_len
    full = costs.predict(length, length)
    if params.cache in (None, "none"):
        return costs.request_seconds + passes * full, passes
    window = block if params.cache == "dual" else (n + block) / 2 + suffix_len
    return costs.request_seconds + blocks * full + max(0, passes - blocks) * costs.predict(window, length), passes


def token_seconds(costs: Costs, params: GenerationParams, attended: int) -> float:
    """An AR token after the first at worst: one pass of one token; with LinearSpec (a tri-mode model's
    self-speculation), a round that keeps no draft: a draft pass and a verification of its whole block."""
    if params.mode != SELF_SPECULATION or not params.num_draft_tokens:
        return costs.predict(1, attended)
    block = params.num_draft_tokens + 1
    return 2 * costs.predict(block, attended + block - 1)


def unresolved(params: GenerationParams, **changes) -> GenerationParams:
    """Resolved params with some knobs changed, to be resolved again."""
    return replace(params, **changes, policy=None, is_resolved=False)


def family_resolver(resolve: Callable, family: str, kind: str) -> Callable:
    """`resolve` for changed params: the knobs the resolver filled in that the family does not take
    (a block model's cache "none") go back to their defaults first, or re-resolving refuses them."""
    if not family:
        return resolve
    inapplicable = {f.name: f.default for f in user_knobs() if not knob_applies(f.name, family, kind)}
    return lambda params: resolve(replace(params, **inapplicable))


def plan(costs: PassCosts, family: Family, params: GenerationParams, prompt_len: int, suffix_len: int,
         budget: float, resolve, load: float = 0, max_positions: int | None = None,
         canvas_length: int | None = None) -> Plan:
    """The decoding of `family` under resolved `params` that fits `budget` seconds, for every kind
    (module note); `resolve` re-resolves changed params; `load`: seconds per step of the running
    batch it joins (0 when idle); `max_positions` and `canvas_length`: the model's (a block model's
    commits and a uniform model's canvases depend on them)."""
    kind = family.kind_for(params.mode)
    costs = LoadedCosts(costs, load) if load else costs
    resolve = family_resolver(resolve, family.name, kind)
    if kind == BLOCK_DIFFUSION:
        return plan_block(costs, params, prompt_len, budget, resolve, family.block_rules, max_positions)
    if kind == UNIFORM_DIFFUSION:
        return plan_uniform(costs, params, prompt_len, canvas_length, budget, resolve)
    margin = costs.margin()
    given, budget = budget, budget * margin
    worst, passes = predicted_seconds(costs, kind, params, prompt_len, suffix_len)
    if worst <= budget:
        return Plan(params, worst, passes)
    if kind == AUTOREGRESSIVE:  # the time of n tokens grows with n: the last n whose running total fits
        total, n = costs.request_seconds + costs.predict(prompt_len, prompt_len), 0
        while n < params.max_tokens and total <= budget:
            n += 1
            total += token_seconds(costs, params, prompt_len + n)
        if n == 0:
            raise ValueError(f"time_budget {given:g} s is below the {total / margin:.3g} s even one token "
                             "takes here (AR: a budget can only cap max_tokens)")
        changed = resolve(unresolved(params, max_tokens=n, min_tokens=min(params.min_tokens, n)))
        return Plan(changed, *predicted_seconds(costs, kind, changed, prompt_len, max_tokens=n))
    bl = params.block_length
    blocks = max(1, -(-params.max_tokens // bl))
    minimum = float("inf")
    for k in range(bl, 0, -1):  # a fixed schedule of k passes per block, most passes first
        seconds, _ = predicted_seconds(costs, kind, params, prompt_len, suffix_len, passes=k * blocks)
        minimum = min(minimum, seconds)
        if seconds <= budget:
            try:
                changed = resolve(unresolved(params, steps=k * blocks, threshold=None, factor=None))
            except ValueError:  # a schedule the family does not take (Dream's cached sampler: >= 2 per block)
                continue
            return Plan(changed, seconds, k * blocks)
    raise ValueError(f"time_budget {given:g} s is below the {minimum / margin:.3g} s even one pass per block "
                     "takes here")


def plan_block(costs: Costs, params: GenerationParams, prompt_len: int, budget: float, resolve, rules: BlockRules,
               max_positions: int | None) -> Plan:
    """A block model's plan: its decoding unchanged when its worst case fits, else the first of the
    coarser settings (block.coarser_settings, each with fewer passes at worst) that fits."""
    margin = costs.margin()
    given, budget = budget, budget * margin
    run = worst_run(params, prompt_len, rules, max_positions)
    seconds = run_seconds(costs, run)
    if seconds <= budget:
        return Plan(params, seconds, run.passes)
    minimum, fewest = seconds, run.passes
    for alternatives in coarser_settings(params):
        changed = first_taken(resolve, params, alternatives)
        run = worst_run(changed, prompt_len, rules, max_positions)
        if run.passes >= fewest:  # no fewer passes than a setting tried already (e.g. steps = bs)
            continue
        seconds, fewest = run_seconds(costs, run), run.passes
        if seconds <= budget:
            return Plan(changed, seconds, run.passes)
        minimum = min(minimum, seconds)
    raise ValueError(f"time_budget {given:g} s is below the {minimum / margin:.3g} s even one pass per block "
                     "takes here")


def first_taken(resolve, params: GenerationParams, alternatives: tuple[dict, ...]) -> GenerationParams:
    """The first of the alternative changes to `params` the family's resolver takes (LLaDA2.1's
    token editing takes no `steps`: then the pass cap without editing)."""
    for i, changes in enumerate(alternatives):
        try:
            return resolve(unresolved(params, **changes))
        except ValueError:
            if i == len(alternatives) - 1:
                raise
    raise RuntimeError("internal: no alternatives")


def plan_uniform(costs: Costs, params: GenerationParams, prompt_len: int, canvas_length: int, budget: float,
                 resolve) -> Plan:
    """A uniform-diffusion plan: its decoding unchanged when its worst case (every canvas runs
    max_denoising_steps passes) fits, else the most decoder passes per canvas that fit."""
    margin = costs.margin()
    given, budget = budget, budget * margin
    for steps in range(params.max_denoising_steps, 0, -1):
        seconds, passes = uniform_seconds(costs, prompt_len, params.max_tokens, canvas_length, steps)
        if seconds <= budget:
            if steps == params.max_denoising_steps:
                return Plan(params, seconds, passes)
            return Plan(resolve(unresolved(params, max_denoising_steps=steps)), seconds, passes)
    minimum, _ = uniform_seconds(costs, prompt_len, params.max_tokens, canvas_length, 1)
    raise ValueError(f"time_budget {given:g} s is below the {minimum / margin:.3g} s even one decoder pass per "
                     "canvas takes here")
