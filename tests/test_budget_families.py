"""Time budgets on every family (issue 28): the planner's worst case counts what each decoder runs,
its coarser plans too (planned passes >= the nfe of a run on random weights, and = the nfe of a run
forced to its worst: nothing confident, editing that never settles, canvases that never stop), a
tight budget on a block model coarsens (LLaDA2.1's editing first loses post steps) instead of being
refused, and the same request gets the same answer twice."""
import contextlib
import re
from dataclasses import replace

import pytest
import torch

import kstep
from kstep.budget.planner import MARGIN, PassCosts
from kstep.budget.costs import WINDOW
from kstep.random_checkpoint import write_random_checkpoint
from kstep.runner.pass_output import PassOutput


@pytest.fixture(scope="module")
def llada2_path(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("llada2"), family="llada2_moe", seed=0)


@pytest.fixture(scope="module")
def dream_path(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("dream"), family="dream", seed=1)


def one_second_per_pass() -> PassCosts:
    """A table where every pass takes a second: predicted seconds = planned passes."""
    costs = PassCosts()
    for tokens in (1, 8, 64):
        costs.observe(tokens, tokens, 1.0)
    return costs


@contextlib.contextmanager
def forced_worst(llm, editing: bool):
    """Every pass's logits replaced: noise around uniform (no confidence near any threshold); with
    editing, every position's token alternates between two ids at probability 1, so every pass edits."""
    real, calls, noise = llm.runner.execute, [0], torch.Generator().manual_seed(0)

    def execute(passes):
        calls[0] += 1
        out = []
        for output in real(passes):
            forced = torch.randn(output.logits.shape, generator=noise) * 0.01
            if editing:
                forced[..., 100 + calls[0] % 2] = 40.0
            out.append(PassOutput.of_logits(forced))
        return out

    llm.runner.execute = execute
    try:
        yield
    finally:
        del llm.runner.execute


def plan_with(llm, params, prompt_len: int, budget: float):
    llm.pass_costs = one_second_per_pass()  # each time: runs refresh the model's table
    return llm.plan_budget(replace(params, time_budget=budget), prompt_len)


EDITING = {"editing_threshold": 0.5, "threshold": 1.0}  # masks by count only: the threshold is never met
# (checkpoint, knobs, [(prompt, max_tokens)]): the first lengths end on a block boundary (then the
# worst case is exact: no position past max_tokens in the last block), the last does not.
BLOCK = [(20, 44), (35, 61), (20, 40)]  # blocks of 32: no prefill; a prefill; a last block cut short
CASES = [
    ("llada2_path", {}, BLOCK),
    ("llada2_path", {"fused_commit": False}, BLOCK),
    ("llada2_path", EDITING, BLOCK),
    ("llada2_path", {**EDITING, "max_post_steps": 3, "fused_commit": False}, BLOCK),
    ("sdar_path", {}, [(5, 27), (8, 24), (5, 25)]),
    ("sdar_path", {"fused_commit": False}, [(5, 27), (8, 24), (5, 25)]),
    ("v2_path", {}, [(5, 27), (8, 24), (5, 25)]),  # shifted: the commit writes a block's first token
    ("v2_path", {"block_length": 16, "sub_block_length": 8, "cache": "dual"}, [(5, 27), (16, 16), (5, 20)]),
    ("llada_path", {}, [(5, 32)]),
    ("dream_path", {}, [(5, 32)]),
    ("gemma_path", {}, [(5, 16), (9, 20)]),
]


@pytest.mark.parametrize("fixture,knobs,lengths", CASES,
                         ids=[f"{c[0].removesuffix('_path')}-{'-'.join(c[1]) or 'default'}" for c in CASES])
def test_the_planned_worst_case_is_what_the_decoder_runs_at_worst(fixture, knobs, lengths, request):
    llm = kstep.load(request.getfixturevalue(fixture))
    uniform = llm.kind == "uniform-diffusion"
    for i, (P, N) in enumerate(lengths):
        prompt = [10 + (7 * k) % 200 for k in range(P)]
        params = llm.resolve(kstep.GenerationParams(max_tokens=N, min_tokens=N, **knobs))
        worst = plan_with(llm, params, P, 1e9)
        assert replace(worst.params, time_budget=None) == params  # an ample budget changes nothing
        for budget in (1e9, 0.6 * worst.passes / MARGIN, 0.3 * worst.passes / MARGIN):
            try:
                chosen = plan_with(llm, params, P, budget)
            except ValueError as refused:  # only below what the coarsest setting takes
                assert float(re.search(r"below the ([0-9.e-]+) s", str(refused)).group(1)) > budget
                continue
            assert chosen.predicted_seconds <= MARGIN * budget
            assert chosen.predicted_seconds == pytest.approx(chosen.passes)  # a second a pass
            run = replace(chosen.params, time_budget=None)
            random_nfe = llm.generate(prompt, run)[0].nfe
            if uniform:  # canvases that never stop: every one runs all its passes
                forced_nfe = llm.generate(prompt, replace(run, confidence_threshold=0.0))[0].nfe
            else:
                with forced_worst(llm, "editing_threshold" in knobs):
                    forced_nfe = llm.generate(prompt, run)[0].nfe
            assert random_nfe <= chosen.passes and forced_nfe <= chosen.passes, (P, N, budget, chosen.params)
            if i < len(lengths) - 1 or llm.kind != "block-diffusion":
                assert forced_nfe == chosen.passes, (P, N, budget, chosen.params)


