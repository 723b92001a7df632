"""Lossless self-speculation (`draft="self"`, kstep/decoding/self_speculation.py and
block_self_speculation.py): token for token what `exact` gives, for every masked- and
block-diffusion family, in batches whose rows accept different lengths, over several blocks, with
several tokens per step, every deterministic remasking rule, end tokens inside drafts, min_tokens
and infilling; fewer sequential passes on the trained llada-coder and block coder; bad values
refused naming the field (CLI exit 2, HTTP 400); served mixed with ordinary requests as each alone."""
import asyncio
import json
import subprocess
import sys

import httpx
import pytest

import kstep
from kstep.random_checkpoint import write_random_checkpoint
from conftest import copy_checkpoint
from test_server import metric

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [21, 22]]
SETTINGS = [  # every one runs as `exact` and as draft self with K = 2 and 5
    {"max_tokens": 32},
    {"max_tokens": 48, "block_length": 16},              # three blocks
    {"max_tokens": 32, "steps": 16},                     # two tokens per step
    {"max_tokens": 32, "remasking": "margin"},
    {"max_tokens": 16, "min_tokens": 12},
]
EXTRA = {"llada": [{"max_tokens": 32, "steps": 32, "remasking": "entropy"}]}
BLOCK_SETTINGS = [{"max_tokens": 32}, {"max_tokens": 20, "remasking": "margin"}, {"max_tokens": 16, "min_tokens": 12}]


def same_as_exact(llm, prompts, settings, drafts=(2, 5), **kw) -> list[int]:
    """Asserts draft self == exact for each K; returns the exact nfe and each K's."""
    want = llm.generate(prompts, exact=True, **settings, **kw)
    passes = [want[0].nfe]
    for k in drafts:
        got = llm.generate(prompts, draft="self", num_draft_tokens=k, **settings, **kw)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], (settings, k)
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want], (settings, k)
        passes.append(got[0].timings["batch_passes"])
    return passes


@pytest.mark.parametrize("family", ["llada", "llada_moe", "dream", "sdar", "fast_dllm_v2", "llada2_moe"])
def test_self_speculation_gives_the_exact_tokens(tmp_path, family):
    path = write_random_checkpoint(tmp_path / "ckpt", family=family, seed=3)
    llm = kstep.load(path)
    # two draft counts on LLaDA; one elsewhere (the random block models' blocks are of 4)
    drafts = (2, 5) if family == "llada" else (3,)
    for settings in (SETTINGS + EXTRA.get(family, []) if llm.kind == "diffusion" else BLOCK_SETTINGS):
        same_as_exact(llm, PROMPTS, settings, drafts)
    # an end token the model writes often: rows stop inside drafts, early stop fills the rest
    ids = llm.generate(PROMPTS[:1], exact=True, max_tokens=32)[0].token_ids
    stop = max(set(ids[4:]), key=ids[4:].count)
    ended = kstep.load(copy_checkpoint(path, tmp_path / "eos", eos_token_id=stop))
    assert any(r.finish_reason == "stop" for r in ended.generate(PROMPTS, exact=True, max_tokens=32))
    same_as_exact(ended, PROMPTS, {"max_tokens": 32}, drafts)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_with_a_cache_it_gives_the_cached_samplers_tokens(tmp_path, family):
    """With a prefix or dual cache, the fixed schedule run with that cache (drafts as window passes on
    copies of the block start's cache; Dream's block sampler commits a block's first token first)."""
    llm = kstep.load(write_random_checkpoint(tmp_path / "ckpt", family=family, seed=3))
    for cache, settings in (("dual", {"max_tokens": 48, "block_length": 16}),
                            ("prefix", {"max_tokens": 32, "block_length": 16, "remasking": "margin"}),
                            ("dual", {"max_tokens": 32, "block_length": 16, "steps": 16, "min_tokens": 20})):
        steps = settings.get("steps", settings["max_tokens"])
        kw = {**settings, "steps": steps, "cache": cache}
        want = llm.generate(PROMPTS, **kw)
        for k in (2, 5):
            got = llm.generate(PROMPTS, draft="self", num_draft_tokens=k, **kw)
            assert [r.token_ids for r in got] == [r.token_ids for r in want], (cache, settings, k)
        assert got[0].timings["batch_passes"] <= want[0].nfe


