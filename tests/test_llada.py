"""LLaDA family: the model against an independent forward from raw tensors, and the exact sampler
against the reference `generate()` semantics, token for token at temperature 0; seeded `random`
remasking against the reference's global-RNG draws; Fast-dLLM's caches and unmask policies."""
import pytest
import torch
from llada_reference import ReferenceLLaDA, reference_generate

import kstep


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(5, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_model_matches_independent_forward(llada_path):
    llm = kstep.load(llada_path)
    ref = ReferenceLLaDA(llada_path)
    ids = torch.randint(5, llm.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    expected = ref(ids)
    got = llm.runner.logits(llm.runner.full_pass(ids, None, 0, 17))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gen_length,block_length,steps,cfg_scale", [
    (16, 16, 16, 0.0),   # one block, one token per step
    (32, 8, 16, 0.0),    # semi-autoregressive blocks, 2 tokens per step
    (24, 8, 9, 0.0),     # uneven split: 8 masks over 3 steps -> 3, 3, 2
    (16, 16, 5, 0.0),    # 16 over 5 -> 4, 3, 3, 3, 3
    (16, 8, 8, 1.5),     # classifier-free guidance
])
def test_exact_sampler_matches_reference(llada_path, gen_length, block_length, steps, cfg_scale):
    llm = kstep.load(llada_path)
    ref = ReferenceLLaDA(llada_path)
    prompt = prompt_ids(7, 3, llm.cfg.vocab_size)
    expected = reference_generate(ref, torch.tensor([prompt]), steps=steps, gen_length=gen_length,
                                  block_length=block_length, cfg_scale=cfg_scale, mask_id=llm.cfg.mask_token_id)
    got = llm.generate(prompt, max_tokens=gen_length, block_length=block_length, steps=steps, exact=True,
                       cfg_scale=cfg_scale, early_stop=False)[0]
    canvas = expected[0, len(prompt):].tolist()
    assert llm.cfg.mask_token_id not in canvas
    cut = next((i for i, t in enumerate(canvas) if t in llm.stop_ids), len(canvas))
    assert got.token_ids == canvas[:cut]
    assert got.nfe == steps


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's batched input: prompts left-padded, with its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def until_stop(canvas: list[int], llm) -> list[int]:
    return canvas[:next((i for i, t in enumerate(canvas) if t in llm.stop_ids), len(canvas))]


def test_padded_batch_matches_reference_batch(llada_path):
    """The reference's own batched call (left padding + attention mask) against kstep's batch."""
    llm = kstep.load(llada_path)
    ref = ReferenceLLaDA(llada_path)
    prompts = [prompt_ids(9, 1, llm.cfg.vocab_size), prompt_ids(4, 2, llm.cfg.vocab_size)]
    ids, mask = left_padded(prompts, llm.pad_id)
    expected = reference_generate(ref, ids, mask, steps=16, gen_length=16, block_length=8,
                                  mask_id=llm.cfg.mask_token_id)
    got = llm.generate(prompts, max_tokens=16, block_length=8, steps=16, exact=True)
    for row, result in enumerate(got):
        assert result.token_ids == until_stop(expected[row, 9:].tolist(), llm)


@pytest.mark.parametrize("gen_length,block_length,steps,cfg_scale", [
    (16, 16, 16, 0.0), (32, 8, 16, 0.0), (24, 8, 9, 0.0), (16, 16, 5, 0.0), (16, 8, 8, 1.5),
])
def test_seeded_random_remasking_matches_reference(llada_path, gen_length, block_length, steps, cfg_scale):
    """remasking=random with seed=s is LLaDA's generate after torch.manual_seed(s), which draws
    torch.rand((B, L)) every step over the whole canvas (prompt and padding included): a left-padded
    batch of two, token for token at temperature 0."""
    llm = kstep.load(llada_path)
    ref = ReferenceLLaDA(llada_path)
    prompts = [prompt_ids(9, 5, llm.cfg.vocab_size), prompt_ids(4, 6, llm.cfg.vocab_size)]
    ids, mask = left_padded(prompts, llm.pad_id)
    torch.manual_seed(11)
    expected = reference_generate(ref, ids, mask, steps=steps, gen_length=gen_length, block_length=block_length,
                                  cfg_scale=cfg_scale, remasking="random", mask_id=llm.cfg.mask_token_id)
    got = llm.generate(prompts, max_tokens=gen_length, block_length=block_length, steps=steps, exact=True,
                       cfg_scale=cfg_scale, remasking="random", seed=11, early_stop=False)
    for row, result in enumerate(got):
        assert result.token_ids == until_stop(expected[row, 9:].tolist(), llm)


def test_unseeded_random_remasking_stays_random(llada_path):
    """Without a seed the draws come from torch's global RNG (as the reference's): they differ run to run."""
    llm = kstep.load(llada_path)
    prompt = prompt_ids(6, 2, llm.cfg.vocab_size)

    def run(global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)
        return llm.generate(prompt, max_tokens=32, block_length=8, exact=True, remasking="random",
                            early_stop=False)[0].token_ids

    assert run(0) == run(0) != run(1)


