"""DiffusionGemma served like any family, on the tiny transformers-written checkpoint: the engine packs
its requests (prefill, commit and denoising passes of different requests, AR requests of another
model) and each gets what it gets alone; `kstep serve` streams committed canvases as text and the
refining canvas with its edits; the CLI, time budgets, `bench compare` and `eval` run on it."""
import json
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest
import torch
from test_engine import run
from test_server import client

import kstep
from kstep.bench.compare import run_compare
from kstep.bench.cost_model import Device
from kstep.bench.uniform_cost import gemma_pass_cost, uniform_diffusion_cost
from kstep.budget.planner import PassCosts
from kstep.engine.engine import Engine
from kstep.engine.request import Request
from kstep.eval.run import run_eval, uniform_settings
from kstep.models.diffusion_gemma_layers import DECODER, ENCODER
from kstep.bench.server_process import running_server
from kstep.params import GenerationParams
from kstep.budget.planner import plan

GEMMA_REQUESTS = [  # (prompts, settings, joins before step)
    (["def add(a, b):"], dict(max_tokens=16, seed=1), 0),
    (["import os\n", "x = ["], dict(max_tokens=16, temperature=1.0, seed=7, max_denoising_steps=6), 2),
    (["class Stack:"], dict(max_tokens=10, seed=3, top_k=4, temperature=0.7), 5),
]
AR_REQUESTS = [(["for i in range(10):"], dict(max_tokens=12), 0), (["print("], dict(max_tokens=6), 3)]


def test_engine_packs_requests_at_different_stages_and_each_gets_its_output_alone(gemma_path, llama_path,
                                                                                   monkeypatch):
    gemma, ar = kstep.load(gemma_path), kstep.load(llama_path)
    own_make_decoder, own_execute = gemma.make_decoder, gemma.runner.execute
    modes: list[list[str]] = []

    def make_either(rows, params, *args, **kwargs):  # each request to its model: only DiffusionGemma's have it
        make = own_make_decoder if params.max_denoising_steps is not None else ar.make_decoder
        return make(rows, params, *args, **kwargs)

    def recording_execute(passes):
        modes.append([p.mode for p in passes])
        return own_execute(passes)

    arrivals, expected = {}, {}
    for llm, specs in ((gemma, GEMMA_REQUESTS), (ar, AR_REQUESTS)):
        for prompts, settings, join in specs:
            params = llm.resolve(replace(GenerationParams(), **settings))
            request = Request([llm.encode_prompt(p) for p in prompts], params)
            arrivals.setdefault(join, []).append(request)
            expected[request.request_id] = [(r.token_ids, r.finish_reason)
                                            for r in llm.generate([llm.encode_prompt(p) for p in prompts], params)]
    monkeypatch.setattr(gemma, "make_decoder", make_either)
    monkeypatch.setattr(gemma.runner, "execute", recording_execute)
    run(Engine(gemma, max_batch_size=8), arrivals)
    for step_requests in arrivals.values():
        for request in step_requests:
            assert [gemma.cut_at_stop(row) for row in request.output_ids] == expected[request.request_id]
    # a prefill or a commit ran in the same packed pass as another request's denoising pass
    assert any(ENCODER in step and DECODER in step for step in modes)
    assert max(len(step) for step in modes) == len(GEMMA_REQUESTS)