def test_with_a_cache_it_equals_exact_with_that_cache_which_runs_alone(llada_path):
    """The sampler a self-speculative run equals is one a user can run: `exact` with the same cache,
    and each result says which it is."""
    llm = kstep.load(llada_path)
    for cache in ("none", "dual", "prefix"):
        want = llm.generate(PROMPTS, max_tokens=32, block_length=16, exact=True, cache=cache)
        got = llm.generate(PROMPTS, max_tokens=32, block_length=16, draft="self", cache=cache)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], cache
        assert {r.timings["equals"] for r in got} == {"exact" if cache == "none" else f"exact, cache {cache}"}
    with pytest.raises(ValueError, match="threshold"):
        llm.generate(PROMPTS, max_tokens=32, exact=True, cache="dual", threshold=0.5)


def test_each_row_reports_its_own_drafts(llada_path, tmp_path):
    """A batch's rows draft apart: each result's drafts are its row's, as it would have them alone,
    its positions those its passes computed (alone, unpadded, no more), and the CLI's JSON lines say so too."""
    llm = kstep.load(llada_path)
    keys = ("acceptance_rate", "drafted_tokens", "accepted_tokens")
    batch = llm.generate(PROMPTS, max_tokens=32, draft="self", num_draft_tokens=3)
    alone = [llm.generate([p], max_tokens=32, draft="self", num_draft_tokens=3)[0] for p in PROMPTS]
    assert [[r.timings[k] for k in keys] for r in batch] == [[r.timings[k] for k in keys] for r in alone]
    assert len({r.timings["drafted_tokens"] for r in batch}) > 1  # the rows differ: not the batch's figure
    for b, a in zip(batch, alone):
        assert a.timings["positions_computed"] <= b.timings["positions_computed"]  # (left padding in the batch)
    done = subprocess.run([sys.executable, "-m", "kstep", "generate", "--prompt-ids", "5,6,7,8", "--prompt-ids",
                           "21,22", "--model", str(llada_path), "--draft", "self", "--num-draft-tokens", "3", "--max-tokens", "32",
                           "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line)["timings"] for line in done.stdout.splitlines()]
    assert [row["drafted_tokens"] for row in rows] == [batch[0].timings["drafted_tokens"],
                                                       batch[2].timings["drafted_tokens"]]


def test_infilling_with_self_speculation(llada_path):
    llm = kstep.load(llada_path)
    same_as_exact(llm, [[5, 6, 7]], {"max_tokens": 16}, suffix=[30, 31, 32])


@pytest.mark.parametrize("model", ["llada-coder", "default"])
def test_fewer_passes_on_the_trained_coders(model):
    llm = kstep.load(model)
    prompts = ["def is_palindrome(s):\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
               "class Stack:\n    def push(self, x):\n"]
    exact, *speculative = same_as_exact(llm, prompts[:1], {"max_tokens": 64}, drafts=(4,))
    assert speculative[0] < exact  # one token per pass (and a commit pass a block), fewer with drafts
    same_as_exact(llm, prompts, {"max_tokens": 64}, drafts=(4,))  # rows that accept different lengths


@pytest.mark.parametrize("settings, needle", [
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"num_draft_tokens": 40}, "num_draft_tokens"),
    ({"temperature": 0.5}, "temperature"),
    ({"remasking": "random"}, "remasking"),
    ({"threshold": 0.9}, "threshold"),
    ({"cfg_scale": 0.5}, "cfg_scale"),
])
def test_bad_values_are_refused_naming_the_field(llada_path, settings, needle):
    with pytest.raises(ValueError, match=f"^{needle}"):  # the conflicting field first, not draft
        kstep.load(llada_path).generate([[5, 6]], max_tokens=32, draft="self", **settings)


def test_over_http_the_refusal_names_the_field_that_conflicts(llada_server):
    """A server's temperature defaults to OpenAI's 1.0: a threshold the request sent is what it hears
    about first; with no other conflict, the temperature, and how to send it."""
    with httpx.Client(timeout=60) as h:
        for body, first in (({"threshold": 0.9}, "threshold 0.9"), ({}, "temperature 1.0")):
            bad = h.post(llada_server + "/v1/completions", json={"model": "tiny", "prompt": "x", "draft": "self",
                                                                 **body})
            message = bad.json()["error"]["message"]
            assert bad.status_code == 400 and message.startswith(first), message
        assert "send temperature 0" in message


