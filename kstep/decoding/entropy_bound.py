"""DiffusionGemma's sampler pieces (transformers 5.24 `generation_diffusion_gemma.py`), as batched free
functions over a canvas batch (B, L): the linear temperature schedule, per-position entropy, the
entropy-bound acceptance rule (EntropyBoundSampler, arXiv:2505.24857) and the stable-and-confident
stopping rule. The decoder (uniform_diffusion.py) strings them together in transformers' order.
"""
from collections.abc import Callable

import torch

from kstep.decoding.exact_draw import draw_one
from kstep.decoding.row_tiles import row_tiles
from kstep.decoding.sampling import OutputRules, constrain_outputs, filter_logits
from kstep.layers import cpu_kernels


def temperature(t_min: float, t_max: float, steps_left: int, max_steps: int, device: torch.device) -> torch.Tensor:
    """0-d float32: t_min + (t_max - t_min) * s / N, s = the steps remaining (N at a canvas's first
    pass). In float32 tensor arithmetic as transformers computes it: a Python-double temperature
    differs by an ulp, which can change a multinomial draw."""
    s = torch.tensor(steps_left, dtype=torch.int32, device=device)
    return t_min + ((t_max - t_min) * (s / max_steps))


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) nats, as torch.distributions.Categorical(logits=...).entropy() computes it
    (a filtered -inf logit contributes exactly 0)."""
    normed = logits - logits.logsumexp(-1, keepdim=True)
    probs = torch.softmax(normed, dim=-1)
    return -normed.clamp_(min=torch.finfo(normed.dtype).min).mul_(probs).sum(-1)  # in place: the same bits


def accept(entropies: torch.Tensor, bound: float) -> torch.Tensor:
    """(B, L) -> (B, L) bool: the lowest-entropy positions whose strictly-lower-ranked entropies sum
    to at most `bound` (always at least one; all when every entropy is 0)."""
    sorted_entropies, order = torch.sort(entropies, dim=-1)
    keep = torch.cumsum(sorted_entropies, dim=-1) - sorted_entropies <= bound
    return torch.zeros_like(keep).scatter(-1, order, keep)


def is_stable(history: torch.Tensor, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """history (S, B, L) of the last S argmax canvases (-1 before any), argmax (B, L) -> (stable (B,):
    equal to each of them, the history with argmax appended). S = 0: always stable."""
    if history.shape[0] == 0:
        return torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device), history
    stable = (history == argmax[None]).all(-1).all(0)
    return stable, torch.cat([history[1:], argmax[None]])


@torch.inference_mode()  # it writes over the pass's logits, an inference tensor, whoever calls it
def sample_positions(logits: torch.Tensor, temperature_value: torch.Tensor, scale: float, top_k: int | None,
                     top_p: float | None, output_index: torch.Tensor, rules: OutputRules,
                     generator: torch.Generator | None,
                     embed_probs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """(B, L, V) float32 logits -> (processed (B, L, V), sampled, argmax, entropies (B, L), soft): transformers'
    per-pass work over every position's distribution, in row tiles (row_tiles.py) whatever the
    vocabulary and canvas. The processed logits every rule reads, in transformers' order: kstep's
    output rules (min_tokens, token healing's first token), then the request's filters (`scale` 0:
    the top-1 filter, transformers' deterministic run; else top-k / top-p, as logits processors passed
    to its generate), then the schedule's temperature (times `scale` unless it is 1); written over
    `logits` (a pass's logits are its decoder's). Then a multinomial draw from their softmax
    (exact_draw.py), their argmax and entropy. The tiles draw in row order, so the draws and the
    generator's state are those of whole-tensor work.

    `embed_probs` ((n, V) float32 probabilities -> (n, D)): the self-conditioning signal made from the
    draw's own softmax (the soft embedding's, where the model is float32), a matmul per group of
    MATMUL_TILE_BYTES rows, so no second softmax runs over the canvas; `soft` is (B, L, D), else None."""
    logits = constrain_outputs(logits, output_index, rules)
    if scale == 0:
        top_k, top_p = 1, None
    divisor = temperature_value if scale in (0, 1) else temperature_value * scale
    V = logits.shape[-1]
    processed = logits.contiguous().view(-1, V)
    sampled = torch.empty(processed.shape[0], dtype=torch.long, device=logits.device)
    argmax, entropies = torch.empty_like(sampled), torch.empty(processed.shape[0], dtype=logits.dtype,
                                                              device=logits.device)
    softs, N = [], processed.shape[0]
    groups = row_tiles(N, V, processed.element_size(), for_matmul=True) if embed_probs else [slice(0, N)]
    # one buffer for every group: fresh memory costs its page faults (64 MiB: about 30 ms on a CPU)
    buffer = torch.empty(max(g.stop - g.start for g in groups), V, device=logits.device) if embed_probs else None
    for group in groups:
        group_probs = None if buffer is None else buffer[:group.stop - group.start]
        for rows in row_tiles(group.stop - group.start, V, processed.element_size()):
            tile, at = processed[group][rows], slice(group.start + rows.start, group.start + rows.stop)
            source = filter_logits(tile, top_k, top_p) if top_k is not None or top_p is not None else tile
            torch.div(source, divisor, out=tile)  # a view: the processed logits are written in place
            probs = _softmax(tile, None if group_probs is None else group_probs[rows])
            sampled[at] = draw_one(probs, generator)
            argmax[at] = cpu_kernels.argmax_rows(tile)
            entropies[at] = entropy(tile)
        if group_probs is not None:
            softs.append(embed_probs(group_probs))
    lead = logits.shape[:-1]
    soft = torch.cat(softs).view(*lead, -1) if softs else None
    return processed.view(logits.shape), sampled.view(lead), argmax.view(lead), entropies.view(lead), soft


def _softmax(tile: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """torch.softmax(tile, -1, dtype=torch.float32) of float32 logits, into `out` where given (the same kernel)."""
    if out is None:
        return torch.softmax(tile, dim=-1, dtype=torch.float32)
    return torch.ops.aten._softmax.out(tile, -1, False, out=out)
