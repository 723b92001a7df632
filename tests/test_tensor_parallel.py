"""Tensor and expert parallel on the CPU: 2 ranks over gloo (spawned processes, one thread each).
TP=2 gives TP=1's tokens for every family, one pass costs the collectives the scheme says, each rank
holds about half the weights (and /metrics each rank's expert load), a cached prefix's pages are
read on every rank, sizes that do not divide are refused naming the numbers, and a lost rank fails at once
(the server answers 503 for that model and serves its others; it exits once none is left), never
hangs."""
import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client import generate_latest

import kstep
from kstep.bench.server_process import running_server
from kstep.cli import main
from kstep.distributed.runner import GroupLost
from kstep.distributed.sharding import plan_shard
from kstep.engine.engine import Engine
from kstep.engine.request import Request, StepStats
from kstep.random_checkpoint import random_config, write_random_checkpoint
from kstep.runner.top_tokens import NUM_STATS
from kstep.server.metrics import Metrics
from kstep.structured import StructuredSpec
from test_server import client

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
FAMILIES = {  # family: (checkpoint sizes, generation settings that show its decoding)
    "llama": ({"n_kv_heads": 1, "vocab_size": 503}, [{}, {"temperature": 0.8, "seed": 1}]),  # KV heads replicated
    "qwen2": ({}, [{}, {"temperature": 0.7, "top_k": 20, "seed": 2}]),
    "llada": ({}, [{}, {"exact": True}, {"cache": "prefix", "threshold": 0.5}, {"draft": "self"}]),
    "dream": ({}, [{"exact": True}, {}]),
    "fast_dllm_v2": ({}, [{}, {"cache": "dual"}]),
    "sdar": ({}, [{}, {"steps": 2}, {"draft": "self", "num_draft_tokens": 3}]),  # drafts' KV rows copied
    "llada_moe": ({}, [{}, {"exact": True, "cfg_scale": 0.5}]),
    "llada2_moe": ({"n_layers": 3}, [{}, {"editing_threshold": 0.5, "max_post_steps": 4}]),
    "nemotron_labs_diffusion": ({}, [{}, {"mode": "ar"}, {"mode": "linear_spec"}]),  # its three modes
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: write_random_checkpoint(tmp_path_factory.mktemp(f), family=f, seed=7, **sizes)
            for f, (sizes, _) in FAMILIES.items()}


def tensor_parallel(path, **kw) -> kstep.LLM:
    return kstep.load(path, tensor_parallel_size=2, **kw)


@pytest.fixture(scope="module")
def models(checkpoints):
    """family -> (its model on one rank, on two), loaded once for the module's tests: starting ranks
    costs seconds, so two groups start at a time (a rank spends them importing torch), and every
    group closes at once at the end."""
    with ThreadPoolExecutor(2) as pool:
        twos = dict(zip(FAMILIES, pool.map(lambda f: tensor_parallel(checkpoints[f]), FAMILIES)))
    yield lambda family: (kstep.load(checkpoints[family]), twos[family])
    with ThreadPoolExecutor(len(twos)) as pool:
        list(pool.map(lambda two: two.close(), twos.values()))


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_generate_what_one_does(models, family):
    one, two = models(family)
    for settings in FAMILIES[family][1]:
        want = one.generate(PROMPTS, max_tokens=32, **settings)
        got = two.generate(PROMPTS, max_tokens=32, **settings)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], settings
        assert [r.nfe for r in got] == [r.nfe for r in want], settings


@pytest.mark.parametrize("family", ["llama", "llada", "llada_moe", "llada2_moe", "nemotron_labs_diffusion"])
def test_sharded_layers_give_the_unsharded_logits(models, family):
    """Every position's logits of a plain pass, gathered from the ranks: the sharded attention (key/value
    heads split or replicated), MLP, experts, embedding and padded head against their one-rank twins."""
    one, two = models(family)
    ids = torch.tensor([PROMPTS[1] * 3])  # (1, 21)
    positions = torch.arange(ids.shape[1])[None]
    torch.testing.assert_close(two.runner.whole_pass(ids, positions), one.runner.whole_pass(ids, positions),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "llada", "sdar", "llada2_moe"])
def test_a_structured_output_on_two_ranks_is_one_ranks(models, family):
    """A constrained pass asks for logits: under -tp 2 the grammar masks the gathered ones, and the
    tokens equal one rank's (greedy and sampled)."""
    one, two = models(family)
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    for settings in ({}, {"temperature": 0.8, "seed": 2}):
        want = one.generate(PROMPTS, max_tokens=48, structured=spec, **settings)
        got = two.generate(PROMPTS, max_tokens=48, structured=spec, **settings)
        assert [r.token_ids for r in got] == [r.token_ids for r in want] and {r.finish_reason for r in got} == {"stop"}


