"""The samplers' per-pass work over positions x vocabulary in row tiles (issue 45): the exact draw
equals torch.multinomial (ids and the generator's state after) on this torch, the argmax in C equals
torch's, the tiles cover the
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


@pytest.mark.parametrize("case", ["random", "ties", "filtered", "nan", "signed zeros", "infinities"])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 1001, 262_144])
def test_the_argmax_in_c_is_torchs(case, width):
    """cpu_kernels.argmax_rows (the samplers' argmax in C where the kernels are built): the first
    largest value's index, the first NaN's where a row has one, as torch.argmax."""
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(width))
    if case == "ties":
        x = x.round()
    elif case == "filtered":
        x[:, ::3] = float("-inf")
        x[0] = float("-inf")
    elif case == "nan":
        x[1, width // 2] = float("nan")
        x[2, -1] = float("nan")
    elif case == "signed zeros":
        x[:] = 0.0
        x[:, ::2] = -0.0
    elif case == "infinities":
        x[:, -1] = float("inf")
        x[0, ::2] = float("inf")
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(-1))


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
    embedding = torch.randn(V, 16, generator=torch.Generator().manual_seed(3))
    *got, soft = sample_positions(logits.clone(), temperature_value, scale, top_k, top_p,
                                  torch.zeros(1, 9, dtype=torch.long), OutputRules(torch.tensor([0])), generator,
                                  embed_probs=lambda probs: probs @ embedding)
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)
    # the soft embedding from the draw's softmax: what the decoder computed from the processed logits
    assert torch.equal(soft, torch.softmax(expected[0], dim=-1, dtype=torch.float32) @ embedding)
    reference_state = torch.Generator().manual_seed(9)
    whole_tensor_pass(logits.clone(), temperature_value, scale, top_k, top_p, reference_state)
    assert torch.equal(generator.get_state(), reference_state.get_state())


def test_diffusion_gemma_in_small_tiles_generates_what_it_does_whole(gemma_path, monkeypatch):
    llm = kstep.load(gemma_path)
    prompts = ["def add(a, b):", "x = ["]
    params = dict(max_tokens=24, temperature=1.0, seed=5, top_k=50)
    whole = [r.token_ids for r in llm.generate(prompts, **params)]
    monkeypatch.setattr(row_tiles_module, "TILE_BYTES", 2 * llm.cfg.vocab_size * 4)  # 2 rows
    assert [r.token_ids for r in llm.generate(prompts, **params)] == whole


def test_diffusion_gemmas_signal_from_the_draws_softmax_is_the_soft_embeddings(gemma_path, monkeypatch):
    """A float32 DiffusionGemma's next-pass signal is made from the sampler's own softmax, a matmul per
    group of rows (here of 6 rows, many groups a pass): the bits of the soft embedding computed apart,
    pass by pass, and the same tokens."""
    from kstep.decoding.uniform_diffusion import UniformDiffusionDecoder
    from kstep.runner.model_runner import ModelRunner
    llm = kstep.load(gemma_path)
    assert llm.runner.probs_embedder() is not None  # float32: the shared path runs
    monkeypatch.setattr(row_tiles_module, "MATMUL_TILE_BYTES", 6 * llm.cfg.vocab_size * 4)
    signals, denoise = [], UniformDiffusionDecoder._denoise

    def recorded(self, logits):
        denoise(self, logits)
        signals.append(self.soft)
    monkeypatch.setattr(UniformDiffusionDecoder, "_denoise", recorded)
    prompts, params = ["def add(a, b):", "x = ["], dict(max_tokens=24, temperature=1.0, seed=3)
    shared, shared_signals = [r.token_ids for r in llm.generate(prompts, **params)], signals[:]
    signals.clear()
    monkeypatch.setattr(ModelRunner, "probs_embedder", lambda self: None)
    assert [r.token_ids for r in llm.generate(prompts, **params)] == shared
    assert sum(signal is not None for signal in signals) > 2
    assert len(signals) == len(shared_signals)
    for apart, from_the_draw in zip(signals, shared_signals, strict=True):
        assert (apart is None) == (from_the_draw is None)
        assert apart is None or torch.equal(apart, from_the_draw)


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
