"""Dream family: the model against an independent forward from raw tensors, and both Dream samplers
token for token at temperature 0 against a plain restatement (tests/dream_reference.py): Dream's
full-canvas `_sample` (generation_utils.py) and Fast-dLLM's block `_sample` with a prefix or dual
cache (generation_utils_block.py)."""
import json

import pytest
import torch
from dream_reference import (
    FIRST_SPECIAL_ID,
    ReferenceDream,
    dream_block_generate,
    dream_generate,
    write_dream_checkpoint,
)

import kstep

# kstep's remasking rule -> Dream's alg
ALGS = {"low_confidence": "maskgit_plus", "margin": "topk_margin", "entropy": "entropy"}


@pytest.fixture(scope="session")
def dream_path(tmp_path_factory):
    return write_dream_checkpoint(tmp_path_factory.mktemp("dream"))


@pytest.fixture(scope="module")
def llm(dream_path):
    return kstep.load(dream_path)


@pytest.fixture(scope="module")
def ref(dream_path):
    return ReferenceDream(dream_path)


def prompt_ids(n: int, seed: int) -> list[int]:
    """Ordinary tokens only: no mask, end-of-text or chat marker inside a prompt."""
    return torch.randint(0, FIRST_SPECIAL_ID, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def completion(canvas: list[int], stop_ids) -> list[int]:
    cut = next((i for i, t in enumerate(canvas) if t in stop_ids), len(canvas))
    return canvas[:cut]


def test_loads_as_diffusion_with_dream_special_tokens(dream_path, llm):
    cfg = json.loads((dream_path / "config.json").read_text())
    assert json.loads((dream_path / "generation_config.json").read_text())["mask_token_id"] is None  # as Dream-v0
    assert llm.is_diffusion
    assert llm.cfg.mask_token_id == cfg["mask_token_id"]
    assert cfg["eos_token_id"] in llm.stop_ids
    assert llm.pad_id == cfg["pad_token_id"]  # = eos, as Dream-v0's <|endoftext|>
    assert llm.cfg.vocab_size == cfg["vocab_size"]


def test_model_matches_independent_forward(llm, ref):
    ids = torch.randint(0, FIRST_SPECIAL_ID, (2, 17), generator=torch.Generator().manual_seed(0))
    ids[:, 10:] = llm.cfg.mask_token_id  # a canvas: the forward is bidirectional, masks attend to the prompt
    expected = ref(ids)  # unshifted: the output at j predicts token j + 1
    got = llm.runner.logits(llm.runner.full_pass(ids, None, 0, 17))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_tokens,steps,remasking", [
    (16, 16, "low_confidence"),  # counts 0, 1, ..., 1, 2: int(16 * (1 - s / t)) = int(0.999) at the first pass
    (16, 5, "low_confidence"),   # 3, 3, 3, 3, 4: int(masked now * (1 - s / t)), all the rest at the last
    (12, 12, "low_confidence"),
    (24, 7, "margin"),           # 3, 3, 3, 3, 3, 4, 5
    (16, 16, "margin"),
    (16, 8, "entropy"),
    (16, 3, "entropy"),          # 5, 5, 6
    (32, 12, "entropy"),
])
def test_full_canvas_matches_reference(llm, ref, max_tokens, steps, remasking):
    prompt = prompt_ids(7, 3)
    expected, expected_nfe = dream_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + max_tokens,
                                            steps=steps, alg=ALGS[remasking], mask_token_id=llm.cfg.mask_token_id)
    got = llm.generate(prompt, max_tokens=max_tokens, steps=steps, remasking=remasking, block_length=max_tokens,
                       cache="none", early_stop=False)[0]
    canvas = expected[0, len(prompt):].tolist()
    assert llm.cfg.mask_token_id not in canvas
    assert got.token_ids == completion(canvas, llm.stop_ids)
    assert got.nfe == expected_nfe == steps


