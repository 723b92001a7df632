"""What a uniform-diffusion decoding (DiffusionGemma) costs from this device's fitted pass costs
(costs.PassCosts); planner.py picks the most decoder passes per canvas that fit, this module only counts.

A decoding of N tokens runs C = ceil(N / L) canvases of L tokens: a prefill of the prompt, then per
canvas up to K = max_denoising_steps decoder passes of L tokens against [prefix; canvas] (how many
stop earlier is data-dependent: the stable-and-confident rule), and C - 1 commit passes of L tokens.
The planner takes the worst case (K per canvas): when it fits the budget the request runs unchanged;
otherwise K becomes the largest number of passes per canvas that fits (a canvas is committed after
K passes whether or not it converged).
"""
from kstep.budget.costs import LoadedCosts, PassCosts


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
