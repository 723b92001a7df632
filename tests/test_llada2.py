"""The MoE families against their references (tests/moe_reference.py: restatements checked against the
published remote code, 2,602 cases identical), on tiny checkpoints written in the released layouts:
forward logits, every router's expert ids and weights, LLaDA2.0's generate and LLaDA2.1's token
editing token for token with no more forward passes, over grids of block length, steps, thresholds
and edit settings; LLaDA-MoE on LLaDA's exact sampler and Fast-dLLM's threshold (its factor, CFG, seeded
`random` remasking and the prefix / dual caches: tests/test_moe_families.py)."""
import pytest
import torch
from llada_reference import fast_dllm_generate, reference_generate
from moe_reference import (
    ENDOFTEXT_ID,
    FIRST_SPECIAL_ID,
    MASK_ID,
    ReferenceLLaDA2,
    ReferenceLLaDAMoE,
    block_causal_mask,
    llada2_generate,
    llada21_generate,
    write_llada2_checkpoint,
    write_llada_moe_checkpoint,
)

import kstep


@pytest.fixture(scope="module")
def llada2_path(tmp_path_factory):
    return write_llada2_checkpoint(tmp_path_factory.mktemp("llada2"), seed=0, sharded=True)


@pytest.fixture(scope="module")
def llada2(llada2_path):
    return kstep.load(llada2_path), ReferenceLLaDA2(llada2_path)


@pytest.fixture(scope="module")
def lladamoe_path(tmp_path_factory):
    return write_llada_moe_checkpoint(tmp_path_factory.mktemp("lladamoe"), seed=1, num_key_value_heads=2,
                                      moe_router_enable_expert_bias=True, shared_expert_intermediate_size=48)


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, FIRST_SPECIAL_ID, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def until_stop(ids: list[int], llm) -> list[int]:
    return ids[:next((i for i, t in enumerate(ids) if t in llm.stop_ids), len(ids))]


def kstep_routing(llm, run) -> list:
    """Each MoE layer's (expert ids sorted per token, their weights) during `run()`."""
    layers = [layer.mlp for layer in llm.model.layers if hasattr(layer.mlp, "router")]
    for moe in layers:
        moe.keep_routing = True
    run()
    out = []
    for moe in layers:
        moe.keep_routing = False
        ids, order = moe.last_routing.expert_ids.sort(-1)
        out.append((ids, moe.last_routing.weights.gather(1, order)))
    return out


def test_llada2_loads_as_released_and_matches_the_reference_forward_and_routers(llada2):
    llm, ref = llada2
    cfg = llm.cfg
    assert cfg.family == "llada2_moe" and cfg.mask_token_id == MASK_ID and ENDOFTEXT_ID in llm.stop_ids
    assert cfg.moe.dense_layers == (0,) and cfg.rotary_width < cfg.head_dim and cfg.moe.shared_dim
    ids = torch.tensor([prompt_ids(21, 0)])
    mask = block_causal_mask(21, 8)
    pass_ = llm.runner.block_prefill_pass(ids, None, 8, llm.runner.allocate_kv(1, 21))
    pass_.logits_from = 0  # every position's logits
    got = kstep_routing(llm, lambda: llm.runner.logits(pass_))
    torch.testing.assert_close(llm.runner.logits(pass_), ref(ids, mask=mask), atol=1e-4, rtol=1e-4)
    want = ref.router_choices(ids, mask=mask)
    assert len(got) == len(want) == cfg.n_layers - 1
    for (got_ids, got_w), (want_ids, want_w) in zip(got, want):
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)


GRID_2_0 = [  # prompt length, max_tokens, block, steps, threshold
    (5, 24, 8, 8, 0.95), (5, 24, 8, 4, 0.95), (16, 16, 8, 8, 0.5), (13, 20, 4, 4, 1.0),
    (9, 12, 4, 2, 0.5), (3, 40, 32, 32, 0.95), (3, 16, 32, 32, 0.5), (21, 24, 8, 3, 0.95),
]


