"""The exact masked-diffusion sampler of LLaDA (arXiv:2502.09992; ML-GSAI/LLaDA `generate.py`).

The canvas is `prompt + max_tokens` masks, decoded semi-autoregressively in blocks. Each step runs
one full bidirectional pass, proposes a token for every masked position of the current block
(argmax, or Gumbel-max at temperature > 0), scores it with the unmask rule and unmasks the
highest-scoring masks, as many as the linear schedule gives that step. Unmasked tokens are never
re-masked. Positions outside the current block can never be unmasked (the reference gives them
-inf confidence), so logits are computed for the block only. Batched: no per-row Python loop.
"""
import time
from dataclasses import dataclass

import torch

from kstep.decoding.sampling import sample_tokens
from kstep.decoding.schedule import num_transfer_tokens
from kstep.decoding.unmask import ConfidenceRule, confidence_rule
from kstep.params import GenerationParams
from kstep.runner.model_runner import ModelRunner


@dataclass(slots=True)
class DiffusionOutput:
    completions: torch.Tensor   # (B, max_tokens) canvas after the prompt
    nfe: int
    seconds: float


def unmask_top(block: torch.Tensor, candidates: torch.Tensor, confidence: torch.Tensor, is_masked: torch.Tensor,
               num_unmask: torch.Tensor, max_unmask: int) -> None:
    """Unmask, in place, the `num_unmask[b]` most confident masked positions of each row of `block` (B, T)."""
    confidence = confidence.masked_fill(~is_masked, float("-inf"))
    top = confidence.topk(max_unmask, dim=-1).indices  # (B, max_unmask)
    keep = torch.arange(max_unmask, device=block.device) < num_unmask.unsqueeze(1)  # (B, max_unmask)
    chosen = torch.zeros_like(is_masked).scatter_(-1, top, keep) & is_masked  # (B, T)
    block.copy_(torch.where(chosen, candidates, block))


def guided_logits(runner: ModelRunner, canvas: torch.Tensor, key_mask: torch.Tensor | None, prompt_len: int,
                  start: int, end: int, cfg_scale: float, mask_id: int) -> torch.Tensor:
    """Block logits (B, end-start, V), with LLaDA's unsupervised classifier-free guidance when cfg_scale > 0:
    the unconditional pass sees the prompt masked, and logits = u + (cfg_scale + 1)(c - u)."""
    if cfg_scale == 0:
        return runner.full_logits(canvas, key_mask, start, end)
    unconditional = canvas.clone()
    unconditional[:, :prompt_len] = mask_id
    both_mask = None if key_mask is None else torch.cat([key_mask, key_mask])
    cond, uncond = runner.full_logits(torch.cat([canvas, unconditional]), both_mask, start, end).chunk(2)
    return uncond + (cfg_scale + 1) * (cond - uncond)


def denoise_step(runner: ModelRunner, canvas: torch.Tensor, key_mask: torch.Tensor | None, prompt_len: int,
                 start: int, end: int, num_unmask: torch.Tensor, max_unmask: int, rule: ConfidenceRule,
                 params: GenerationParams, mask_id: int, generator: torch.Generator | None) -> None:
    """One refinement step on the block [start, end) of canvas (B, L), in place."""
    logits = guided_logits(runner, canvas, key_mask, prompt_len, start, end, params.cfg_scale, mask_id)
    candidates = sample_tokens(logits, params.temperature, generator, params.top_k, params.top_p)  # (B, T)
    confidence = rule(logits, candidates, generator)  # (B, T)
    block = canvas[:, start:end]
    unmask_top(block, candidates, confidence, block == mask_id, num_unmask, max_unmask)


def generate_diffusion(runner: ModelRunner, prompts: torch.Tensor, key_mask: torch.Tensor | None,
                       params: GenerationParams, mask_id: int, generator: torch.Generator | None) -> DiffusionOutput:
    """Run the exact sampler on left-padded prompts (B, P); key_mask (B, P) marks real tokens or is None."""
    params = params.resolved_for_diffusion()
    B, P = prompts.shape
    N, block_len = params.max_tokens, params.block_length
    steps_per_block = params.steps // params.num_blocks
    canvas = torch.full((B, P + N), mask_id, dtype=torch.long, device=prompts.device)
    canvas[:, :P] = prompts
    if key_mask is not None:
        key_mask = torch.cat([key_mask, torch.ones(B, N, dtype=torch.bool, device=prompts.device)], dim=1)
    rule = confidence_rule(params.remasking)
    # Every block starts fully masked, so its schedule is the same for all rows and known on the host.
    schedule = num_transfer_tokens(torch.tensor([block_len]), steps_per_block)[0].tolist()
    start_time, nfe = time.perf_counter(), 0
    for block_idx in range(params.num_blocks):
        start = P + block_idx * block_len
        for step in range(steps_per_block):
            num_unmask = torch.full((B,), schedule[step], device=prompts.device)
            denoise_step(runner, canvas, key_mask, P, start, start + block_len, num_unmask, schedule[step],
                         rule, params, mask_id, generator)
            nfe += 1
    return DiffusionOutput(canvas[:, P:], nfe, time.perf_counter() - start_time)
