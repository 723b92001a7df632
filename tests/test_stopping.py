"""Completions are cut at the first end-of-sequence token; finish_reason says why they ended."""
import json

import pytest
from conftest import copy_checkpoint

import kstep


def test_cut_at_eos_from_checkpoint(tmp_path, llama_path, llada_path):
    for path in (llama_path, llada_path):
        llm = kstep.load(path)
        first = llm.generate("def f(x):", max_tokens=16)[0]
        assert first.finish_reason == "length" and len(first.token_ids) == 16
        # Declare the 4th generated token to be the end-of-sequence token: output must stop right before it.
        eos = first.token_ids[3]
        cut_at = first.token_ids.index(eos)
        copy = copy_checkpoint(path, tmp_path / path.name, eos_token_id=eos)
        second = kstep.load(copy).generate("def f(x):", max_tokens=16)[0]
        assert second.token_ids == first.token_ids[:cut_at]
        assert second.finish_reason == "stop"


def test_autoregressive_stops_early_and_counts_passes(tmp_path, llama_path):
    llm = kstep.load(llama_path)
    first = llm.generate("def f(x):", max_tokens=16)[0]
    copy = copy_checkpoint(llama_path, tmp_path / "c", eos_token_id=first.token_ids[0])
    out = kstep.load(copy).generate("def f(x):", max_tokens=16)[0]
    assert out.token_ids == [] and out.finish_reason == "stop"
    assert out.nfe == 1  # the prefill pass produced the stop token; no decode pass ran


def test_generation_config_eos_is_honoured(tmp_path, llama_path):
    llm = kstep.load(llama_path)
    first = llm.generate("abc", max_tokens=8)[0]
    copy = copy_checkpoint(llama_path, tmp_path / "g")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [first.token_ids[2]]}))
    out = kstep.load(copy).generate("abc", max_tokens=8)[0]
    assert out.token_ids == first.token_ids[: first.token_ids.index(first.token_ids[2])]


def test_checkpoint_without_tokenizer_works_on_ids(tmp_path, llada_path):
    copy = copy_checkpoint(llada_path, tmp_path / "notok")
    (copy / "tokenizer.json").unlink()
    llm = kstep.load(copy)
    out = llm.generate([7, 8, 9], max_tokens=8)[0]
    assert out.text is None and len(out.token_ids) <= 8


def test_chat_template_renders_and_is_used(llada_path):
    llm = kstep.load(llada_path)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.chat_prompt([{"role": "user", "content": "hi"}])
    assert ids[0] == llm.tokenizer.token_to_id("<|im_start|>")
    # The end-of-turn marker of the template stops generation too.
    assert llm.tokenizer.token_to_id("<|im_end|>") in llm.stop_ids


def test_diffusion_early_stop_saves_passes_without_changing_output(tmp_path, llada_path):
    llm = kstep.load(llada_path)
    settings = dict(max_tokens=64, block_length=8, steps=64)
    first = llm.generate("def f(x):", **settings, early_stop=False)[0]
    eos = first.token_ids[5]  # declare a token of the first block to be end-of-sequence
    copy = kstep.load(copy_checkpoint(llada_path, tmp_path / "e", eos_token_id=eos))
    for cache in ("none", "dual"):
        full = copy.generate("def f(x):", **settings, cache=cache, early_stop=False)[0]
        early = copy.generate("def f(x):", **settings, cache=cache)[0]
        assert early.token_ids == full.token_ids and early.finish_reason == full.finish_reason == "stop"
        assert early.nfe < full.nfe == 64


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_min_tokens_suppresses_stop_tokens(tmp_path, llama_path, llada_path, draft):
    """The first generated token declared end-of-sequence: without min_tokens the output is empty,
    with it there are min_tokens tokens and none of them is that id (AR, speculative, diffusion)."""
    for path in (llama_path, llada_path) if draft is None else (llama_path,):
        first = kstep.load(path).generate("def f(x):", max_tokens=16)[0]
        llm = kstep.load(copy_checkpoint(path, tmp_path / path.name, eos_token_id=first.token_ids[0]), draft=draft)
        extra = {"num_draft_tokens": 3} if draft else {}
        assert llm.generate("def f(x):", max_tokens=16, **extra)[0].token_ids[:1] != first.token_ids[:1]
        forced = llm.generate("def f(x):", max_tokens=16, min_tokens=16, **extra)[0]
        assert len(forced.token_ids) == 16 and first.token_ids[0] not in forced.token_ids
        part = llm.generate("def f(x):", max_tokens=16, min_tokens=4, **extra)[0]
        assert len(part.token_ids) >= 4
    with pytest.raises(ValueError, match="min_tokens"):
        kstep.GenerationParams(max_tokens=8, min_tokens=9)


def test_canvas_edits_are_tokens_changed_into_other_tokens_not_masks_filled():
    from kstep.engine.text_stream import TextStream
    stream, MASK = TextStream(None, [], []), 9
    assert stream.canvas_edits([MASK, MASK, MASK], MASK) == []
    assert stream.canvas_edits([1, MASK, MASK], MASK) == []       # a mask filled in is not an edit
    assert stream.canvas_edits([2, 5, MASK], MASK) == [0]         # 1 -> 2 is
    assert stream.canvas_edits([2, 5, 7], MASK) == []
    assert stream.canvas_edits([3, 5, 8], None) == [0, 2]         # no mask id (random-start canvases)
