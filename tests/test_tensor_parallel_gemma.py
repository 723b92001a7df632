"""DiffusionGemma tensor and expert parallel on the CPU: 2 ranks over gloo (spawned processes, one
thread each). TP=2 gives TP=1's tokens and passes, one decoder pass and its self-conditioning cost
the collectives the scheme says, the soft embeddings the other ranks keep are freed with rank 0's,
and sizes that do not divide are refused naming the numbers before any rank starts."""
import gc
import os

import pytest
import torch

import kstep
from kstep.distributed.launch import check_supported
from kstep.distributed.sharding_gemma import plan_shard
from kstep.random_checkpoint import random_config, write_random_checkpoint

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 39))]  # 19 tokens: past the sliding window of 16
# Canvases of 16, so 40 tokens take three (two commit passes). The seeded run keeps to 3 passes per
# canvas: this random checkpoint's self-conditioning loop multiplies a rounding difference about
# tenfold per pass (the dense model does the same to a 1e-6 change of its soft embedding), and the
# ranks' sums round differently from one matmul, so over more passes no two summation orders give the
# same samples. At temperature 0 the soft embedding is one embedding row (exact): every pass runs.
SETTINGS = [{"temperature": 0}, {"temperature": 0, "seed": 5},
            {"temperature": 1.0, "seed": 3, "max_denoising_steps": 3}]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """TP=1 and TP=2 of a tiny DiffusionGemma: layer 0 sliding with 2 key/value heads (split), layer 1
    full with 1 (replicated on both ranks), 8 experts (4 a rank), a vocabulary of 503 (padded to 504)."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("gemma"), family="diffusion_gemma", seed=7,
                                   vocab_size=503, d_model=32, ffn_dim=64)
    one, two = kstep.load(path), kstep.load(path, tensor_parallel_size=2)
    assert two.cfg.layer_kv_heads == (2, 1) and [layer.attn.n_kv_heads for layer in two.model.layers] == [1, 1]
    yield one, two
    two.close()


def test_two_ranks_generate_what_one_does(gemma):
    one, two = gemma
    for settings in SETTINGS:
        want = one.generate(PROMPTS, max_tokens=40, **settings)
        got = two.generate(PROMPTS, max_tokens=40, **settings)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], settings
        assert [r.nfe for r in got] == [r.nfe for r in want], settings
    ids = torch.tensor([PROMPTS[1]])
    positions = torch.arange(ids.shape[1])[None]
    torch.testing.assert_close(two.runner.whole_pass(ids, positions), one.model(ids, positions))  # the budget's timing


def test_one_pass_collectives_and_the_soft_embeddings_kept_are_freed(gemma):
    _, two = gemma
    runner, layers = two.runner, two.cfg.n_layers
    experts = two.model.layers[0].experts
    assert (experts.num_experts, experts.first) == (4, 0)  # whole experts
    decoder = two.make_decoder(PROMPTS, two.resolve(kstep.GenerationParams(max_tokens=16, temperature=1.0, seed=3)))

    def step() -> dict:
        runner.group.counts.clear()
        decoder.update(runner.execute(decoder.next_passes()))
        return dict(runner.group.counts)
    # the prefill (encoder): three all-reduces per layer (attention, MLP, experts) and the embedding's; no logits
    assert step() == {"message": 1, "all_reduce": 3 * layers + 1}
    step()  # the canvas's first decoder pass: no self-conditioning yet
    # a self-conditioned decoder pass: the above, sc_mlp's all-reduce and the head's gather; then the next
    # soft embedding: a message, the scatter of the probabilities by vocabulary slice, one all-reduce
    assert step() == {"message": 2, "all_reduce": 3 * layers + 1 + 1 + 1, "gather": 1, "scatter": 1}
    assert runner.report() == [{"kv_caches": [decoder.kv.kv_id],
                                "soft_embeds": [decoder.soft.soft_id]}]  # the earlier one already dropped
    del decoder
    gc.collect()
    assert runner.report() == [{"kv_caches": [], "soft_embeds": []}]


def test_sizes_that_do_not_divide_are_refused_naming_the_numbers():
    cfg = random_config("diffusion_gemma", 500)  # 4 heads; key/value heads: 2 (sliding), 1 (full)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the 4 attention heads"):
        check_supported(cfg, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 and layer 0's 3 key/value heads: one must divide"):
        check_supported(random_config("diffusion_gemma", 500, n_heads=6, n_kv_heads=3), 2)
    with pytest.raises(ValueError, match="does not divide the 6 experts"):
        check_supported(random_config("diffusion_gemma", 500, num_experts=6), 4)
    with pytest.raises(ValueError, match="does not divide the 66 hidden units of the MLP"):
        check_supported(random_config("diffusion_gemma", 500, ffn_dim=66), 4)
    shard = plan_shard(cfg, 1, 2)  # the full layer's one key/value head kept by both ranks
    assert (shard.heads, shard.kv_heads, shard.vocab) == ((2, 4), ((1, 2), (0, 1)), (250, 500))
