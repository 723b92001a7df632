"""Top tokens from vocabulary shards (kstep/runner/top_tokens.py): the merge of shard-local
statistics equals the dense formulas (argmax with the mask excluded, its probability, the top-2
margin, the entropy) with uneven shards, ties and an empty shard; a PassOutput gives the same views
and moves positions the same way whichever it holds (runner/pass_output.py); and every decoder's
greedy path gives the same tokens from top tokens as from logits (one device, the runner made to
compute them: what a tensor-parallel runner returns)."""
import pytest
import torch

import kstep
from kstep.random_checkpoint import write_random_checkpoint
from kstep.decoding.unmask import entropy, low_confidence, margin
from kstep.runner.pass_output import PassOutput
from kstep.runner.top_tokens import TopRequest, local_stats, merge

SHARDS = [5, 11, 0, 7]  # uneven, one empty (a rank of vocabulary padding only)


def sharded(logits: torch.Tensor, request: TopRequest) -> PassOutput:
    stats, start = [], 0
    for width in SHARDS:
        stats.append(local_stats(logits[:, start:start + width], start, request))
        start += width
    return PassOutput.of_top_tokens(merge(torch.stack(stats, 1)), request.exclude_id)


def column(out: PassOutput, name: str) -> torch.Tensor:
    return out.read(name, lambda logits: pytest.fail("top tokens read as logits"))


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
    got_ids = column(got, "ids")
    assert torch.equal(got_ids, ids)
    assert got_ids[1] == (2 if exclude != 2 else 9) and got_ids[2] == 12 and got_ids[3] == (0 if exclude != 0 else 1)
    torch.testing.assert_close(column(got, "prob"), probs.gather(-1, ids[:, None]).squeeze(-1))
    top2 = probs.topk(2, -1).values
    torch.testing.assert_close(column(got, "margin"), top2[:, 0] - top2[:, 1])
    assert column(got, "margin")[1] == 0 and column(got, "margin")[3] == 0  # tied top two
    torch.testing.assert_close(column(got, "neg_entropy"), (probs * logits.log_softmax(-1)).sum(-1))


def test_a_pass_output_gives_the_same_views_and_positions_from_logits_and_top_tokens():
    torch.manual_seed(1)
    logits = torch.randn(6, sum(SHARDS)) * 3
    dense = PassOutput.of_logits(logits).excluding(4).view(2, 3)
    tops = sharded(logits, TopRequest(4, needs_margin=True, needs_entropy=True)).view(2, 3)
    ids = dense.argmax()
    assert torch.equal(tops.argmax(), ids) and not bool((ids == 4).any())
    raw = PassOutput.of_logits(logits).view(2, 3)  # the rules score the unexcluded logits
    for rule in (low_confidence, margin, entropy):
        torch.testing.assert_close(rule(tops, ids, None), rule(raw, ids, None))
    index, columns = torch.tensor([[2, 0], [1, 1]]), torch.tensor([3, 0, 4])
    for moved in (lambda o: o.gather(index), lambda o: o[:, -1], lambda o: o.spread(5, columns),
                  lambda o: o[:, :2].scatter(4, index + 1)):
        assert torch.equal(moved(tops).argmax(), moved(dense).argmax())
        assert moved(tops).shape == moved(dense).shape
    with pytest.raises(RuntimeError, match="read the logits of a top-token pass"):
        tops.logits


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
