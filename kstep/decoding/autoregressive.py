"""The autoregressive baseline: prefill once, then one cached decode pass per token.

The KV cache is preallocated for prompt + max_tokens by the runner, so there is no recomputation
of the prefix and no per-step allocation; it is the honest baseline diffusion is compared with.
"""
import time
from dataclasses import dataclass

import torch

from kstep.decoding.sampling import sample_tokens
from kstep.params import GenerationParams
from kstep.runner.model_runner import ModelRunner, positions_from_padding


@dataclass(slots=True)
class AutoregressiveOutput:
    completions: torch.Tensor   # (B, T <= max_tokens); rows that stopped early are padded after their stop token
    nfe: int
    seconds: float
    prefill_seconds: float


def generate_autoregressive(runner: ModelRunner, prompts: torch.Tensor, key_mask: torch.Tensor | None,
                            params: GenerationParams, stop_ids: torch.Tensor, pad_id: int,
                            generator: torch.Generator | None) -> AutoregressiveOutput:
    """Decode left-padded prompts (B, P) until every row hits a stop id or max_tokens."""
    B, P = prompts.shape
    N = params.max_tokens
    runner.allocate_kv(B, P + N)
    if key_mask is not None:
        key_mask = torch.cat([key_mask, torch.ones(B, N, dtype=torch.bool, device=prompts.device)], dim=1)
        positions = positions_from_padding(key_mask[:, :P])
    else:
        positions = torch.arange(P, device=prompts.device).expand(B, -1)
    start_time = time.perf_counter()
    logits = runner.causal_logits(prompts, positions, key_mask, 0)  # (B, V)
    runner.synchronize()
    prefill_seconds = time.perf_counter() - start_time
    next_position = positions[:, -1:] + 1  # (B, 1)
    out = torch.full((B, N), pad_id, dtype=torch.long, device=prompts.device)
    finished = torch.zeros(B, dtype=torch.bool, device=prompts.device)
    nfe, num_generated = 1, 0
    for t in range(N):
        token = sample_tokens(logits, params.temperature, generator, params.top_k, params.top_p)  # (B,)
        token = torch.where(finished, pad_id, token)
        out[:, t] = token
        num_generated = t + 1
        finished |= torch.isin(token, stop_ids)
        if t == N - 1 or bool(finished.all()):
            break
        logits = runner.causal_logits(token[:, None], next_position, key_mask, P + t)
        next_position += 1
        nfe += 1
    runner.synchronize()
    return AutoregressiveOutput(out[:, :num_generated], nfe, time.perf_counter() - start_time, prefill_seconds)