@pytest.mark.parametrize("remasking,knobs", [
    ("low_confidence", dict(top_p=0.5, top_k=3)),
    ("margin", dict(top_k=5)),
    ("entropy", dict(top_p=0.9)),
])
def test_top_p_and_top_k_reshape_the_confidence_at_temperature_zero(llm, ref, remasking, knobs):
    """Dream filters the logits before the softmax even when greedy: the token stays the argmax, but the
    confidence (and so which masks go first) comes from the renormalised, filtered distribution."""
    prompt = prompt_ids(5, 4)
    expected, _ = dream_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + 16, steps=6,
                                 alg=ALGS[remasking], mask_token_id=llm.cfg.mask_token_id, **knobs)
    unfiltered, _ = dream_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + 16, steps=6,
                                   alg=ALGS[remasking], mask_token_id=llm.cfg.mask_token_id)
    assert not torch.equal(expected, unfiltered)  # the case does exercise the filter
    got = llm.generate(prompt, max_tokens=16, steps=6, remasking=remasking, block_length=16, cache="none",
                       temperature=0.0, early_stop=False, **knobs)[0]
    assert got.token_ids == completion(expected[0, len(prompt):].tolist(), llm.stop_ids)
    assert got.nfe == 6


@pytest.mark.parametrize("remasking", ["low_confidence", "entropy"])
def test_padded_batch_matches_reference_batch(llm, ref, remasking):
    """The reference's own batched call (left padding, attention mask, tok_idx positions) against kstep's batch."""
    prompts = [prompt_ids(9, 10), prompt_ids(4, 11)]
    ids = torch.full((2, 9), llm.pad_id)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 9 - len(p):] = torch.tensor(p)
        mask[row, 9 - len(p):] = 1
    expected, _ = dream_generate(ref, ids, mask, max_length=9 + 16, steps=8, alg=ALGS[remasking],
                                 mask_token_id=llm.cfg.mask_token_id)
    got = llm.generate(prompts, max_tokens=16, steps=8, remasking=remasking, block_length=16, cache="none",
                       early_stop=False)
    assert len(got) == 2
    for row, result in enumerate(got):
        assert result.token_ids == completion(expected[row, 9:].tolist(), llm.stop_ids)
        assert result.nfe == 8


@pytest.mark.parametrize("threshold", [0.1, 0.5, 0.9])
def test_confidence_threshold_matches_reference(llm, ref, threshold):
    """Dream's confidence_threshold alg: masks / steps per pass, the refused ones carried to the next pass,
    one more pass each time the last one refuses some."""
    prompt = prompt_ids(7, 3)
    expected, expected_nfe = dream_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + 16, steps=4,
                                            alg="confidence_threshold", threshold=threshold,
                                            mask_token_id=llm.cfg.mask_token_id)
    got = llm.generate(prompt, max_tokens=16, steps=4, threshold=threshold, remasking="low_confidence",
                       block_length=16, cache="none", early_stop=False)[0]
    canvas = expected[0, len(prompt):].tolist()
    assert llm.cfg.mask_token_id not in canvas
    assert got.token_ids == completion(canvas, llm.stop_ids)
    assert got.nfe <= expected_nfe


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("max_tokens,block_length,steps", [
    (32, 8, 16),  # 4 blocks, 4 passes each: the block-start pass (first token), then 2, 2, 3 cached
    (16, 8, 6),   # 3 passes per block: 1, then 3, 4
    (24, 8, 6),   # 2 passes per block: the first token, then all 7 others
])
def test_block_sampler_fixed_schedule_matches_fast_dllm(llm, ref, cache, max_tokens, block_length, steps):
    prompt = prompt_ids(6, 4)
    expected, expected_nfe = dream_block_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + max_tokens,
                                                  steps=steps, block_length=block_length, cache=cache, alg="entropy",
                                                  mask_token_id=llm.cfg.mask_token_id)
    got = llm.generate(prompt, max_tokens=max_tokens, steps=steps, block_length=block_length, cache=cache,
                       remasking="entropy", early_stop=False)[0]
    canvas = expected[0, len(prompt):].tolist()
    assert llm.cfg.mask_token_id not in canvas
    assert got.token_ids == completion(canvas, llm.stop_ids)
    assert got.nfe == expected_nfe == steps


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [0.3, 0.9])
def test_block_sampler_threshold_matches_fast_dllm(llm, ref, cache, threshold):
    """The threshold path has no schedule: `steps` only has to divide into the blocks there (any
    multiple of the block count gives the same result), so kstep is called without it."""
    prompt = prompt_ids(6, 4)
    expected, expected_nfe = dream_block_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + 32, steps=4,
                                                  block_length=8, cache=cache, alg="confidence_threshold",
                                                  threshold=threshold, mask_token_id=llm.cfg.mask_token_id)
    got = llm.generate(prompt, max_tokens=32, block_length=8, threshold=threshold, cache=cache,
                       remasking="low_confidence", early_stop=False)[0]
    canvas = expected[0, len(prompt):].tolist()
    assert llm.cfg.mask_token_id not in canvas
    assert got.token_ids == completion(canvas, llm.stop_ids)
    assert got.nfe <= expected_nfe


