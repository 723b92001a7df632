"""Top tokens from vocabulary shards (kstep/runner/top_tokens.py): the merge of shard-local
statistics equals the dense formulas (argmax with the mask excluded, its probability, the top-2
margin, the entropy) with uneven shards, ties and an empty shard; and every decoder's greedy path
gives the same tokens from top tokens as from logits (one device, the runner made to compute them:
what a tensor-parallel runner returns)."""
import pytest
import torch

import kstep
from kstep.random_checkpoint import write_random_checkpoint
from kstep.runner.top_tokens import TopRequest, TopTokens, local_stats, merge

SHARDS = [5, 11, 0, 7]  # uneven, one empty (a rank of vocabulary padding only)


def sharded(logits: torch.Tensor, request: TopRequest) -> TopTokens:
    stats, start = [], 0
    for width in SHARDS:
        stats.append(local_stats(logits[:, start:start + width], start, request))
        start += width
    return merge(torch.stack(stats, 1))


@pytest.mark.parametrize("exclude", [None, 0, 7, 22])  # none, in the first, the second, the last shard
def test_the_merge_equals_the_dense_formulas(exclude):
    torch.manual_seed(0)
    V = sum(SHARDS)
    logits = torch.randn(64, V) * 3
    logits[1, [2, 9]] = logits[1].max() + 1  # a tie across shards: the smaller id wins
    logits[2, [12, 13]] = logits[2].max() + 1  # a tie inside a shard
    logits[3, :] = 0.5  # every token tied
    logits[4, [7, 8]] = logits[4].max() + 1  # the top token excluded where exclude = 7
    got = sharded(logits, TopRequest(exclude, needs_margin=True, needs_entropy=True))
    proposal = logits.clone()
    if exclude is not None:
        proposal[:, exclude] = float("-inf")
    probs = logits.softmax(-1)
    ids = proposal.argmax(-1)
    assert torch.equal(got.ids, ids)
    assert got.ids[1] == (2 if exclude != 2 else 9) and got.ids[2] == 12 and got.ids[3] == (0 if exclude != 0 else 1)
    torch.testing.assert_close(got.prob, probs.gather(-1, ids[:, None]).squeeze(-1))
    top2 = probs.topk(2, -1).values
    torch.testing.assert_close(got.margin, top2[:, 0] - top2[:, 1])
    assert got.margin[1] == 0 and got.margin[3] == 0  # tied top two
    torch.testing.assert_close(got.neg_entropy, (probs * logits.log_softmax(-1)).sum(-1))


def test_positions_index_as_logits_do():
    tops = sharded(torch.randn(6, sum(SHARDS)), TopRequest()).view(2, 3, -1)
    picked = tops.gather(1, torch.tensor([[2], [0]])[:, :, None].expand(-1, -1, tops.shape[-1]))
    assert isinstance(picked, TopTokens) and isinstance(tops[:, -1], TopTokens)
    assert torch.equal(picked.ids.squeeze(1), torch.stack([tops.ids[0, 2], tops.ids[1, 0]]))


FAMILIES = {  # greedy settings that reach every rule a decoder scores with
    "llama": [{}, {"min_tokens": 3}],
    "llada": [{}, {"exact": True, "remasking": "margin"}, {"exact": True, "remasking": "entropy", "steps": 16},
              {"exact": True, "remasking": "random", "seed": 3}, {"factor": 1.0}],
    "dream": [{"exact": True}, {}, {"exact": True, "remasking": "margin"}],
    "fast_dllm_v2": [{}, {"cache": "dual"}],
    "sdar": [{"steps": 2}],
    "llada2_moe": [{"editing_threshold": 0.5, "max_post_steps": 4}],
    "nemotron_labs_diffusion": [{}, {"mode": "ar"}, {"mode": "linear_spec"}],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_decoders_give_the_same_tokens_from_top_tokens(tmp_path, family):
    llm = kstep.load(write_random_checkpoint(tmp_path, family=family, seed=7))
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    for settings in FAMILIES[family]:
        want = llm.generate(prompts, max_tokens=24, **settings)
        llm.runner.computes_top_tokens = True
        got = llm.generate(prompts, max_tokens=24, **settings)
        llm.runner.computes_top_tokens = False
        assert [r.token_ids for r in got] == [r.token_ids for r in want], settings
        assert [r.nfe for r in got] == [r.nfe for r in want], settings
