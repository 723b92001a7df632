"""Block-diffusion families: Fast-dLLM v2 and SDAR checkpoints load from their published layouts,
their forward matches an independent one from raw tensors, and kstep's decoder gives their
reference samplers' tokens at temperature 0 (tests/block_reference.py: restatements checked against
the published code) with no more forward passes; batches with left padding equal single runs."""
import pytest
import torch
from block_reference import (
    FIRST_SPECIAL_ID,
    IM_END_ID,
    MASK_ID,
    ReferenceFastDllmV2,
    ReferenceSDAR,
    fast_dllm_v2_generate,
    sdar_generate,
)

import kstep


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, FIRST_SPECIAL_ID, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def completion(ids: list[int], stop_ids) -> list[int]:
    cut = next((i for i, t in enumerate(ids) if t in stop_ids), len(ids))
    return ids[:cut]


@pytest.mark.parametrize("family", ["fast_dllm_v2", "sdar"])
def test_loads_and_matches_independent_forward(family, v2_path, sdar_path):
    path, reference = (v2_path, ReferenceFastDllmV2) if family == "fast_dllm_v2" else (sdar_path, ReferenceSDAR)
    llm = kstep.load(path)
    assert llm.cfg.family == family and llm.is_diffusion and llm.cfg.mask_token_id == MASK_ID
    ids = torch.tensor([prompt_ids(19, 0), prompt_ids(19, 1)])
    pass_ = llm.runner.block_prefill_pass(ids, None, llm.cfg.block_size, llm.runner.allocate_kv(2, 19))
    pass_.logits_from = 0  # every position's logits
    torch.testing.assert_close(llm.runner.logits(pass_), reference(path)(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt_len,max_tokens,block,sub,threshold", [
    (5, 24, 8, 4, 1.0),     # the prompt inside the first block; one token per pass
    (13, 24, 8, 8, 0.9),    # a prefilled block and a tail
    (16, 16, 8, 4, 0.6),    # the prompt ends on a block boundary: the first token is the prefill's (AR)
    (11, 20, 4, 2, 0.9),
])
def test_fast_dllm_v2_matches_generate(v2_path, prompt_len, max_tokens, block, sub, threshold):
    llm = kstep.load(v2_path)
    ref = ReferenceFastDllmV2(v2_path)
    prompt = prompt_ids(prompt_len, prompt_len)
    expected, expected_nfe = fast_dllm_v2_generate(
        ref, torch.tensor([prompt]), max_new_tokens=max_tokens + block, block_size=block, small_block_size=sub,
        threshold=threshold, mask_id=MASK_ID, stop_token=IM_END_ID)
    got = llm.generate(prompt, max_tokens=max_tokens, block_length=block, sub_block_length=sub,
                       threshold=threshold, fused_commit=False)[0]
    want = completion(expected[0, prompt_len:].tolist(), llm.stop_ids)[:max_tokens]
    assert MASK_ID not in want
    assert got.token_ids == want
    assert got.nfe <= expected_nfe


@pytest.mark.parametrize("prompt_len,max_tokens,block,steps,threshold", [
    (6, 24, 4, 4, 1.0),     # the eval setting: block 4, 4 steps, static
    (9, 20, 4, 4, 0.6),     # dynamic threshold
    (8, 16, 8, 4, 1.0),     # two tokens per pass; the prompt fills a whole block
    (10, 24, 8, 8, 0.9),
])
@pytest.mark.parametrize("fused", [False, True])
def test_sdar_matches_block_diffusion_generate(sdar_path, prompt_len, max_tokens, block, steps, threshold, fused):
    llm = kstep.load(sdar_path)
    ref = ReferenceSDAR(sdar_path)
    prompt = prompt_ids(prompt_len, prompt_len + 1)
    expected, expected_nfe = sdar_generate(
        ref, torch.tensor([prompt]), mask_id=MASK_ID, gen_length=max_tokens, block_length=block,
        denoising_steps=steps, temperature=0.0, remasking_strategy="low_confidence", confidence_threshold=threshold,
        stop_ids=llm.stop_ids, variant="opencompass")
    knobs = {"threshold": threshold} if threshold < 1 else {}
    got = llm.generate(prompt, max_tokens=max_tokens, block_length=block, steps=steps, fused_commit=fused, **knobs)[0]
    want = completion(expected[0, prompt_len:].tolist(), llm.stop_ids)[:max_tokens]
    assert MASK_ID not in want
    assert got.token_ids == want  # a fused commit writes the same keys: SDAR's tokens do not change
    assert got.nfe <= expected_nfe
    if fused:  # ... each block after the first costs one pass less, and a prefill is the first block's first pass
        separate = llm.generate(prompt, max_tokens=max_tokens, block_length=block, steps=steps, fused_commit=False,
                                **knobs)[0]
        blocks_after_first = (prompt_len + len(got.token_ids) - 1) // block - prompt_len // block
        assert got.nfe == separate.nfe - blocks_after_first - (prompt_len >= block)


