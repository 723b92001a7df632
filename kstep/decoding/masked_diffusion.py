"""Masked-diffusion decoding: LLaDA's sampler (arXiv:2502.09992; ML-GSAI/LLaDA `generate.py`) and
Fast-dLLM's accelerations (arXiv:2505.22618; NVlabs/Fast-dLLM `llada/generate.py`).

The canvas is `prompt + max_tokens` masks, decoded semi-autoregressively in blocks. Each step
proposes a token for every masked position of the current block (argmax, or Gumbel-max at
temperature > 0), scores it with the unmask rule, and unmasks the positions the policy picks:
the linear schedule's count (`fixed`, the exact sampler), every position above a confidence
`threshold`, or Fast-dLLM's `factor` rule. A block ends when it has no masks; unmasked tokens are
never re-masked. Positions outside the current block can never be unmasked, so logits are only
computed for the block. The mask token itself is never proposed (the references could write it
back into a masked position and leave a mask in the output).

Cache modes (Fast-dLLM): `none` runs the whole canvas every step; `prefix` and `dual` run one full
pass at each block start that stores every position's keys/values, then each step runs only
[block start, end of canvas) (`prefix`) or the block alone (`dual`, the suffix's keys/values reused
from the block start) against the cache.

Early stop: once a row has an end-of-sequence token with nothing masked before it, the rest of its
canvas can no longer change its completion; its masks become that token. Once every row of the
batch is final (or its blocks are done), no further passes run.
"""
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kstep.decoding.sampling import sample_tokens
from kstep.decoding.schedule import num_transfer_tokens
from kstep.decoding.unmask import choose_factor, choose_threshold, choose_top, confidence_rule
from kstep.params import GenerationParams
from kstep.runner.model_runner import ModelRunner

LogitsFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(slots=True)
class DiffusionOutput:
    completions: torch.Tensor   # (B, max_tokens) canvas after the prompt
    nfe: int
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)


def guided(run: LogitsFn, canvas: torch.Tensor, key_mask: torch.Tensor | None, prompt_len: int,
           cfg_scale: float, mask_id: int) -> torch.Tensor:
    """`run`'s logits, with LLaDA's unsupervised classifier-free guidance when cfg_scale > 0: the
    unconditional rows see the prompt masked, and logits = u + (cfg_scale + 1)(c - u)."""
    if cfg_scale == 0:
        return run(canvas, key_mask)
    unconditional = canvas.clone()
    unconditional[:, :prompt_len] = mask_id
    both_mask = None if key_mask is None else torch.cat([key_mask, key_mask])
    cond, uncond = run(torch.cat([canvas, unconditional]), both_mask).chunk(2)
    return uncond + (cfg_scale + 1) * (cond - uncond)


def fill_after_stop(completions: torch.Tensor, stop_ids: torch.Tensor, mask_id: int) -> None:
    """Early stop, in place on completions (B, N): in rows whose first stop token has nothing masked
    before it, every mask after it becomes that stop token."""
    N = completions.shape[1]
    index = torch.arange(N, device=completions.device)
    is_stop = torch.isin(completions, stop_ids)
    first_stop = torch.where(is_stop.any(-1), is_stop.float().argmax(-1), N)  # (B,)
    is_mask = completions == mask_id
    has_mask_before = (is_mask & (index < first_stop[:, None])).any(-1)
    is_final = (first_stop < N) & ~has_mask_before  # (B,)
    stop_token = completions.gather(1, first_stop.clamp(max=N - 1)[:, None])  # (B, 1)
    completions.copy_(torch.where(is_final[:, None] & is_mask, stop_token, completions))


