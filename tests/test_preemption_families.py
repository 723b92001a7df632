"""Preemption's recomputation on every family and setting (issue 45), through the Engine: a request
preempted mid-decode (its KV pages dropped, back to the queue's head) resumes by recomputing: an
AR decoder keeps its state and rebuilds its cache from the prompt and its tokens as a prefill; any
other decoder starts again from its prompt with its own seed, what it had committed checked on the
way. Each ends with exactly the tokens it gets when never preempted, none committed twice. (AR, speculative, block-diffusion and
causal-context caches grow, so those requests are preempted by the pool itself, tests/test_preemption.py;
the recomputation is the same for every family, and is forced here, also where a family's caches never
grow.)"""
import pytest

import kstep
from kstep.engine.engine import Engine
from kstep.engine.request import Request
from kstep.structured.spec import StructuredSpec

JSON = StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
CASES = [("qwen2", {"temperature": 0.8, "seed": 3}), ("qwen2", {"structured": JSON}),
         ("llada", {"cache": "dual", "threshold": 0.5}), ("llada", {"temperature": 0.7, "seed": 5}),
         ("llada", {"draft": "self", "cache": "prefix"}), ("dream", {}), ("sdar", {}), ("fast_dllm_v2", {}),
         ("llada2_moe", {"editing_threshold": 0.5}), ("nemotron_labs_diffusion", {}),
         ("nemotron_labs_diffusion", {"mode": "linear_spec"}), ("diffusion_gemma", {"temperature": 1.0, "seed": 2}), ("diffusion_gemma", {}),
         ("llada", {"structured": JSON})]


def _requests(llm, settings: dict) -> list[Request]:
    """Two requests, the second preempted; one where the family's sampled output depends on its
    neighbours in a pass (DiffusionGemma at temperature 1: rounding of a packed pass, known)."""
    params = llm.resolve(kstep.GenerationParams(max_tokens=24, **settings))
    alone = llm.cfg.family == "diffusion_gemma" and params.temperature > 0
    return [Request([[5 + i, 9, 13 + i, 7]], params) for i in range(1 if alone else 2)]


def _run(engine: Engine, requests: list[Request], preempt_at: int | None = None) -> None:
    """Step until done, preempting the last request at step `preempt_at` (its tokens so far: kept)."""
    for request in requests:
        engine.add_request(request)
    step = 0
    while engine.has_work():
        if step == preempt_at:
            had = [list(row) for row in requests[-1].output_ids]
            engine._preempt(requests[-1])
        engine.step()
        if step == preempt_at:  # (it may join again at once, the pool being large): nothing taken back
            assert all(row[:len(old)] == old for row, old in zip(requests[-1].output_ids, had))
        step += 1


@pytest.mark.parametrize("family,settings", CASES, ids=[f"{f}-{'-'.join(map(str, s.values())) or 'default'}"
                                                        for f, s in CASES])
def test_a_preempted_request_recomputes_to_its_own_output(random_models, family, settings):
    llm = random_models(family)
    plain = _requests(llm, settings)
    _run(Engine(llm), plain)
    for preempt_at in (1, 4):
        preempted = _requests(llm, settings)
        _run(Engine(llm), preempted, preempt_at)
        assert [r.output_ids for r in preempted] == [r.output_ids for r in plain], preempt_at
        assert preempted[-1].preemptions == 1 and preempted[-1].error is None
        assert preempted[-1].stats.get("preemptions") == 1