def test_llada21_editing_loses_post_steps_first_then_takes_a_pass_cap(llada2_path):
    llm = kstep.load(llada2_path)
    params = llm.resolve(kstep.GenerationParams(max_tokens=44, min_tokens=44, editing_threshold=0.5))
    assert plan_with(llm, params, 20, 1e9).passes == 12 + 32 + 2 * 16  # two blocks' masks, 16 post steps each
    fewer_post = plan_with(llm, params, 20, 70.5 / MARGIN).params
    assert fewer_post.editing_threshold == 0.5 and fewer_post.max_post_steps == 13 and fewer_post.steps is None
    no_post = plan_with(llm, params, 20, 44.5 / MARGIN).params
    assert no_post.editing_threshold == 0.5 and no_post.max_post_steps == 0
    capped = plan_with(llm, params, 20, 20.5 / MARGIN)
    assert capped.passes <= 20 and capped.params.steps is not None
    with pytest.raises(ValueError, match=r"below the 2.22 s even one pass per block"):
        plan_with(llm, params, 20, 1.9 / MARGIN)  # one pass in each of the two blocks


@pytest.mark.parametrize("fixture", ["sdar_path", "llada2_path"])
def test_a_tight_budget_coarsens_a_block_model_instead_of_refusing(fixture, request):
    """Re-resolving a coarser plan used to fail on the cache "none" the resolver fills in for block
    models that take no cache knob, and the planner took the failure for "nothing fits"."""
    llm = kstep.load(request.getfixturevalue(fixture))
    params = llm.resolve(kstep.GenerationParams(max_tokens=64, min_tokens=64))
    worst = plan_with(llm, params, 20, 1e9).passes
    chosen = plan_with(llm, params, 20, worst / 2 / MARGIN)
    assert worst / 4 < chosen.passes <= worst / 2 and chosen.params.steps < params.block_length


def test_the_table_holds_still_under_noise_and_follows_a_slower_machine():
    costs = PassCosts()
    for tokens in (1, 4, 32, 128):
        costs.observe(tokens, tokens, 0.001 + 0.0001 * tokens)
    before = [costs.predict(t, t) for t in (1, 4, 32, 128)]
    noise = torch.Generator().manual_seed(0)
    for _ in range(10 * WINDOW):  # steps within +-4% of the table (an idle machine's scatter)
        costs.observe(32, 32, before[2] * (1 + 0.08 * (float(torch.rand(1, generator=noise)) - 0.5)))
    assert costs.refits == 0 and [costs.predict(t, t) for t in (1, 4, 32, 128)] == before
    for _ in range(2 * WINDOW):  # the machine got 30% slower: followed within two windows
        costs.observe(32, 32, before[2] * 1.3)
    assert 1 <= costs.refits <= 2 and costs.predict(32, 32) == pytest.approx(1.3 * before[2], rel=0.02)
    assert costs.predict(4, 4) == pytest.approx(before[1], rel=0.02)  # the other widths' measured ratios hold


def test_the_same_request_gets_the_same_plan_and_answer_twice(llada2_path):
    """On an idle model: plans come from a frozen table, and the minimum a refusal names is the one
    that decides (a budget just above it is taken, one just below refused, every time)."""
    llm = kstep.load(llada2_path)
    params = llm.resolve(kstep.GenerationParams(max_tokens=64, min_tokens=64))
    prompt = list(range(10, 30))

    def plan(budget: float):
        return llm.plan_budget(replace(params, time_budget=budget), len(prompt))

    with pytest.raises(ValueError) as refused:
        plan(1e-6)
    minimum = float(re.search(r"below the ([0-9.e-]+) s", str(refused.value)).group(1))
    ample = plan(1e9).predicted_seconds / MARGIN
    for _ in range(2):
        assert plan(minimum * 1.01).passes == 3  # one pass in each of its three blocks (no prefill: P < 32)
        with pytest.raises(ValueError, match=f"below the {minimum:g} s"):
            plan(minimum * 0.99)
    for budget in (minimum * 1.01, (minimum + ample) / 2, ample * 1.01):
        first = plan(budget)
        assert plan(budget) == first
        refits = llm.pass_costs.refits
        llm.generate(prompt, replace(first.params, time_budget=None))  # its steps go to the table
        if llm.pass_costs.refits == refits:  # the machine did not change meanwhile
            assert plan(budget) == first


def test_the_margin_follows_how_far_planned_requests_scatter():
    """95% of planned requests within budget: a plan may predict 1 / the 95th percentile of
    measured/predicted seconds of the requests that ran (nearly) their worst case, recomputed every
    8 requests; until then 90%."""
    costs = PassCosts()
    assert costs.margin() == MARGIN
    for _ in range(7):
        costs.observe_outcome(1.0, 100, 1.25, 100)
    costs.observe_outcome(1.0, 100, 9.0, 50)  # ran half its planned passes: says nothing of the scatter
    assert costs.margin() == MARGIN
    costs.observe_outcome(1.0, 100, 1.25 * 0.95, 95)  # 95 of its 100 passes: counted as if it had run them all
    assert costs.margin() == pytest.approx(0.8)  # every request ran 25% over its prediction
    for _ in range(7):
        costs.observe_outcome(1.0, 100, 0.7, 100)
    assert costs.margin() == pytest.approx(0.8)  # unchanged until 8 more have run
    costs.observe_outcome(1.0, 100, 0.7, 100)
    assert 0.8 <= costs.margin() <= 0.95
    for _ in range(64):
        costs.observe_outcome(1.0, 100, 0.5, 100)
    assert costs.margin() == 0.95  # never plans for the whole budget