@pytest.fixture(scope="module")
def gemma_server(gemma_path, tmp_path_factory):
    with running_server(gemma_path, "--served-model-name", "g",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


def stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_canvas": True}}) as r:
        return [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]


def test_serve_streams_committed_canvases_and_the_refining_canvas(gemma_server, gemma_path):
    body = {"model": "g", "prompt": "def add(a, b):", "max_tokens": 20, "temperature": 0, "seed": 4}
    whole = client(gemma_server).completions.create(**body).choices[0].text
    offline = kstep.load(gemma_path).generate("def add(a, b):", max_tokens=20, temperature=0.0, seed=4)[0]
    assert whole == offline.text
    chunks = stream(gemma_server, body)
    assert "".join(c["text"] for c in chunks) == whole  # committed text, never retracted
    assert len([c for c in chunks if c["text"]]) > 1  # canvas by canvas, not all at the end
    assert [c["tokens"] for c in chunks] == sorted(c["tokens"] for c in chunks)
    canvases = [c for c in chunks if "canvas" in c]
    assert all(len(c["canvas_pieces"]) <= 20 and None not in c["canvas_pieces"] for c in canvases)  # no masks
    assert any(c["canvas_edits"] for c in canvases)  # tokens change in place, not only appear
    assert all(c["tokens"] <= len(c["canvas_pieces"]) for c in canvases)


@pytest.mark.parametrize("extra,param", [({"steps": 4}, "steps"), ({"t_max": 0.2}, "t_max"),
                                         ({"entropy_bound": -1}, "entropy_bound"),
                                         ({"max_denoising_steps": 10**9}, "max_denoising_steps")])
def test_serve_refuses_knobs_it_cannot_run_naming_the_field(gemma_server, extra, param):
    r = httpx.post(gemma_server + "/v1/completions", json={"model": "g", "prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    image = {"model": "g", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    r = httpx.post(gemma_server + "/v1/chat/completions", json=image)
    assert r.status_code == 400 and "only text content parts" in r.json()["error"]["message"]


def test_cli_generate_is_the_api(gemma_path):
    proc = subprocess.run([sys.executable, "-m", "kstep", "generate", "--model", str(gemma_path), "--prompt-ids",
                           "5,6,7,8", "--max-tokens", "8", "--seed", "4", "--entropy-bound", "0.3", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[0])
    want = kstep.load(gemma_path).generate([5, 6, 7, 8], max_tokens=8, seed=4, entropy_bound=0.3)[0]
    assert got["token_ids"] == want.token_ids and got["timings"]["num_canvases"] >= 1


def test_time_budget_caps_the_decoder_passes_per_canvas(gemma_path):
    llm = kstep.load(gemma_path)
    costs = PassCosts()
    for tokens, attended in ((1, 1), (8, 8), (8, 64), (64, 64)):
        costs.observe(tokens, attended, 0.01 + 0.001 * tokens)  # 18 ms a canvas pass
    params = llm.resolve(GenerationParams(max_tokens=16))  # 2 canvases, 48 passes each at most
    ample = plan(costs, llm.family, params, 8, 0, 10.0, llm.resolve, canvas_length=8)
    assert ample.params is params and ample.passes == 1 + 2 * 48 + 1
    tight = plan(costs, llm.family, params, 8, 0, 0.5, llm.resolve, canvas_length=8)
    assert 1 <= tight.params.max_denoising_steps < 48 and tight.predicted_seconds <= 0.45
    with pytest.raises(ValueError, match="even one decoder pass per canvas"):
        plan(costs, llm.family, params, 8, 0, 0.01, llm.resolve, canvas_length=8)
    result = llm.generate("x = [", max_tokens=16, time_budget=60.0)[0]
    assert result.timings["planned_passes"] >= result.nfe


def test_bench_compare_and_eval_run_on_it(gemma_path, llama_path, tmp_path):
    llm = kstep.load(gemma_path)
    # a pass reads the experts its tokens chose: k = 2 of 4 for one token, nearly all 4 for a canvas of 8
    expert_bytes = 3 * 32 * 16 * 4 * 3  # one expert's weights (float32), 3 layers
    one_token, canvas = (gemma_pass_cost(llm.cfg, t, 11, False) for t in (1, 8))
    extra = canvas.bytes - one_token.bytes
    assert extra > (4 * (1 - 0.5 ** 8) - 2) * expert_bytes
    one, two = (uniform_diffusion_cost(llm.cfg, 8, 16, passes) for passes in (10, 20))
    assert two.flops > one.flops and two.bytes > one.bytes
    given = Device("given", 10.0, 0.05, "given")
    result = run_compare(str(gemma_path), str(llama_path), ["def f(x):"], [8], ["uniform K=16", "ar"], 1, 8, "cpu",
                         "float32", tmp_path, given)
    rows = {r["side"]: r for r in result["rows"]}
    assert rows["uniform K=16"]["nfe"] == 17 and rows["ar"]["nfe"] == 8  # a prefill and 16 passes: one canvas
    evaluated = run_eval(str(gemma_path), str(llama_path), str(llama_path), [{"prompt": "def add(a, b):\n"}], 8,
                         uniform_settings(steps=(4,)), 1, tmp_path)
    by_name = {r["setting"]: r for r in evaluated["results"]}
    assert by_name["uniform K=4"]["mean_nfe"] == 5 and by_name["uniform adaptive"]["mean_nfe"] > 1
    assert (tmp_path / "quality_vs_nfe.png").stat().st_size > 0
    torch.testing.assert_close(torch.tensor(result["rows"][0]["floor_seconds"] > 0), torch.tensor(True))
