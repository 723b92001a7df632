"""Infilling (`suffix`): for a full-attention diffusion model the canvas is prompt + N masks + suffix;
every pass attends to the suffix, none changes it, and the completion is what goes in the gap.
Causal and block-causal models cannot see text after the gap: a clear error, never a silent
prefix-only completion."""
import pytest
import torch

import kstep
from kstep.decoding.base import DecodeBatch
from kstep.runner.model_runner import execute_passes

PROMPT, SUFFIX = "def add(a, b):", "\n    return total\n\nprint(add(1, 2))\n"


@pytest.mark.parametrize("knobs", [{"exact": True}, {"cache": "dual", "threshold": 0.5}, {"cache": "prefix"}])
def test_the_suffix_changes_the_gap_and_stays_as_it_is(llada_path, knobs):
    llm = kstep.load(llada_path)
    plain = llm.generate(PROMPT, max_tokens=16, **knobs)[0]
    infilled = llm.generate(PROMPT, max_tokens=16, suffix=SUFFIX, **knobs)[0]
    assert infilled.token_ids != plain.token_ids  # the random model's gap depends on what follows it
    params = llm.resolve(kstep.GenerationParams(max_tokens=16, **knobs))
    suffix_ids = llm.encode_suffix(SUFFIX)
    decoder = llm.make_decoder([llm.encode_prompt(PROMPT)], params, suffixes=[suffix_ids])
    with torch.inference_mode():
        while passes := decoder.next_passes():
            decoder.update(execute_passes(passes))
            assert decoder.canvas[0, -len(suffix_ids):].tolist() == suffix_ids  # never modified
    assert decoder.completions[0].tolist()[:len(infilled.token_ids)] == infilled.token_ids


def test_a_batch_with_different_suffixes_equals_single_runs(llada_path):
    llm = kstep.load(llada_path)
    prompts, suffixes = [PROMPT, "class Stack:\n    def push(self, x):"], [SUFFIX, "\n        return x"]
    batched = llm.generate(prompts, max_tokens=16, suffix=suffixes, cache="dual", threshold=0.5)
    for prompt, suffix, out in zip(prompts, suffixes, batched, strict=True):
        assert out.token_ids == llm.generate(prompt, max_tokens=16, suffix=suffix, cache="dual",
                                             threshold=0.5)[0].token_ids


def test_suffixes_are_right_padded_and_their_padding_masked():
    batch = DecodeBatch.from_prompts([[5, 6], [7]], pad_id=0, stop_ids=[1], mask_id=3, device=torch.device("cpu"),
                                     suffixes=[[8, 9, 10], [11]])
    assert batch.suffixes.tolist() == [[8, 9, 10], [11, 0, 0]]
    assert batch.suffix_mask.tolist() == [[True, True, True], [True, False, False]]


@pytest.mark.parametrize("path", ["llama_path", "v2_path"])
def test_causal_and_block_causal_models_refuse_a_suffix(path, request):
    llm = kstep.load(request.getfixturevalue(path))
    with pytest.raises(ValueError, match="suffix: infilling needs"):
        llm.generate([5, 6, 7], max_tokens=8, suffix=[9, 10])


def test_suffix_count_must_match_the_prompts(llada_path):
    with pytest.raises(ValueError, match="one per prompt"):
        kstep.load(llada_path).generate(["a", "b"], max_tokens=8, suffix=["x", "y", "z"])


def test_http_suffix_with_the_official_client(llada_server, llada_path):
    import openai
    from test_server import client
    expected = kstep.load(llada_path).generate(PROMPT, max_tokens=16, suffix=SUFFIX)[0].text
    api = client(llada_server)
    out = api.completions.create(model="tiny", prompt=PROMPT, suffix=SUFFIX, max_tokens=16, temperature=0)
    assert out.choices[0].text == expected
    chunks = list(api.completions.create(model="tiny", prompt=PROMPT, suffix=SUFFIX, max_tokens=16, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    with pytest.raises(openai.BadRequestError, match="suffix"):
        api.completions.create(model="tiny", prompt=PROMPT, suffix=[5], max_tokens=16)  # not a string


def test_http_suffix_on_an_ar_model_is_a_400_naming_it(llama_server):
    import openai
    from test_server import client
    with pytest.raises(openai.BadRequestError) as err:
        client(llama_server).completions.create(model="tiny-ar", prompt=PROMPT, suffix=SUFFIX, max_tokens=8)
    assert err.value.body["param"] == "suffix" and "infilling needs" in err.value.body["message"]


@pytest.mark.parametrize("knobs", [{}, {"cache": "dual", "threshold": 0.5}])
def test_dream_infills_too(tmp_path, knobs):
    from dream_reference import write_dream_checkpoint
    llm = kstep.load(write_dream_checkpoint(tmp_path / "dream"))
    plain = llm.generate([5, 6, 7, 8], max_tokens=16, **knobs)[0]
    infilled = llm.generate([5, 6, 7, 8], max_tokens=16, suffix=[9, 10, 11, 12], **knobs)[0]
    assert len(infilled.token_ids) <= 16 and infilled.token_ids != plain.token_ids