def test_speculative_decoding_and_one_pass_collectives(checkpoints):
    path = checkpoints["qwen2"]
    one, two = kstep.load(path, draft="ngram"), tensor_parallel(path, draft="ngram")
    try:
        assert two.generate(PROMPTS, max_tokens=32)[0].token_ids == one.generate(PROMPTS, max_tokens=32)[0].token_ids
        group = two.runner.group
        for settings, gathered in (({}, NUM_STATS), ({"temperature": 0.5}, two.model.embed.weight.shape[0])):
            group.counts.clear()
            group.elements.clear()
            two.generate(PROMPTS[0], max_tokens=1, num_draft_tokens=0, **settings)  # one pass: the prefill
            layers = two.cfg.n_layers
            # two all-reduces per layer (attention, MLP) and the embedding's; the head's one gather; one message
            assert dict(group.counts) == {"message": 1, "all_reduce": 2 * layers + 1, "gather": 1}
            # greedy: the last position's vocabulary statistics; sampling: its logits over this rank's vocabulary
            assert group.elements["gather"] == gathered, settings
    finally:
        two.close()


@pytest.mark.parametrize("family", ["llama", "sdar"])
def test_a_cached_prefix_is_read_on_every_rank(models, family):
    """A request that maps a cached prefix's pages on rank 0 reads the same pages of every rank's
    storage (its tables go with its passes): TP=2 serves the requests of TP=1 token for token,
    hitting the cache."""
    shared = list(range(20, 60))  # 40 tokens: whole cache blocks (16; SDAR: of its blocks of 4)

    def serve(llm) -> tuple[list, int]:
        engine = Engine(llm, prefix_cache_bytes=1 << 24)
        requests = [Request([shared + tail], llm.resolve(kstep.GenerationParams(max_tokens=12)))
                    for tail in ([5, 6], [7, 8, 9], [5, 6])]
        for request in requests:  # one after another: each later one finds the blocks the first stored
            engine.add_request(request)
            while engine.has_work():
                engine.step()
        return [r.output_ids for r in requests], engine.prefix_cache.hit_tokens
    one, two = models(family)
    (want, _), (got, hits) = serve(one), serve(two)
    assert got == want and hits >= 64


