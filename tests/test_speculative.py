"""Speculative decoding: greedy output equals the target's own greedy output (batched, rows of
different lengths accepting different numbers of drafts); the rejection rule samples exactly the
target's distribution (a statistical test on a 4-token vocabulary); the CLI and the server use it."""
import subprocess
import sys

import httpx
import pytest
import torch

import kstep
from kstep.bench.server_process import running_server
from kstep.decoding.speculative import accept_drafts
from kstep.random_checkpoint import write_random_checkpoint

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, item):", "x"]


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    # Same tokenizer as llama_path (both are trained on the same text), smaller and differently seeded.
    return write_random_checkpoint(tmp_path_factory.mktemp("draft"), family="llama", seed=3, d_model=32,
                                   n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64)


@pytest.fixture(scope="module")
def self_draft(llama_path):
    """The target as its own draft: every greedy draft is accepted, which pins the bookkeeping."""
    return kstep.load(llama_path, draft=llama_path)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_equals_target_greedy_batched(llama_path, draft_path, gamma):
    llm = kstep.load(llama_path, draft=draft_path)
    plain = llm.generate(PROMPTS, max_tokens=24)
    spec = llm.generate(PROMPTS, max_tokens=24, num_draft_tokens=gamma)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]
    assert 0 <= spec[0].timings["acceptance_rate"] <= 1


@pytest.mark.parametrize("gamma", [1, 4])
def test_ngram_draft_greedy_equals_target_greedy_batched(llama_path, gamma):
    llm = kstep.load(llama_path, draft="ngram")
    plain = llm.generate(PROMPTS, max_tokens=32, ignore_eos=True)
    spec = llm.generate(PROMPTS, max_tokens=32, ignore_eos=True, num_draft_tokens=gamma)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert spec[0].timings["draft_passes"] == 0  # lookup, no model


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    from kstep.decoding.drafters import NgramDrafter
    params = kstep.GenerationParams(temperature=0.0)
    drafter = NgramDrafter([[1, 2, 3, 4, 9, 2, 3, 5, 6]], vocab_size=10, params=params)
    # tail (…, 2, 3): its latest earlier occurrence is followed by 5, 6, then 2 (after the committed 2, 3)
    drafts, probs = drafter.propose([[7, 2, 3]], 3)
    assert drafts.tolist() == [[5, 6, 7]] and probs is None
    drafter = NgramDrafter([[1, 2]], vocab_size=10, params=kstep.GenerationParams(temperature=1.0))
    drafts, probs = drafter.propose([[8]], 2)  # no match in any row: no drafts, a plain decode step
    assert drafts.shape == (1, 0) and probs.shape == (1, 0, 10)
    drafter = NgramDrafter([[1, 2, 3, 1, 2], [4, 5]], vocab_size=10, params=kstep.GenerationParams(temperature=1.0))
    drafts, probs = drafter.propose([[9], [6]], 4)  # row 0: (1, 2, 9)? no; (2, 9)? no; (9)? no -> no match
    assert drafts.shape == (2, 0)
    # row 0 (1 2 3 1 2 9 1): "1" last occurred at index 3, followed by 2 9 1 (all there is);
    # row 1 (4 5 6 6): "6" at index 2, followed by 6; the batch verifies 3, row 1 padded
    drafts, probs = drafter.propose([[9, 1], [6, 6]], 4)
    assert drafts.tolist() == [[2, 9, 1], [6, 6, 6]]
    assert probs.shape == (2, 3, 10) and probs[0, 0, 2] == 1.0  # a point mass: rejection stays exact


def test_perfect_draft_accepts_everything(self_draft):
    out = self_draft.generate(PROMPTS[:2], max_tokens=24, num_draft_tokens=3, ignore_eos=True)
    assert out[0].timings["acceptance_rate"] == 1.0
    assert out[0].token_ids == self_draft.generate(PROMPTS[0], max_tokens=24, num_draft_tokens=0,
                                                   ignore_eos=True)[0].token_ids
    assert out[0].nfe == 1 + -(-23 // 4)  # prefill, then 4 tokens per target pass


def test_rejection_rule_samples_the_target_distribution():
    torch.manual_seed(0)
    V, gamma, B = 4, 2, 200_000
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]], dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    drafts = torch.stack([torch.multinomial(q[i], B, replacement=True, generator=generator) for i in range(gamma)], 1)
    num_kept, following = accept_drafts(p.expand(B, -1, -1), q.expand(B, -1, -1), drafts, generator)
    first = torch.where(num_kept > 0, drafts[:, 0], following)  # the first emitted token
    empirical = torch.bincount(first, minlength=V).double() / B
    assert (empirical - p[0]).abs().sum() / 2 < 0.01, empirical  # total variation
    kept_first = num_kept > 0
    second = torch.where(num_kept[kept_first] > 1, drafts[kept_first, 1], following[kept_first])
    empirical = torch.bincount(second, minlength=V).double() / len(second)
    assert (empirical - p[1]).abs().sum() / 2 < 0.01, empirical
    assert 0 < (num_kept == 0).double().mean() < 1  # it really rejects sometimes


def test_rejection_rule_with_a_point_mass_draft_samples_the_target_distribution():
    """n-gram drafts are deterministic: q puts all its mass on the proposal."""
    V, B = 4, 200_000
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]], dtype=torch.float64)
    drafts = torch.full((B, 1), 3)
    q = torch.nn.functional.one_hot(drafts, V).double()
    num_kept, following = accept_drafts(p.expand(B, -1, -1), q, drafts, torch.Generator().manual_seed(2))
    first = torch.where(num_kept > 0, drafts[:, 0], following)
    empirical = torch.bincount(first, minlength=V).double() / B
    assert (empirical - p[0]).abs().sum() / 2 < 0.01, empirical
    assert abs((num_kept == 1).double().mean() - 0.4) < 0.01  # kept with probability p(draft)


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_sampling_is_seeded_and_batched(llama_path, draft_path, draft):
    llm = kstep.load(llama_path, draft=draft_path if draft == "model" else "ngram")
    a = llm.generate(PROMPTS, max_tokens=16, temperature=0.9, seed=5, num_draft_tokens=3)
    b = llm.generate(PROMPTS, max_tokens=16, temperature=0.9, seed=5, num_draft_tokens=3)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(len(r.token_ids) > 0 for r in a)


def test_bad_draft_settings(llama_path, llada_path):
    with pytest.raises(ValueError, match="needs a draft"):
        kstep.load(llama_path).generate("x", num_draft_tokens=2)
    with pytest.raises(ValueError, match="autoregressive"):
        kstep.load(llama_path, draft=llada_path)
    with pytest.raises(ValueError, match="autoregressive"):
        kstep.load(llada_path, draft="ngram")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        kstep.GenerationParams(num_draft_tokens=-1)


def test_cli_and_server(llama_path, draft_path):
    proc = subprocess.run([sys.executable, "-m", "kstep", "generate", "def f(x):", "--model", str(llama_path),
                           "--draft", str(draft_path), "--num-draft-tokens", "3", "--max-tokens", "12"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "draft acceptance" in proc.stderr, proc.stderr
    expected = kstep.load(llama_path).generate("def f(x):", max_tokens=12)[0].text
    with running_server(llama_path, "--draft", str(draft_path), "--served-model-name", "tiny") as (url, _):
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 12, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"] == expected
        off = httpx.post(url + "/v1/completions", json={**body, "num_draft_tokens": 0}).json()
        assert off["choices"][0]["text"] == expected and off["usage"]["nfe"] == 12