@pytest.mark.parametrize("family", ["fast_dllm_v2", "sdar"])
def test_left_padded_batch_equals_single_runs(family, v2_path, sdar_path):
    llm = kstep.load(v2_path if family == "fast_dllm_v2" else sdar_path)
    prompts = [prompt_ids(n, n) for n in (3, 9, 14, 8)]
    knobs = dict(max_tokens=20, threshold=0.7)
    batch = llm.generate(prompts, **knobs)
    for prompt, got in zip(prompts, batch, strict=True):
        alone = llm.generate(prompt, **knobs)[0]
        assert got.token_ids == alone.token_ids and got.nfe == alone.nfe


def test_block_defaults_and_refused_knobs(v2_path):
    llm = kstep.load(v2_path)
    params = llm.resolve(kstep.GenerationParams(max_tokens=20))
    assert params.block_length == 8 and params.sub_block_length == 8  # bd_size; v2's small_block_size (8)
    assert params.policy.kind == "threshold" and params.policy.value == 0.9
    exact = llm.resolve(kstep.GenerationParams(max_tokens=20, exact=True))
    assert exact.policy.kind == "fixed" and exact.steps == 8  # one token per pass
    assert params.fused_commit and not exact.fused_commit  # exact: the references' own commit pass
    with pytest.raises(ValueError, match="cache 'prefix'"):  # a block model's cache: 'dual' = v2's block cache
        llm.generate([5, 6], max_tokens=8, cache="prefix")
    with pytest.raises(ValueError, match="steps"):
        llm.generate([5, 6], max_tokens=8, steps=9)


def test_generation_config_sets_the_checkpoint_s_decoding_defaults(v2_path, tmp_path):
    import json
    import shutil
    path = shutil.copytree(v2_path, tmp_path / "v2")
    (path / "generation_config.json").write_text(json.dumps({"threshold": 0.7, "small_block_size": 4}))
    llm = kstep.load(path)
    params = llm.resolve(kstep.GenerationParams(max_tokens=16))
    assert params.policy.value == 0.7 and params.sub_block_length == 4  # Fast-dLLM v2's names, as vLLM reads it
    assert llm.resolve(kstep.GenerationParams(max_tokens=16, threshold=0.9, sub_block_length=8)).policy.value == 0.9
    exact = llm.resolve(kstep.GenerationParams(max_tokens=16, exact=True))  # another policy: no threshold forced
    assert exact.policy.kind == "fixed" and exact.sub_block_length == 4
    assert llm.resolve(kstep.GenerationParams(max_tokens=16, block_length=2)).sub_block_length == 2
    got = llm.generate(prompt_ids(5, 5), max_tokens=16)[0]
    assert got.token_ids == llm.generate(prompt_ids(5, 5), max_tokens=16, threshold=0.7, sub_block_length=4)[0].token_ids


def test_engine_packs_block_requests_and_streams_the_committed_prefix(v2_path):
    """Requests joining at different steps share passes; each gets what it gets alone, and what is
    streamed is only ever the committed prefix (never retracted)."""
    from kstep.engine.engine import Engine
    from kstep.engine.request import Request
    llm = kstep.load(v2_path)
    prompts = [prompt_ids(5, 1), prompt_ids(12, 2), prompt_ids(9, 3)]
    alone = [llm.generate(p, max_tokens=16, threshold=0.8)[0].token_ids for p in prompts]
    engine = Engine(llm)
    requests = [Request([p], kstep.GenerationParams(max_tokens=16, threshold=0.8)) for p in prompts]
    streamed = {r.request_id: [] for r in requests}
    step = 0
    while step == 0 or engine.has_work():
        if step < len(requests):
            engine.add_request(requests[step])  # one joins per step
        outputs, _ = engine.step()
        for out in outputs:
            for choice in out.choices:
                streamed[out.request_id] += choice.token_ids
        step += 1
    for request, expected in zip(requests, alone, strict=True):
        assert completion(request.output_ids[0], llm.stop_ids) == expected
        assert streamed[request.request_id] == expected