@pytest.mark.parametrize("prompt_len,max_tokens,block,steps,threshold", GRID_2_0)
def test_llada2_generate_matches_token_for_token_with_no_more_passes(llada2, prompt_len, max_tokens, block, steps,
                                                                   threshold):
    llm, ref = llada2
    prompt = prompt_ids(prompt_len, prompt_len + block)
    expected, expected_nfe = llada2_generate(ref, prompt, max_tokens, block_length=block, steps=steps,
                                             threshold=threshold, eos_id=ENDOFTEXT_ID, mask_id=MASK_ID)
    got = llm.generate(prompt, max_tokens=max_tokens, block_length=block, steps=steps, threshold=threshold)[0]
    assert got.token_ids == until_stop(expected.tolist(), llm)
    assert got.nfe <= expected_nfe


def test_llada2_defaults_are_its_generate_defaults(llada2):
    llm, ref = llada2
    params = llm.resolve(kstep.GenerationParams(max_tokens=16))
    assert params.block_length == 32 and params.threshold == 0.95 and params.fused_commit
    prompt = prompt_ids(6, 1)
    expected, expected_nfe = llada2_generate(ref, prompt, 16, eos_id=ENDOFTEXT_ID, mask_id=MASK_ID)
    got = llm.generate(prompt, max_tokens=16)[0]  # gen 16 < steps 32: the reference runs 16 steps of 2
    assert got.token_ids == until_stop(expected.tolist(), llm) and got.nfe <= expected_nfe


def test_llada2_stops_after_an_end_token_and_batches_with_padding(llada2):
    llm, ref = llada2
    prompts = [prompt_ids(n, 40 + n) for n in (3, 9, 14, 8)]
    settings = dict(max_tokens=24, block_length=8, threshold=0.5)
    batch = llm.generate(prompts, **settings)
    for prompt, got in zip(prompts, batch, strict=True):
        alone = llm.generate(prompt, **settings)[0]
        assert got.token_ids == alone.token_ids and got.nfe == alone.nfe
        expected, _ = llada2_generate(ref, prompt, 24, block_length=8, steps=8, threshold=0.5, eos_id=ENDOFTEXT_ID,
                                      mask_id=MASK_ID)
        assert got.token_ids == until_stop(expected.tolist(), llm)
    # an end token inside a block: the row stops there, as the reference's cut does, in fewer passes
    stopped = 0
    for seed in range(12):
        prompt = prompt_ids(5, 100 + seed)
        expected, expected_nfe = llada2_generate(ref, prompt, 32, block_length=8, steps=8, threshold=0.95,
                                                 eos_id=ENDOFTEXT_ID, mask_id=MASK_ID)
        got = llm.generate(prompt, max_tokens=32, block_length=8, steps=8)[0]
        assert got.token_ids == until_stop(expected.tolist(), llm) and got.nfe <= expected_nfe
        if ENDOFTEXT_ID in expected.tolist() and len(expected) % 8:  # an end token inside a block
            assert got.finish_reason == "stop"
            stopped += 1
    assert stopped, "no prompt of this grid ended inside a block"


GRID_2_1 = [  # prompt length, max_tokens, block, threshold, editing threshold, max post steps
    (5, 24, 8, 0.95, 0.5, 16), (5, 24, 8, 0.5, 0.1, 16), (16, 16, 8, 0.95, 0.1, 2), (13, 20, 4, 0.5, 0.1, 0),
    (9, 24, 8, 0.9, 0.3, 2), (3, 32, 32, 0.95, 0.1, 16),
]


@pytest.mark.parametrize("prompt_len,max_tokens,block,threshold,editing,post", GRID_2_1)
def test_llada21_token_editing_matches_token_for_token(llada2, prompt_len, max_tokens, block, threshold, editing,
                                                       post):
    llm, ref = llada2
    prompt = prompt_ids(prompt_len, prompt_len + 7)
    expected, expected_nfe, trace = llada21_generate(
        ref, prompt, max_tokens, block_length=block, threshold=threshold, editing_threshold=editing,
        max_post_steps=post, eos_id=ENDOFTEXT_ID, mask_id=MASK_ID, return_trace=True)
    got = llm.generate(prompt, max_tokens=max_tokens, block_length=block, threshold=threshold,
                       editing_threshold=editing, max_post_steps=post)[0]
    assert got.token_ids == until_stop(expected.tolist(), llm)
    assert got.nfe <= expected_nfe


