"""Token healing: a text prompt that ends mid-token (a trailing newline or space, which byte-level
BPE merges with what follows) backs up to the last token boundary, and the first generated token
must start with the text given back, on every family, in `generate` and in the engine."""
import pytest

import kstep
from kstep.engine.engine import Engine
from kstep.engine.request import Request
from kstep.random_checkpoint import write_random_checkpoint

PROMPT = 'def is_even(n):\n    """Return True if n is even."""'


@pytest.fixture(scope="module")
def bundled_tokenizer():
    return kstep.load("default-ar").tokenizer


@pytest.mark.parametrize("tail", ["\n", " "])
def test_a_trailing_newline_or_space_is_given_back(bundled_tokenizer, tail):
    tok = bundled_tokenizer
    ids = tok.encode(PROMPT + tail)
    healed, given_back, allowed = tok.heal(ids)
    assert healed == ids[:-1] and given_back == tail
    assert len(allowed) > 1 and all(tok.decode([i], skip_special_tokens=False).startswith(tail) for i in allowed)
    # the boundary is the tokenizer's own: a continuation the model saw in training re-encodes to it
    assert tok.encode(PROMPT + tail + "    return n % 2 == 0")[:len(healed)] == healed


def test_a_prompt_on_a_token_boundary_is_unchanged(bundled_tokenizer):
    ids = bundled_tokenizer.encode(PROMPT)  # ends with the docstring's quotes: nothing merges with them
    assert bundled_tokenizer.heal(ids) == (ids, "", [])


@pytest.fixture(scope="module", params=["llama", "llada", "dream", "fast_dllm_v2", "sdar"])
def llm(request, tmp_path_factory):
    return kstep.load(write_random_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=3))


@pytest.mark.parametrize("tail", ["\n", " "])
def test_generation_starts_with_the_text_given_back(llm, tail):
    prompt = "def f(x):" + tail
    ids, given_back, allowed = llm.heal(llm.encode_prompt(prompt), kstep.GenerationParams(), is_text=True)
    assert given_back == tail
    [healed] = llm.generate(prompt, max_tokens=8, ignore_eos=True)
    assert healed.token_ids[0] in allowed  # the first token spells the newline/space, maybe with more
    text = llm.tokenizer.decode(healed.token_ids)
    assert text.startswith(tail) and healed.text == text[len(tail):]  # the given-back text is the prompt's
    [plain] = llm.generate(prompt, max_tokens=8, ignore_eos=True, token_healing=False)
    assert plain.prompt_tokens == healed.prompt_tokens + 1
    [as_ids] = llm.generate(llm.encode_prompt(prompt), max_tokens=8, ignore_eos=True)  # ids are taken as given
    assert as_ids.token_ids == plain.token_ids


def test_the_engine_heals_like_generate(llm):
    prompt = "def f(x):\n"
    params = llm.resolve(kstep.GenerationParams(max_tokens=8, ignore_eos=True))
    ids, given_back, allowed = llm.heal(llm.encode_prompt(prompt), params, is_text=True)
    engine = Engine(llm)
    engine.add_request(request := Request([ids], params, given_back=[given_back], first_tokens=[allowed]))
    text = ""
    while engine.has_work():
        outputs, _ = engine.step()
        text += "".join(c.text for out in outputs for c in out.choices)
    assert request.output_ids[0] == llm.generate(prompt, max_tokens=8, ignore_eos=True)[0].token_ids
    assert text == llm.generate(prompt, max_tokens=8, ignore_eos=True)[0].text