def test_a_block_models_self_speculation_takes_no_cache(v2_path):
    with pytest.raises(ValueError, match="cache 'dual': draft 'self' on a block model"):
        kstep.load(v2_path).generate([[5, 6]], max_tokens=8, draft="self", cache="dual")


def test_draft_self_needs_a_diffusion_model(llama_path, gemma_path, llada_path):
    for path, kind in ((llama_path, "autoregressive"), (gemma_path, "uniform-diffusion")):
        with pytest.raises(ValueError, match=f"draft does not apply to a .* model \\({kind}\\)"):
            kstep.load(path).generate([[5, 6]], max_tokens=8, draft="self")
    with pytest.raises(ValueError, match="give draft 'self'"):
        kstep.load(llada_path).generate([[5, 6]], max_tokens=32, num_draft_tokens=3)
    done = subprocess.run([sys.executable, "-m", "kstep", "generate", "--prompt-ids", "5,6", "--model",
                           str(llama_path), "--draft", "self"], capture_output=True, text=True)
    assert done.returncode == 2 and "draft does not apply" in done.stderr, done.stderr


def test_served_mixed_with_ordinary_requests_as_alone(llada_server):
    requests = [{"prompt": "def f(x):", "draft": "self", "num_draft_tokens": 3, "max_tokens": 32},
                {"prompt": "x = [", "exact": True, "max_tokens": 32},
                {"prompt": "class A:", "max_tokens": 32},
                {"prompt": "import os", "draft": "self", "max_tokens": 32}]
    body = {"model": "tiny", "temperature": 0}

    def post(h, r):
        return h.post(llada_server + "/v1/completions", json={**body, **r})
    with httpx.Client(timeout=60) as h:
        answers = [post(h, r).json() for r in requests]
        alone = [a["choices"][0]["text"] for a in answers]
        usage = answers[0]["usage"]  # what the drafts saved and cost
        assert usage["positions_computed"] > 0 and 0 <= usage["accepted_draft_tokens"] <= usage["draft_tokens"]
        assert "draft_tokens" not in answers[1]["usage"]
        exact = post(h, {**requests[0], "draft": None, "num_draft_tokens": None, "exact": True}).json()
        assert exact["choices"][0]["text"] == alone[0]
        bad = post(h, {**requests[0], "num_draft_tokens": 0})
        assert bad.status_code == 400 and "num_draft_tokens" in bad.json()["error"]["message"]

    async def together():
        async with httpx.AsyncClient(timeout=60) as h:
            return await asyncio.gather(*(post(h, r) for r in requests))
    assert [r.json()["choices"][0]["text"] for r in asyncio.run(together())] == alone
    assert metric(llada_server, "kstep_draft_tokens_total", 'outcome="drafted"') >= 2 * usage["draft_tokens"]


def test_bench_self_spec_reports_identity_passes_and_cost(llada_path, tmp_path):
    from kstep.cli import main
    assert main(["bench", "self-spec", "--model", str(llada_path), "--lengths", "16", "--drafts", "3",
                 "--num-prompts", "2", "--out", str(tmp_path)]) == 0
    [row] = json.loads((tmp_path / "bench_self_spec.json").read_text())["rows"]
    assert row["identical"] == row["prompts"] == 2 and row["exact_passes"] == 16
    assert row["passes"] <= 16 and row["pass_ratio"] >= 1 and row["positions_vs_exact"] >= 1
    # against the cached fixed schedule with --cache dual
    assert main(["bench", "self-spec", "--model", str(llada_path), "--lengths", "16", "--drafts", "3",
                 "--num-prompts", "2", "--cache", "dual", "--out", str(tmp_path)]) == 0
    [row] = json.loads((tmp_path / "bench_self_spec.json").read_text())["rows"]
    assert row["cache"] == "dual" and row["identical"] == row["prompts"] == 2 and row["passes"] <= 16
