"""Time budgets: the planner picks the most passes that fit (monotone in the budget), refuses a
budget below one pass per block with the minimum in the message, changes nothing when the budget
is ample, and caps an AR model's max_tokens (it cannot coarsen, only stop early)."""
import subprocess
import sys

import pytest

import kstep
from kstep.budget.planner import PassCosts, plan


def toy_costs(fixed=1.0, per_token=0.01) -> PassCosts:
    """A known table: seconds = fixed + per_token * tokens (attention free)."""
    costs = PassCosts()
    for tokens, attended in ((1, 1), (8, 8), (64, 64), (256, 256), (8, 256)):
        costs.observe(tokens, attended, fixed + per_token * tokens)
    return costs


def test_planned_passes_grow_with_the_budget(llada_path):
    llm = kstep.load(llada_path)
    params = llm.resolve(kstep.GenerationParams(max_tokens=64, block_length=16))
    costs = toy_costs()
    passes = []
    for budget in (8, 10, 20, 40, 80, 200):
        chosen = plan(costs, llm.family, params, 8, 0, budget, llm.resolve)
        assert chosen.predicted_seconds <= 0.9 * budget
        assert chosen.params.steps is None or chosen.params.steps % 4 == 0  # whole passes in every block
        passes.append(chosen.passes)
    assert passes == sorted(passes) and passes[0] < passes[-1] == 64  # ample: the default, one token per pass worst


def test_an_impossible_budget_names_the_minimum(llada_path):
    with pytest.raises(ValueError, match=r"time_budget 1e-06 s is below the [0-9.e-]+ s even one pass per block"):
        kstep.load(llada_path).generate("def f(x):", max_tokens=16, time_budget=1e-6)
    out = subprocess.run([sys.executable, "-m", "kstep", "generate", "def f(x):", "--model", str(llada_path),
                          "--max-tokens", "16", "--time-budget", "0.000001"], capture_output=True, text=True)
    assert out.returncode == 2 and "time_budget" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("path", ["llada_path", "llama_path", "v2_path"])
def test_an_ample_budget_changes_nothing(path, request):
    llm = kstep.load(request.getfixturevalue(path))
    plain = llm.generate([5, 6, 7], max_tokens=16)[0]
    budgeted = llm.generate([5, 6, 7], max_tokens=16, time_budget=600.0)[0]
    assert budgeted.token_ids == plain.token_ids
    assert budgeted.timings["predicted_seconds"] > 0 and budgeted.timings["planned_passes"] >= plain.nfe - 1


def test_a_tight_budget_coarsens_diffusion_and_truncates_ar(llada_path, llama_path):
    costs = toy_costs(fixed=1.0, per_token=0.0)  # one second per pass, whatever its shape
    ar = kstep.load(llama_path)
    capped = plan(costs, ar.family, ar.resolve(kstep.GenerationParams(max_tokens=32)), 4, 0, 10.0, ar.resolve)
    assert capped.params.max_tokens == 9 and capped.passes == 9  # 9 passes <= 0.9 x 10 s
    llada = kstep.load(llada_path)
    coarse = plan(costs, llada.family, llada.resolve(kstep.GenerationParams(max_tokens=32, block_length=8)), 4, 0, 10.0,
                  llada.resolve)
    assert coarse.params.steps == 8 and coarse.params.max_tokens == 32  # 2 per block: all 32 tokens in 8 passes


def test_http_time_budgets(llada_server, llama_server):
    import openai
    from test_server import client
    api = client(llada_server)
    plain = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=16, temperature=0)
    ample = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=16, temperature=0,
                                   extra_body={"time_budget": 600.0})
    assert ample.choices[0].text == plain.choices[0].text
    usage = ample.usage.model_extra
    assert usage["time_budget"] == 600.0 and usage["predicted_seconds"] > 0 and usage["planned_passes"] >= 16
    with pytest.raises(openai.BadRequestError) as err:  # below what even an idle engine can do
        api.completions.create(model="tiny", prompt="def f(x):", max_tokens=16, extra_body={"time_budget": 1e-6})
    assert err.value.body["param"] == "time_budget" and "is below the" in err.value.body["message"]
    # an AR model can only stop early: what fit, finish_reason "length"
    short = client(llama_server).completions.create(model="tiny-ar", prompt="def f(x):", max_tokens=900,
                                                    extra_body={"time_budget": 0.02, "min_tokens": 900})
    assert short.choices[0].finish_reason == "length" and 0 < short.usage.completion_tokens < 900


def test_load_makes_plans_coarser_then_infeasible(llada_path):
    """Under load each pass takes the running batch's step time on top of its own."""
    llada = kstep.load(llada_path)
    params = llada.resolve(kstep.GenerationParams(max_tokens=32, block_length=8))
    costs = toy_costs(fixed=1.0, per_token=0.0)
    idle = plan(costs, llada.family, params, 4, 0, 30.0, llada.resolve)
    loaded = plan(costs, llada.family, params, 4, 0, 30.0, llada.resolve, load=1.0)
    assert loaded.passes < idle.passes and loaded.predicted_seconds <= 27.0
    with pytest.raises(ValueError, match="below the"):
        plan(costs, llada.family, params, 4, 0, 30.0, llada.resolve, load=10.0)  # 4 passes x 11 s > 27 s


def test_the_fit_follows_a_kink_in_pass_cost_between_the_widths_it_timed():
    """On a CPU a pass of 4 tokens costs about twice one of 1 and about what one of 16 does
    (docs/benchmarks.md, bench passes): no line through 1..512 tokens gets both ends right, the
    per-width correction does, and it interpolates between the widths timed."""
    costs = PassCosts()
    for tokens, seconds in ((1, 1.0), (4, 2.0), (16, 2.2), (128, 4.0), (512, 12.0)):
        costs.observe(tokens, tokens, seconds)
    for tokens, seconds in ((1, 1.0), (4, 2.0), (16, 2.2), (512, 12.0)):
        assert costs.predict(tokens, tokens) == pytest.approx(seconds, rel=0.05)
    assert 2.0 < costs.predict(8, 8) < 2.2  # between its neighbours
    assert costs.predict(64, 64) > costs.predict(16, 16)
