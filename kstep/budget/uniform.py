"""Time budgets for uniform diffusion (DiffusionGemma): what a decoding costs from this device's
fitted pass costs (budget.PassCosts), and the most decoder passes per canvas that fit.

A decoding of N tokens runs C = ceil(N / L) canvases of L tokens: a prefill of the prompt, then per
canvas up to K = max_denoising_steps decoder passes of L tokens against [prefix; canvas] (how many
stop earlier is data-dependent: the stable-and-confident rule), and C - 1 commit passes of L tokens.
The planner takes the worst case (K per canvas): when it fits the budget the request runs unchanged;
otherwise K becomes the largest number of passes per canvas that fits (a canvas is committed after
K passes whether or not it converged).
"""
from dataclasses import replace

from kstep.budget.planner import LoadedCosts, PassCosts, Plan
from kstep.params import GenerationParams


def uniform_seconds(costs: "PassCosts | LoadedCosts", prompt_len: int, n: int, canvas_length: int,
                    steps: int) -> tuple[float, int]:
    """(seconds, passes) of a decoding with `steps` decoder passes in every canvas."""
    canvases = max(1, -(-n // canvas_length))
    attended = prompt_len + (canvases - 1) * canvas_length / 2 + canvas_length  # the mean over canvases
    per_pass = costs.predict(canvas_length, attended)
    # A commit is an encoder pass of L tokens (no logits, no sampling): costed as a decoder pass, its upper bound.
    passes = canvases * steps + canvases - 1
    seconds = costs.request_seconds + costs.predict(prompt_len, prompt_len) + passes * per_pass
    return seconds, 1 + passes


def plan_uniform(costs: PassCosts, params: GenerationParams, prompt_len: int, canvas_length: int, budget: float,
                 resolve, load: float = 0) -> Plan:
    """The decoding that fits `budget` seconds (module note); `resolve` re-resolves changed params."""
    costs = LoadedCosts(costs, load) if load else costs
    margin = costs.margin()
    given, budget = budget, budget * margin
    for steps in range(params.max_denoising_steps, 0, -1):
        seconds, passes = uniform_seconds(costs, prompt_len, params.max_tokens, canvas_length, steps)
        if seconds <= budget:
            if steps == params.max_denoising_steps:
                return Plan(params, seconds, passes)
            changed = resolve(replace(params, max_denoising_steps=steps, is_resolved=False))
            return Plan(changed, seconds, passes)
    minimum, _ = uniform_seconds(costs, prompt_len, params.max_tokens, canvas_length, 1)
    raise ValueError(f"time_budget {given:g} s is below the {minimum / margin:.3g} s even one decoder pass per "
                     "canvas takes here")