def test_each_rank_holds_about_half_the_weights(models):
    one, two = models("llada2_moe")
    size = lambda llm: sum(p.numel() for p in llm.model.parameters())  # noqa: E731
    assert 0.45 < size(two) / size(one) < 0.6  # the norms and routers are replicated
    experts = two.model.layers[1].mlp.experts
    assert (experts.num_experts, experts.first) == (one.cfg.moe.num_experts // 2, 0)  # whole experts
    two.generate(PROMPTS[0], max_tokens=32)
    load, moe = two.runner.expert_load(), two.cfg.moe
    sparse = sum(moe.is_sparse(i) for i in range(two.cfg.n_layers))
    assert len(load) == 2 and min(load) > 0 and sum(load) % (moe.top_k * sparse) == 0  # every token's k, per layer
    metrics = Metrics()
    metrics.for_model("m").observe_step(StepStats(1, 1, 1, 0.1, 1), Engine(two))
    exported = generate_latest(metrics.registry).decode()
    assert f'kstep_expert_pairs{{model="m",rank="1"}} {float(load[1])}' in exported


def test_sizes_that_do_not_divide_are_refused_naming_the_numbers(checkpoints, capsys):
    cfg = random_config("llada2_moe", 500, n_heads=4, n_kv_heads=2, num_experts=8)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the 4 attention heads"):
        plan_shard(cfg, 0, 3)
    with pytest.raises(ValueError, match="does not divide the 6 experts"):
        plan_shard(random_config("llada_moe", 500, num_experts=6), 0, 4)
    replicated = plan_shard(cfg, 3, 4)  # 2 key/value heads on 4 ranks: rank 3 keeps head 1
    assert replicated.kv_heads == (1, 2) and replicated.heads == (3, 4)
    assert plan_shard(random_config("llama", 503), 1, 2).vocab == (252, 504)  # padded to a multiple of 2
    assert main(["generate", "x", "--model", str(checkpoints["llama"]), "-tp", "3"]) == 2
    assert "tensor_parallel_size 3" in capsys.readouterr().err


def test_an_idle_group_lives_and_the_other_ranks_free_what_rank_0_frees(checkpoints, monkeypatch):
    """Between passes the ranks wait on a pipe, not a collective: an idle spell longer than the
    collectives' timeout (3 s here) does no harm; and every KV cache rank 0 drops is dropped on the
    other ranks with the next message."""
    monkeypatch.setenv("KSTEP_TP_TIMEOUT_SECONDS", "3")  # the spawned ranks read it
    path = checkpoints["llama"]
    two = tensor_parallel(path)
    try:
        first = two.generate(PROMPTS, max_tokens=8)
        time.sleep(5)
        assert [r.token_ids for r in two.generate(PROMPTS, max_tokens=8)] == [r.token_ids for r in first]
        nothing = {"kv_caches": [], "soft_embeds": []}
        assert two.runner.report() == [nothing]  # both requests' caches gone
        kept = two.runner.allocate_kv(1, 16)
        two.runner.logits(two.runner.causal_pass(torch.tensor([[5, 6]]), torch.arange(2)[None], None, 0, kept))
        assert two.runner.report() == [{**nothing, "kv_caches": [kept.kv_id]}]  # alive: kept there too
        del kept
        assert two.runner.report() == [nothing]
    finally:
        two.close()


def test_a_lost_rank_fails_at_once(checkpoints):
    two = tensor_parallel(checkpoints["llama"])
    two.generate(PROMPTS[0], max_tokens=2)
    two.runner.channels[0].kill()
    start = time.monotonic()
    with pytest.raises(GroupLost, match="kstep-rank-1 stopped"):
        two.generate(PROMPTS[0], max_tokens=2)
    assert time.monotonic() - start < 10
    with pytest.raises(GroupLost):  # and stays failed
        two.generate(PROMPTS[0], max_tokens=2)


def test_served_on_two_ranks_batched_equals_alone_and_a_lost_rank_fails_its_model_only(checkpoints, tmp_path):
    log = tmp_path / "serve.log"
    with running_server(f"ar={checkpoints['qwen2']}", "--model", f"ld={checkpoints['llada']}", "-tp", "2",
                        log=log) as (url, proc):
        # greedy passes get top tokens, sampled ones logits: a step packs both kinds
        requests = [(m, p, t) for m in ("ar", "ld") for p, t in (("def f(x):", 0), ("x = [", 0), ("class A:", 0.8),
                                                                  ("import os", 0))]
        alone = [client(url).completions.create(model=m, prompt=p, max_tokens=24, temperature=t, seed=3
                                                ).choices[0].text for m, p, t in requests]

        async def together():
            async with httpx.AsyncClient(timeout=60) as h:
                return await asyncio.gather(*(h.post(url + "/v1/completions", json={
                    "model": m, "prompt": p, "max_tokens": 24, "temperature": t, "seed": 3}) for m, p, t in requests))
        assert [r.json()["choices"][0]["text"] for r in asyncio.run(together())] == alone

        # ar's rank killed while idle: /health shows ar down at once, ar's requests get 503s naming the
        # rank, ld keeps serving, the server keeps running
        ranks = {name: m["ranks"] for name, m in httpx.get(url + "/health").json()["models"].items()}
        assert len(ranks["ar"]) == len(ranks["ld"]) == 1 and ranks["ar"][0]["pid"] != ranks["ld"][0]["pid"]
        os.kill(ranks["ar"][0]["pid"], signal.SIGKILL)
        start = time.monotonic()
        while (health := httpx.get(url + "/health")).json()["models"]["ar"]["status"] == "ok":
            assert time.monotonic() - start < 2, "the lost rank was not seen within 2 s"
            time.sleep(0.02)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert ranks["ar"][0]["name"] in health.json()["models"]["ar"]["error"]
        assert httpx.get(url + "/health", params={"model": "ar"}).status_code == 503
        assert httpx.get(url + "/health", params={"model": "ld"}).status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "ar", "prompt": "x", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and ranks["ar"][0]["name"] in r.json()["error"]["message"], r.text
        assert client(url).completions.create(model="ld", prompt="def f(x):", max_tokens=24, temperature=0
                                              ).choices[0].text == alone[4]
        assert proc.poll() is None

        # ld's rank killed mid-request: its request ends with a 503, and with no model left the server exits 1
        answer = {}

        def long_request():
            answer["r"] = httpx.post(url + "/v1/completions", json={
                "model": "ld", "prompt": "x", "max_tokens": 512, "exact": True, "temperature": 0}, timeout=60)
        worker = threading.Thread(target=long_request)
        worker.start()
        while not httpx.get(url + "/health").json()["running"]:
            time.sleep(0.02)
        os.kill(ranks["ld"][0]["pid"], signal.SIGKILL)
        worker.join(30)
        assert answer["r"].status_code == 503 and "tensor-parallel group" in answer["r"].json()["error"]["message"]
        assert proc.wait(timeout=30) != 0


def test_a_pass_description_carries_every_field_of_a_forward_pass():
    """What rank 0 sends the others (distributed/messages.py) is the whole ForwardPass but its runner:
    a field added to one and not the other would silently not reach the other ranks."""
    from dataclasses import fields

    from kstep.distributed.messages import PassDescription
    from kstep.runner.model_runner import ForwardPass
    assert {f.name for f in fields(PassDescription)} == {f.name for f in fields(ForwardPass)} - {"runner"}
