"""The samplers' per-pass work over positions x vocabulary in row tiles (issue 45): the exact draw
equals torch.multinomial (ids and the generator's state after) on this torch, the tiles cover the
rows without a single-row tile, and DiffusionGemma's tiled pass, Dream's scores and the Gumbel-max
sampler give the bits and draws of the whole-tensor work they replaced, at any tile size, end to end
too."""
import pytest
import torch

import kstep
from kstep.decoding import row_tiles as row_tiles_module
from kstep.decoding.entropy_bound import entropy, sample_positions
from kstep.decoding.exact_draw import _draw, draw_one, is_exact, native
from kstep.layers import cpu_kernels
from kstep.decoding.row_tiles import row_tiles
from kstep.decoding.dream import _dream_rows, dream_logit_scores
from kstep.decoding.sampling import OutputRules, _sample_rows, filter_logits, sample_tokens
from kstep.decoding.walk_candidates import gumbel_ranked
from kstep.params import GenerationParams


def test_this_torch_draws_as_the_exact_draw_assumes():
    assert is_exact()  # a torch whose multinomial changed would fall back to it, slower: this says so
    # and kstep's C stream (cpu_draw.c) is torch's generator's, where the kernels are built
    assert (native() is not None) == cpu_kernels.available()


STREAMS = ["torch"] + (["native"] if cpu_kernels.available() else [])


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows,width", [(1, 2), (5, 7), (64, 320), (3, 262_144)])
def test_the_exact_draw_is_multinomial_with_the_same_generator_state(dtype, rows, width, stream):
    lib = cpu_kernels.library() if stream == "native" else None
    check = torch.Generator().manual_seed(rows * width)
    for trial in range(6):
        logits = torch.randn(rows, width, generator=check) * (0.1 + 20 * torch.rand(rows, 1, generator=check))
        if width > 2:
            logits[:, torch.rand(width, generator=check) < 0.3] = float("-inf")  # filtered tokens: p = 0
            logits[:, 0] = logits.max()  # a token with mass in every row
        probs = torch.softmax(logits, -1).to(dtype)
        if trial == 0 and width > 4:
            probs[:, 1:4] = probs[:, :1]  # ties
        mine, theirs = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        for g in (mine, theirs):  # mid-stream: an odd number of 32-bit words drawn already
            torch.rand(trial * 101, generator=g)
        assert torch.equal(_draw(probs, mine, lib), torch.multinomial(probs, 1, generator=theirs)[:, 0])
        assert torch.equal(mine.get_state(), theirs.get_state())


def test_the_exact_draw_without_a_generator_uses_torchs_global_one():
    probs = torch.softmax(torch.randn(4, 50), -1)
    torch.manual_seed(3)
    mine = draw_one(probs, None)
    torch.manual_seed(3)
    assert torch.equal(mine, torch.multinomial(probs, 1)[:, 0])


@pytest.mark.parametrize("num_rows", [1, 2, 3, 7, 8, 9, 17, 256])
@pytest.mark.parametrize("per_tile", [1, 2, 4, 8])
def test_row_tiles_cover_the_rows_without_a_single_row_tile(num_rows, per_tile, monkeypatch):
    monkeypatch.setattr(row_tiles_module, "TILE_BYTES", per_tile * 40)
    tiles = row_tiles(num_rows, 10)
    assert [i for t in tiles for i in range(t.start, t.stop)] == list(range(num_rows))
    assert all(t.stop - t.start >= 2 for t in tiles) or num_rows == 1
    assert all(t.stop - t.start <= max(2, per_tile) + 1 for t in tiles)


def whole_tensor_pass(logits, temperature_value, scale, top_k, top_p, generator):
    """The pass as uniform_diffusion.py ran it before the tiles (no output rules)."""
    if scale == 0:
        top_k, top_p = 1, None
    if top_k is not None or top_p is not None:
        logits = filter_logits(logits, top_k, top_p)
    processed = logits / (temperature_value if scale in (0, 1) else temperature_value * scale)
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    V = processed.shape[-1]
    sampled = torch.multinomial(probs.view(-1, V), 1, generator=generator).view(processed.shape[:-1])
    return processed, sampled, processed.argmax(-1), entropy(processed)