def test_llada21_edits_happen_and_padded_batches_equal_single_runs(llada2):
    llm, ref = llada2
    prompts = [prompt_ids(n, 60 + n) for n in (4, 11, 7)]
    settings = dict(max_tokens=24, block_length=8, threshold=0.5, editing_threshold=0.1, max_post_steps=4)
    edits = 0
    for prompt in prompts:
        _, _, trace = llada21_generate(ref, prompt, 24, block_length=8, threshold=0.5, editing_threshold=0.1,
                                       max_post_steps=4, eos_id=ENDOFTEXT_ID, mask_id=MASK_ID, return_trace=True)
        edits += sum(len(t2t) for _, t2t in trace)
    assert edits > 0, "the grid must exercise edits"
    for prompt, got in zip(prompts, llm.generate(prompts, **settings), strict=True):
        alone = llm.generate(prompt, **settings)[0]
        assert got.token_ids == alone.token_ids and got.nfe == alone.nfe


def test_llada_moe_matches_its_reference_forward_routers_and_samplers(lladamoe_path):
    llm, ref = kstep.load(lladamoe_path), ReferenceLLaDAMoE(lladamoe_path)
    cfg = llm.cfg
    assert cfg.family == "llada_moe" and cfg.mask_token_id == MASK_ID and not cfg.moe.renormalize
    ids = torch.tensor([prompt_ids(19, 5)])
    positions = torch.arange(19)[None]
    got = kstep_routing(llm, lambda: llm.model(ids, positions))
    with torch.no_grad():
        torch.testing.assert_close(llm.model(ids, positions), ref(ids), atol=1e-4, rtol=1e-4)
    for (got_ids, got_w), (want_ids, want_w) in zip(got, ref.router_choices(ids), strict=True):
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)  # raw probabilities + bias
    prompt = prompt_ids(6, 9)
    expected = reference_generate(ref, torch.tensor([prompt]), steps=16, gen_length=16, block_length=8,
                                  mask_id=MASK_ID)
    exact = llm.generate(prompt, max_tokens=16, block_length=8, steps=16, exact=True, early_stop=False)[0]
    assert exact.token_ids == until_stop(expected[0, 6:].tolist(), llm) and exact.nfe == 16
    # Fast-dLLM's threshold decoding without a cache (ReferenceLLaDAMoE has no KV cache; the prefix and dual
    # caches run on test_moe_families.py's CachedLLaDAMoE)
    expected, expected_nfe = fast_dllm_generate(ref, torch.tensor([prompt]), "none", steps=16, gen_length=32,
                                                block_length=8, mask_id=MASK_ID, threshold=0.5)
    got = llm.generate(prompt, max_tokens=32, block_length=8, steps=16, cache="none", threshold=0.5,
                       early_stop=False)[0]
    assert got.token_ids == until_stop(expected[0, 6:].tolist(), llm) and got.nfe == expected_nfe


def test_llada_moe_padded_batch_equals_single_runs(lladamoe_path):
    llm = kstep.load(lladamoe_path)
    prompts = [prompt_ids(n, 70 + n) for n in (3, 12, 7)]
    for prompt, got in zip(prompts, llm.generate(prompts, max_tokens=16), strict=True):
        alone = llm.generate(prompt, max_tokens=16)[0]
        assert got.token_ids == alone.token_ids and got.nfe == alone.nfe


def test_prefix_cache_shares_llada2_prompt_blocks_with_the_fused_prefill(llada2):
    """Whole prompt blocks of 32 are shared across requests (block-causal keys do not depend on what
    follows); the prefill that also runs the first block loads them, with the same output."""
    from kstep.engine.engine import Engine
    from kstep.engine.request import Request
    llm, _ = llada2
    header = prompt_ids(70, 9)
    prompts = [header + prompt_ids(n, n) for n in (3, 7, 30)]

    def run(engine):
        requests = [Request([p], kstep.GenerationParams(max_tokens=12, threshold=0.5)) for p in prompts]
        for r in requests:
            engine.add_request(r)
            while engine.has_work():
                engine.step()
        return [r.output_ids[0] for r in requests]

    plain = run(Engine(llm))
    cached = Engine(llm, prefix_cache_bytes=64 << 20)
    assert run(cached) == plain
    assert cached.prefix_cache.hit_tokens >= 2 * 32