def test_bench_compare_sides_follow_the_model_kind(v2_path):
    from kstep.bench.compare import SIDES, default_sides, params_for
    assert default_sides("block-diffusion") == ["block exact", "block exact+self", "block threshold", "ar"]
    assert "diffusion exact" in default_sides("diffusion") and "block exact" not in default_sides("diffusion")
    llm = kstep.load(v2_path)
    for name in ("block exact", "block threshold"):  # the model's own block size, no canvas knobs
        assert llm.resolve(params_for(SIDES[name], 24, 32)).block_length == 8


def test_prefix_cache_shares_whole_prompt_blocks(v2_path):
    """A block-causal prompt's whole blocks do not depend on what follows: requests sharing a
    prefix load its keys/values from the cache, with the same output as without it."""
    from kstep.engine.engine import Engine
    from kstep.engine.request import Request
    llm = kstep.load(v2_path)
    header = prompt_ids(40, 9)
    prompts = [header + prompt_ids(n, n) for n in (3, 7, 12)]

    def run(engine):
        requests = [Request([p], kstep.GenerationParams(max_tokens=12, threshold=0.8)) for p in prompts]
        for r in requests:
            engine.add_request(r)
            while engine.has_work():  # one after another: the later ones find the header
                engine.step()
        return [r.output_ids[0] for r in requests]

    plain = run(Engine(llm))
    cached_engine = Engine(llm, prefix_cache_bytes=64 << 20)
    assert run(cached_engine) == plain
    assert cached_engine.prefix_cache.hit_tokens >= 2 * 32  # the header's whole cache blocks, twice


@pytest.mark.parametrize("prompt_len", [13, 16])  # mid-block, and on a boundary (the first token is an AR step)
def test_first_token_constraint_holds_at_a_block_boundary(v2_path, prompt_len):
    """Token healing's constraint (and min_tokens) also bind the AR first token of a block."""
    from kstep.decoding.loop import decode_alone
    llm = kstep.load(v2_path)
    params = llm.resolve(kstep.GenerationParams(max_tokens=8, threshold=0.8))
    prompt = prompt_ids(prompt_len, 4)
    free = llm.generate(prompt, params)[0].token_ids
    allowed = [t for t in range(20, 40) if t != free[0]]
    rows, _ = decode_alone(llm.make_decoder([prompt], params, first_tokens=[allowed]))
    assert rows[0][0] in allowed


def test_a_one_block_prompt_is_read_although_fast_dllm_v2_batch_sample_skips_it(v2_path):
    """Fast-dLLM v2's `batch_sample` (and `generate`) prefill the prompt only when the shortest is
    longer than a block (`min_len > block_size`): a prompt of exactly one block is never seen by the
    block it decodes first, so every such prompt gives the same output. Judged an off-by-one (`>=`
    meant): kstep reads the prompt, as batch_sample itself does for that row beside a shorter prompt."""
    from block_reference import fast_dllm_v2_batch_sample
    llm, ref = kstep.load(v2_path), ReferenceFastDllmV2(v2_path)
    settings = dict(max_new_tokens=16, block_size=8, small_block_size=4, threshold=0.9, mask_id=MASK_ID,
                    stop_token=IM_END_ID, attn_block_size=8)
    prompt, other = prompt_ids(8, 21), prompt_ids(8, 22)
    [alone], _ = fast_dllm_v2_batch_sample(ref, [torch.tensor(prompt)], **settings)
    [other_alone], _ = fast_dllm_v2_batch_sample(ref, [torch.tensor(other)], **settings)
    assert alone[8:].tolist() == other_alone[8:].tolist()  # the reference's bug: the prompt is not read
    [beside, _], _ = fast_dllm_v2_batch_sample(ref, [torch.tensor(prompt), torch.tensor(prompt_ids(5, 23))],
                                              **settings)
    got = llm.generate(prompt, max_tokens=16, block_length=8, sub_block_length=4, threshold=0.9,
                       fused_commit=False)[0]
    assert got.token_ids == completion(beside[8:].tolist(), llm.stop_ids)[:16]
    assert got.token_ids != completion(alone[8:].tolist(), llm.stop_ids)[:16]