@pytest.mark.parametrize("rule", ["random", "margin", "entropy", "low_confidence"])
def test_every_rule_unmasks_the_whole_canvas_on_schedule(llada_path, rule):
    llm = kstep.load(llada_path)
    out = llm.generate(prompt_ids(5, 0, llm.cfg.vocab_size), max_tokens=16, block_length=8, steps=6,
                       remasking=rule, temperature=0.7, seed=3)[0]
    assert out.nfe == 6
    assert llm.cfg.mask_token_id not in out.token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(llada_path):
    llm = kstep.load(llada_path)
    prompt = prompt_ids(5, 0, llm.cfg.vocab_size)
    run = lambda seed: llm.generate(prompt, max_tokens=32, temperature=1.0, seed=seed)[0].token_ids  # noqa: E731
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_padded_embedding_rows_are_never_sampled(tmp_path, llada_path):
    """LLaDA/OLMo checkpoints pad embedding_size past vocab_size; those rows are not tokens."""
    import shutil

    from safetensors.torch import load_file, save_file
    copy = tmp_path / "padded"
    shutil.copytree(llada_path, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    llm = kstep.load(copy)
    assert llm.cfg.embedding_size > llm.cfg.vocab_size
    tensors["model.transformer.ff_out.weight"][llm.cfg.vocab_size:] = 50.0  # would win every argmax
    save_file(tensors, str(copy / "model.safetensors"))
    out = kstep.load(copy).generate(prompt_ids(5, 0, llm.cfg.vocab_size), max_tokens=16, temperature=0.5, seed=0)[0]
    assert out.token_ids and max(out.token_ids) < llm.cfg.vocab_size


def test_bfloat16_runs(llada_path, llama_path):
    diffusion = kstep.load(llada_path, dtype="bfloat16").generate("def f(x):", max_tokens=16, steps=8)[0]
    assert diffusion.nfe == 8 and len(diffusion.token_ids) <= 16
    ar = kstep.load(llama_path, dtype="bfloat16").generate("def f(x):", max_tokens=16)[0]
    assert 1 <= ar.nfe <= 16 and len(ar.token_ids) <= 16


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("policy", [dict(), dict(threshold=0.05), dict(threshold=0.5), dict(factor=1.0),
                                    dict(factor=4.0)])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_cache_modes_match_fast_dllm(llada_path, cache, policy, remasking):
    """cache=none|prefix|dual with the fixed schedule, a threshold or a factor = Fast-dLLM's three generate
    functions. Seeded `random` = theirs after torch.manual_seed: torch.rand((1, W)) per pass, W the whole
    canvas in a block's full pass, [block start, end of canvas) in a prefix window pass, the block in a dual one."""
    from llada_reference import fast_dllm_generate
    llm = kstep.load(llada_path)
    ref = ReferenceLLaDA(llada_path)
    prompt = prompt_ids(6, 4, llm.cfg.vocab_size)
    torch.manual_seed(7)
    expected, expected_nfe = fast_dllm_generate(ref, torch.tensor([prompt]), cache, steps=16, gen_length=32,
                                                block_length=8, mask_id=llm.cfg.mask_token_id, remasking=remasking,
                                                **policy)
    got = llm.generate(prompt, max_tokens=32, block_length=8, steps=16, cache=cache, remasking=remasking, seed=7,
                       early_stop=False, **policy)[0]
    assert got.token_ids == until_stop(expected[0, len(prompt):].tolist(), llm)
    assert got.nfe == expected_nfe
    if cache != "none":
        assert got.timings["num_full_passes"] == 4 and got.timings["num_window_passes"] == got.nfe - 4


def test_defaults_are_dual_cache_and_threshold_with_exact_one_flag_away(llada_path):
    from kstep.params import GenerationParams
    fast = GenerationParams(max_tokens=32).resolve("llada", "diffusion")
    assert (fast.cache, fast.threshold) == ("dual", 0.9)
    assert GenerationParams(max_tokens=32, steps=16).resolve("llada", "diffusion").threshold is None  # steps: fixed
    assert GenerationParams(max_tokens=32, factor=1.0).resolve("llada", "diffusion").threshold is None
    exact = GenerationParams(max_tokens=32, exact=True).resolve("llada", "diffusion")
    assert (exact.cache, exact.threshold, exact.steps) == ("none", None, 32)
    with pytest.raises(ValueError, match="exact"):
        GenerationParams(max_tokens=32, exact=True, threshold=0.5)

    llm = kstep.load(llada_path)
    prompt = prompt_ids(6, 3, llm.cfg.vocab_size)
    default = llm.generate(prompt, max_tokens=32, block_length=8)[0]
    assert default.token_ids == llm.generate(prompt, max_tokens=32, block_length=8, cache="dual",
                                             threshold=0.9)[0].token_ids
    assert llm.generate(prompt, max_tokens=32, block_length=8, exact=True)[0].token_ids == \
        llm.generate(prompt, max_tokens=32, block_length=8, cache="none", steps=32)[0].token_ids