class BlockDecoder:
    """Decodes one canvas batch block by block with a cache mode and an unmask policy."""

    def __init__(self, runner: ModelRunner, params: GenerationParams, mask_id: int, stop_ids: torch.Tensor,
                 generator: torch.Generator | None):
        self.runner, self.params, self.mask_id = runner, params, mask_id
        self.stop_ids, self.generator = stop_ids, generator
        self.rule = confidence_rule(params.remasking)
        self.steps_per_block = params.steps // params.num_blocks
        # Every block starts fully masked, so the fixed schedule is the same for all rows, known on the host.
        self.schedule = num_transfer_tokens(torch.tensor([params.block_length]), self.steps_per_block)[0].tolist()
        self.timings = {"full_pass_seconds": 0.0, "window_pass_seconds": 0.0, "num_full_passes": 0,
                        "num_window_passes": 0}

    def choose(self, confidence: torch.Tensor, step: int) -> torch.Tensor:
        p = self.params
        if p.threshold is not None:
            return choose_threshold(confidence, p.threshold)
        if p.factor is not None:
            return choose_factor(confidence, p.factor)
        k = self.schedule[min(step, len(self.schedule) - 1)]
        return choose_top(confidence, torch.full((confidence.shape[0],), k, device=confidence.device), k)

    def timed(self, kind: str, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        logits = run()
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        self.timings[f"{kind}_pass_seconds"] += time.perf_counter() - start
        self.timings[f"num_{kind}_passes"] += 1
        return logits

    def block_logits(self, canvas: torch.Tensor, key_mask: torch.Tensor | None, prompt_len: int,
                     start: int, end: int, step: int) -> torch.Tensor:
        """(B, end-start, V) logits for the current block, by the cache mode's pass for this step."""
        runner, L, cache = self.runner, canvas.shape[1], self.params.cache
        if cache == "none" or step == 0:
            run = lambda ids, mask: runner.full_logits(ids, mask, start, end, write_cache=cache != "none")  # noqa: E731
            kind = "full"
        else:
            window_end = L if cache == "prefix" else end
            run = lambda ids, mask: runner.window_logits(ids, mask, start, window_end, L, end - start)  # noqa: E731
            kind = "window"
        return self.timed(kind, lambda: guided(run, canvas, key_mask, prompt_len, self.params.cfg_scale,
                                               self.mask_id))

    def step(self, canvas: torch.Tensor, key_mask: torch.Tensor | None, prompt_len: int, start: int, end: int,
             step: int) -> None:
        """One refinement step on the block [start, end) of canvas (B, L), in place."""
        p = self.params
        logits = self.block_logits(canvas, key_mask, prompt_len, start, end, step)
        # The mask token is never a candidate (a masked position must become a token); confidence is
        # still scored on the unmodified logits, as the references do.
        proposal = logits.clone()
        proposal[..., self.mask_id] = float("-inf")
        candidates = sample_tokens(proposal, p.temperature, self.generator, p.top_k, p.top_p)  # (B, T)
        block = canvas[:, start:end]
        is_masked = block == self.mask_id
        confidence = self.rule(logits, candidates, self.generator).masked_fill(~is_masked, float("-inf"))
        chosen = self.choose(confidence, step) & is_masked
        block.copy_(torch.where(chosen, candidates, block))

    def run(self, canvas: torch.Tensor, key_mask: torch.Tensor | None, prompt_len: int) -> int:
        """Decode canvas (B, L) in place; returns the number of forward passes."""
        p, nfe = self.params, 0
        if p.cache != "none":
            self.runner.allocate_kv(canvas.shape[0] * (2 if p.cfg_scale > 0 else 1), canvas.shape[1])
        for block_idx in range(p.num_blocks):
            start = prompt_len + block_idx * p.block_length
            end = start + p.block_length
            step = 0
            while bool((canvas[:, start:end] == self.mask_id).any()):
                if step == p.block_length:  # every step unmasks at least one position per unfinished row
                    raise RuntimeError(f"internal: block {block_idx} still masked after {step} steps")
                self.step(canvas, key_mask, prompt_len, start, end, step)
                step, nfe = step + 1, nfe + 1
                if p.early_stop:
                    fill_after_stop(canvas[:, prompt_len:], self.stop_ids, self.mask_id)
        return nfe


def generate_diffusion(runner: ModelRunner, prompts: torch.Tensor, key_mask: torch.Tensor | None,
                       params: GenerationParams, mask_id: int, stop_ids: torch.Tensor,
                       generator: torch.Generator | None) -> DiffusionOutput:
    """Decode left-padded prompts (B, P); key_mask (B, P) marks real tokens or is None."""
    params = params.resolved_for_diffusion()
    B, P = prompts.shape
    canvas = torch.full((B, P + params.max_tokens), mask_id, dtype=torch.long, device=prompts.device)
    canvas[:, :P] = prompts
    if key_mask is not None:
        key_mask = torch.cat([key_mask, torch.ones(B, params.max_tokens, dtype=torch.bool, device=prompts.device)], 1)
    decoder = BlockDecoder(runner, params, mask_id, stop_ids, generator)
    start = time.perf_counter()
    nfe = decoder.run(canvas, key_mask, P)
    return DiffusionOutput(canvas[:, P:], nfe, time.perf_counter() - start, decoder.timings)