def test_block_confidence_is_the_probability_under_the_filtered_sampling_distribution(sdar_path):
    """SDAR's generate.py scores a sampled token under the top-k / top-p filtered distribution it was
    drawn from (Fast-dLLM v2 and LLaDA2 too): at temperature 1 with top_k 1 every position is fully
    confident and a whole block unmasks in one pass. Not a bug (the distribution sampled is the one
    scored), so kstep does the same."""
    llm, ref = kstep.load(sdar_path), ReferenceSDAR(sdar_path)
    prompt = prompt_ids(6, 31)
    expected, expected_nfe = sdar_generate(
        ref, torch.tensor([prompt]), mask_id=MASK_ID, gen_length=16, block_length=4, denoising_steps=4,
        temperature=1.0, top_k=1, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.9,
        stop_ids=llm.stop_ids, variant="generate")
    got = llm.generate(prompt, max_tokens=16, block_length=4, steps=4, threshold=0.9, temperature=1.0, top_k=1,
                       seed=0, fused_commit=False)[0]
    assert got.token_ids == completion(expected[0, 6:].tolist(), llm.stop_ids)[:16]
    assert got.nfe <= expected_nfe
    greedy = llm.generate(prompt, max_tokens=16, block_length=4, steps=4, threshold=0.9, fused_commit=False)[0]
    assert got.nfe < greedy.nfe  # whole blocks per pass, where greedy decoding goes by confidence


@pytest.mark.parametrize("prompt_len,max_tokens,block,sub,threshold", [
    (5, 24, 8, 4, 0.9),     # the prompt inside the first block
    (13, 24, 8, 2, 0.7),    # a prefilled block and a tail
    (16, 16, 8, 4, 0.5),    # the prompt ends on a block boundary
    (11, 32, 16, 4, 0.9),
    (7, 24, 8, 8, 0.6),     # one sub-block per block
])
def test_fast_dllm_v2_block_cache_matches_use_block_cache(v2_path, prompt_len, max_tokens, block, sub, threshold):
    """cache='dual' on a Fast-dLLM v2 model = its generate with use_block_cache=True: a sub-block's
    passes run only the sub-block, against the block's cached keys (approximate, as its reference)."""
    llm, ref = kstep.load(v2_path), ReferenceFastDllmV2(v2_path)
    prompt = prompt_ids(prompt_len, prompt_len + 3)
    expected, expected_nfe = fast_dllm_v2_generate(
        ref, torch.tensor([prompt]), max_new_tokens=max_tokens + block, block_size=block, small_block_size=sub,
        threshold=threshold, mask_id=MASK_ID, stop_token=IM_END_ID, use_block_cache=True)
    settings = dict(max_tokens=max_tokens, block_length=block, sub_block_length=sub, threshold=threshold,
                    fused_commit=False)
    got = llm.generate(prompt, cache="dual", **settings)[0]
    assert got.token_ids == completion(expected[0, prompt_len:].tolist(), llm.stop_ids)[:max_tokens]
    assert got.nfe <= expected_nfe


def test_block_cache_changes_tokens_where_its_reference_does(v2_path):
    """The block cache is approximate: on some prompts it gives other tokens than whole-block passes,
    and there too it gives its reference's (so the parity above is not the exact cache in disguise)."""
    llm, ref = kstep.load(v2_path), ReferenceFastDllmV2(v2_path)
    settings = dict(max_tokens=24, block_length=8, sub_block_length=2, threshold=0.7, fused_commit=False)
    changed = 0
    for n in (3, 4, 5, 6, 7, 9, 10, 11, 12):  # not 8: the reference never reads a one-block prompt (above)
        prompt = prompt_ids(n, n + 3)
        cached, whole = llm.generate(prompt, cache="dual", **settings)[0], llm.generate(prompt, **settings)[0]
        if cached.token_ids != whole.token_ids:
            changed += 1
            expected, _ = fast_dllm_v2_generate(ref, torch.tensor([prompt]), max_new_tokens=32, block_size=8,
                                                small_block_size=2, threshold=0.7, mask_id=MASK_ID,
                                                stop_token=IM_END_ID, use_block_cache=True)
            assert cached.token_ids == completion(expected[0, n:].tolist(), llm.stop_ids)[:24]
    assert changed, "no prompt of this grid is changed by the block cache"


def test_block_cache_batch_equals_single_runs(v2_path):
    """Rows that disagree (one starting a sub-block, one inside one) share whole-block passes; each
    keeps its own block cache, so each row gets what it gets alone."""
    llm = kstep.load(v2_path)
    prompts = [prompt_ids(n, 50 + n) for n in (3, 9, 14, 6)]
    settings = dict(max_tokens=24, block_length=8, sub_block_length=2, threshold=0.5, cache="dual")
    for prompt, got in zip(prompts, llm.generate(prompts, **settings), strict=True):
        alone = llm.generate(prompt, **settings)[0]
        assert got.token_ids == alone.token_ids and got.nfe == alone.nfe