def test_origin_in_one_pass_matches_reference(llm, ref):
    """Dream's `origin` draws one global-RNG uniform per mask per pass, an order a batched, per-request
    generator cannot replay; with one pass it reveals everything (p = 1) and needs no draw at temperature 0."""
    prompt = prompt_ids(7, 3)
    expected, _ = dream_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + 16, steps=1, alg="origin",
                                 mask_token_id=llm.cfg.mask_token_id)
    got = llm.generate(prompt, max_tokens=16, steps=1, remasking="random", block_length=16, cache="none",
                       early_stop=False)[0]
    assert got.token_ids == completion(expected[0, len(prompt):].tolist(), llm.stop_ids)
    assert got.nfe == 1


@pytest.mark.parametrize("knobs", [dict(remasking="random"), dict(remasking="entropy", alg_temp=0.5),
                                   dict(remasking="low_confidence", temperature=0.8, top_p=0.9)])
def test_seeded_sampling_keeps_the_schedule_and_is_reproducible(llm, knobs):
    """The random paths (origin, alg_temp, temperature) cannot be replayed draw for draw: their invariants."""
    prompt = prompt_ids(5, 0)
    run = lambda seed: llm.generate(prompt, max_tokens=16, steps=6, block_length=16, cache="none",  # noqa: E731
                                    early_stop=False, seed=seed, **knobs)[0]
    first = run(3)
    assert first.nfe == 6
    assert llm.cfg.mask_token_id not in first.token_ids and len(first.token_ids) <= 16
    assert run(3).token_ids == first.token_ids


def test_exact_is_the_whole_canvas_reference_and_the_default_is_the_block_sampler(llm, ref):
    """`exact` = Dream's own `diffusion_generate` (one block, no cache, a pass per token); the
    default = Fast-dLLM's block sampler, dual cache, threshold 0.9, blocks of 32."""
    prompt = prompt_ids(6, 7)
    expected, _ = dream_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + 32, steps=32,
                                 alg="maskgit_plus", mask_token_id=llm.cfg.mask_token_id)
    exact = llm.generate(prompt, max_tokens=32, exact=True, early_stop=False)[0]
    assert exact.token_ids == completion(expected[0, len(prompt):].tolist(), llm.stop_ids) and exact.nfe == 32
    fast, _ = dream_block_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + 32, steps=1,
                                   block_length=32, cache="dual", alg="confidence_threshold", threshold=0.9,
                                   mask_token_id=llm.cfg.mask_token_id)
    default = llm.generate(prompt, max_tokens=32, early_stop=False)[0]
    assert default.token_ids == completion(fast[0, len(prompt):].tolist(), llm.stop_ids)


def test_eps_comes_from_generation_config(tmp_path, dream_path, ref):
    """Dream's schedule end point is read from the checkpoint (as `diffusion_generate` does); a
    request's `eps` overrides it."""
    import shutil
    path = shutil.copytree(dream_path, tmp_path / "eps")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eps": 0.4}))
    llm = kstep.load(path)
    prompt = prompt_ids(7, 5)
    run = lambda eps: dream_generate(ref, torch.tensor([prompt]), max_length=len(prompt) + 16, steps=5,  # noqa: E731
                                     alg="maskgit_plus", eps=eps, mask_token_id=llm.cfg.mask_token_id)[0]
    assert not torch.equal(run(0.4), run(1e-3))  # the case does exercise eps
    for eps, given in ((0.4, {}), (1e-3, {"eps": 1e-3})):
        got = llm.generate(prompt, max_tokens=16, steps=5, block_length=16, cache="none", early_stop=False,
                           **given)[0]
        assert got.token_ids == completion(run(eps)[0, len(prompt):].tolist(), llm.stop_ids)


def test_knobs_of_other_families_are_refused(llm, llama_path):
    with pytest.raises(ValueError, match="cfg_scale"):
        llm.generate([5, 6, 7], max_tokens=8, cfg_scale=1.0)
    with pytest.raises(ValueError, match="alg_temp"):
        kstep.load(llama_path).generate([5, 6, 7], max_tokens=8, alg_temp=0.5)