@pytest.mark.parametrize("scale,top_k,top_p", [(1.0, None, None), (0.0, None, None), (0.7, 20, None),
                                               (1.0, None, 0.9)])
@pytest.mark.parametrize("tile_rows", [2, 3, 1000])
def test_a_tiled_pass_is_the_whole_tensor_pass(scale, top_k, top_p, tile_rows, monkeypatch):
    V = 1001
    monkeypatch.setattr(row_tiles_module, "TILE_BYTES", tile_rows * V * 4)
    logits = torch.randn(3, 9, V, generator=torch.Generator().manual_seed(1)) * 4
    temperature_value = torch.tensor(0.8)
    expected = whole_tensor_pass(logits.clone(), temperature_value, scale, top_k, top_p,
                                 torch.Generator().manual_seed(9))
    generator = torch.Generator().manual_seed(9)
    got = sample_positions(logits.clone(), temperature_value, scale, top_k, top_p,
                           torch.zeros(1, 9, dtype=torch.long), OutputRules(torch.tensor([0])), generator)
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)
    reference_state = torch.Generator().manual_seed(9)
    whole_tensor_pass(logits.clone(), temperature_value, scale, top_k, top_p, reference_state)
    assert torch.equal(generator.get_state(), reference_state.get_state())


def test_diffusion_gemma_in_small_tiles_generates_what_it_does_whole(gemma_path, monkeypatch):
    llm = kstep.load(gemma_path)
    prompts = ["def add(a, b):", "x = ["]
    params = dict(max_tokens=24, temperature=1.0, seed=5, top_k=50)
    whole = [r.token_ids for r in llm.generate(prompts, **params)]
    monkeypatch.setattr(row_tiles_module, "TILE_BYTES", 2 * llm.cfg.vocab_size * 4)  # 2 rows; soft: 16
    assert [r.token_ids for r in llm.generate(prompts, **params)] == whole


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, None, None), (1.0, None, None), (0.7, 5, None),
                                                     (1.3, None, 0.8)])
def test_gumbel_max_sampling_in_tiles_is_whole(temperature, top_k, top_p, monkeypatch):
    logits = torch.randn(4, 5, 333, generator=torch.Generator().manual_seed(2)) * 3
    whole_generator, tiled_generator = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    whole = _sample_rows(logits, temperature, whole_generator, top_k, top_p)
    monkeypatch.setattr(row_tiles_module, "TILE_BYTES", 3 * 333 * 4)
    assert torch.equal(sample_tokens(logits, temperature, tiled_generator, top_k, top_p), whole)
    assert torch.equal(whole_generator.get_state(), tiled_generator.get_state())


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=0.9, remasking="margin"),
                                      dict(temperature=1.0, top_p=0.9, remasking="entropy"),
                                      dict(temperature=0.5, top_k=7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dream_scores_in_tiles_are_whole(settings, dtype, monkeypatch):
    params = GenerationParams(**settings)
    logits = (torch.randn(3, 6, 400, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    whole_generator, tiled_generator = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    whole = _dream_rows(logits, params, 399, whole_generator)
    monkeypatch.setattr(row_tiles_module, "TILE_BYTES", 4 * 400 * logits.element_size())
    tiled = dream_logit_scores(logits, params, 399, tiled_generator)
    assert all(torch.equal(a, b) for a, b in zip(whole, tiled, strict=True))
    assert torch.equal(whole_generator.get_state(), tiled_generator.get_state())


def test_gumbel_top_k_in_tiles_is_whole(monkeypatch):
    logits = torch.randn(3, 7, 300, generator=torch.Generator().manual_seed(6))
    whole_generator, tiled_generator = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    whole = gumbel_ranked(logits, 16, whole_generator)
    monkeypatch.setattr(row_tiles_module, "TILE_BYTES", 2 * 300 * 4)
    assert torch.equal(gumbel_ranked(logits, 16, tiled_generator), whole)
    assert torch.equal(whole_generator.get_state(), tiled_generator.get_state())
