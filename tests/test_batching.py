"""A batch of prompts of different lengths gives each prompt the result it gets alone."""
import pytest

import kstep

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, item):", "x"]


@pytest.mark.parametrize("settings", [
    dict(max_tokens=32, block_length=8, steps=16),
    dict(max_tokens=16, block_length=16, steps=8, cfg_scale=1.0),
    dict(max_tokens=16, block_length=8, steps=16, remasking="margin"),
    dict(max_tokens=32, block_length=8, steps=16, cache="prefix"),
    dict(max_tokens=32, block_length=8, steps=32, cache="dual", threshold=0.1),
    dict(max_tokens=32, block_length=8, steps=32, cache="dual", factor=1.0),
    dict(max_tokens=16, block_length=8, steps=16, cache="dual", cfg_scale=0.5),
    dict(max_tokens=32, block_length=8, steps=32, cache="none", threshold=0.1, early_stop=True),
])
def test_diffusion_batch_equals_single(llada_path, settings):
    llm = kstep.load(llada_path)
    batched = llm.generate(PROMPTS, **settings)
    alone = [llm.generate(p, **settings)[0] for p in PROMPTS]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.finish_reason for r in batched] == [r.finish_reason for r in alone]
    assert [r.nfe for r in batched] == [r.nfe for r in alone]  # each row reports what it needed alone


def test_autoregressive_batch_equals_single(llama_path):
    llm = kstep.load(llama_path)
    batched = llm.generate(PROMPTS, max_tokens=24)
    alone = [llm.generate(p, max_tokens=24)[0] for p in PROMPTS]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.nfe for r in batched] == [r.nfe for r in alone]
    assert all(len(r.token_ids) > 0 for r in alone)


def test_token_id_prompts_batch(llama_path):
    llm = kstep.load(llama_path)
    out = llm.generate([[10, 11, 12], [13, 14]], max_tokens=5)
    assert len(out) == 2 and all(r.prompt_tokens in (2, 3) for r in out)
