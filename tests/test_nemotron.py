"""Nemotron-Labs-Diffusion: a checkpoint kstep writes in the released layout loads, its forward equals
the remote code's network (transformers' Ministral 3 with the remote attention switch:
tests/nemotron_reference.py) in both attention modes, and each mode, chosen per request, gives its
reference method's tokens at temperature 0 with its number of forward passes: `diffusion` =
`generate` (block diffusion with a causal context), `ar` = `ar_generate`, `linear_spec` =
`linear_spec_generate` (whose tokens are also the AR ones)."""
import json

import pytest
import torch
from conftest import copy_checkpoint
from nemotron_reference import ReferenceNemotron, ar_generate, generate, linear_spec_generate
from safetensors.torch import load_file, save_file

import kstep
from kstep.budget.block import worst_run
from kstep.budget.planner import token_seconds
from kstep.decoding.loop import decode_alone
from kstep.layers.rotary import rope_inv_freq
from kstep.models import nemotron_labs_diffusion as layout
from kstep.random_checkpoint import random_config, write_random_checkpoint
from kstep.shapes import shape_sizes
from kstep.train.bpe import MASK, SPECIAL_TOKENS

FAMILY = "nemotron_labs_diffusion"
FIRST_ID = len(SPECIAL_TOKENS)  # prompts avoid the special tokens (pad, eos, mask, ...)


def edit_tensors(path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def no_mask_prediction(tensors: dict) -> None:
    """The head's row for the mask token at 0, so random weights never predict it (a trained model
    never does): the reference's sampler can pick the mask token, which leaves a position masked;
    kstep's never does (a masked position must become a token)."""
    tensors["diffusion_head.weight"][SPECIAL_TOKENS.index(MASK)] = 0


@pytest.fixture(scope="module")
def nld_path(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("nld"), family=FAMILY, seed=5)
    edit_tensors(path, no_mask_prediction)
    return path


@pytest.fixture(scope="module")
def cyclic_path(nld_path, tmp_path_factory):
    """Weights whose predictions often agree in both attention modes, so LinearSpec keeps some drafts
    and not others: attention scaled down (context still matters), and the head made to predict
    mask -> c, d -> c, c -> d from each token's own hidden state (a c d c d ... cycle the drafts,
    all c, half match)."""
    path = copy_checkpoint(nld_path, tmp_path_factory.mktemp("cyclic") / "ck")
    edit_tensors(path, lambda t: [t[k].mul_(0.3) for k in t if k.endswith("o_proj.weight")])
    model = kstep.load(path).model
    c, d, mask = FIRST_ID + 35, FIRST_ID + 36, SPECIAL_TOKENS.index(MASK)
    unit = {t: torch.nn.functional.normalize(model.hidden_states(torch.tensor([[t]]), torch.tensor([[0]]), None)[0, 0],
                                             dim=0) for t in (c, d, mask)}

    def cycle(tensors):
        head = tensors["diffusion_head.weight"]
        head[c] += 30 * (unit[mask] + unit[d])
        head[d] += 30 * unit[c]
    edit_tensors(path, cycle)
    return path


@pytest.fixture(scope="module")
def models(nld_path):
    return kstep.load(nld_path), ReferenceNemotron(nld_path)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(FIRST_ID, 400, (1, n), generator=torch.Generator().manual_seed(seed))


def test_written_in_the_released_layout(nld_path):
    raw = json.loads((nld_path / "config.json").read_text())
    assert raw["architectures"] == ["NemotronLabsDiffusionModel"] and raw["model_type"] == FAMILY
    assert (raw["dlm_paradigm"], raw["block_size"], raw["tie_word_embeddings"]) == ("bidirectional", 8, False)
    assert raw["rope_parameters"] == {"rope_theta": 1e6, **layout.ROPE, "original_max_position_embeddings": 64}
    names = set(load_file(str(nld_path / "model.safetensors")))
    assert {"encoder.embed_tokens.weight", "encoder.norm.weight", "diffusion_head.weight",
            "encoder.layers.1.self_attn.o_proj.weight", "encoder.layers.0.mlp.gate_proj.weight"} <= names
    llm = kstep.load(nld_path)
    assert llm.cfg == random_config(FAMILY, llm.cfg.vocab_size)  # config.json read back as written
    # the 3B shape: the released config's sizes and rope (original context 262144 / 16 = 16384)
    three_b = layout.to_raw_config(random_config(FAMILY, **shape_sizes("nemotron-3b")))
    assert {k: three_b[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")} == \
        {"hidden_size": 3072, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072, "max_position_embeddings": 262144}
    assert three_b["rope_parameters"]["original_max_position_embeddings"] == 16384
    with pytest.raises(ValueError, match="dlm_paradigm='block_diff' is not supported"):
        layout.parse_config({**raw, "dlm_paradigm": "block_diff"}, FAMILY, "causal")


def test_forward_equals_the_reference_in_both_attention_modes(models):
    llm, ref = models
    yarn = ref.encoder.rotary_emb
    assert torch.equal(yarn.inv_freq, rope_inv_freq(llm.cfg.head_dim, llm.cfg.rope_theta, llm.cfg.rope_scaling))
    assert float(llm.model.rotary.query_scales(torch.tensor(80))) > 1  # past the original 64: scaled queries
    ids, block = prompt(80, 0), prompt(8, 1)
    block[0, 3:] = llm.cfg.mask_token_id
    cache, kv = ref.new_cache(), llm.runner.allocate_kv(1, 88)
    want = ref.forward(ids, cache, bidirectional=False, use_cache=True)  # (1, 80, V)
    causal = llm.runner.causal_pass(ids, torch.arange(80)[None], None, 0, kv)
    causal.logits_from = 0
    got = llm.runner.logits(causal)
    assert want.abs().max() > 3 and (got - want).abs().max() < 1e-4
    want = ref.forward(block, cache, bidirectional=True, use_cache=False)  # the block against the cache
    got = llm.runner.logits(llm.runner.ragged_causal_pass(block, torch.arange(80, 88)[None], torch.tensor([80]),
                                                          torch.ones(1, 88, dtype=torch.bool), kv, is_causal=False))
    assert cache.get_seq_length() == 80 and (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("prompt_len,max_tokens,knobs,threshold", [
    (10, 32, {}, 0.9),                   # the defaults: the checkpoint's block (8), threshold 0.9
    (58, 24, {"exact": True}, None),     # one token per pass (no threshold); positions cross 64
    (7, 16, {"threshold": 0.5}, 0.5),
])
def test_diffusion_mode_equals_generate(models, prompt_len, max_tokens, knobs, threshold):
    llm, ref = models
    ids = prompt(prompt_len, prompt_len)
    want, want_nfe = generate(ref, ids, max_tokens, 8, threshold, eos_token_id=-1)
    got = llm.generate(ids[0].tolist(), max_tokens=max_tokens, ignore_eos=True, **knobs)[0]
    assert got.token_ids == want[0, prompt_len:].tolist()
    assert got.nfe == want_nfe  # kstep counts the prefill, the reference the last block's commit


def test_ar_mode_equals_ar_generate(models):
    llm, ref = models
    ids = prompt(12, 3)
    want, want_nfe = ar_generate(ref, ids, 20, eos_token_id=-1)
    got = llm.generate(ids[0].tolist(), max_tokens=20, ignore_eos=True, mode="ar")[0]
    assert got.token_ids == want[0, 12:].tolist() and got.nfe == want_nfe == 20


@pytest.mark.parametrize("weights", ["random", "cyclic"])
def test_linear_spec_equals_its_reference_and_the_ar_output(weights, nld_path, cyclic_path):
    path = nld_path if weights == "random" else cyclic_path
    llm, ref = kstep.load(path), ReferenceNemotron(path)
    for n, seed in ((10, 4), (30, 5)):
        ids = prompt(n, seed)
        want, want_nfe = linear_spec_generate(ref, ids, 40, block_length=8, eos_token_id=-1)
        got = llm.generate(ids[0].tolist(), max_tokens=40, ignore_eos=True, mode="linear_spec")[0]
        ar = llm.generate(ids[0].tolist(), max_tokens=40, ignore_eos=True, mode="ar")[0]
        assert got.token_ids == want[0, n:n + 40].tolist() == ar.token_ids
        assert got.nfe == want_nfe
        kept = got.timings["acceptance_rate"]
        assert weights == "random" or 0 < kept < 1  # some drafts kept, not all


def test_each_mode_stops_where_its_reference_does(nld_path, tmp_path):
    """A stop token in the middle of each mode's completion (config.json's eos set to one it writes)."""
    ids = prompt(10, 7)
    llm = kstep.load(nld_path)
    references = {"diffusion": lambda ref, eos: generate(ref, ids, 32, 8, 0.9, eos),
                  "ar": lambda ref, eos: ar_generate(ref, ids, 32, eos),
                  "linear_spec": lambda ref, eos: linear_spec_generate(ref, ids, 32, 8, eos)}
    for mode, reference in references.items():
        plain = llm.generate(ids[0].tolist(), max_tokens=32, mode=mode, ignore_eos=True)[0].token_ids
        eos = plain[13]
        path = copy_checkpoint(nld_path, tmp_path / mode, eos_token_id=eos)
        want, _ = reference(ReferenceNemotron(path), eos)
        got = kstep.load(path).generate(ids[0].tolist(), max_tokens=32, mode=mode)[0]
        assert got.token_ids == plain[:plain.index(eos)] == want[0, 10:-1].tolist(), mode
        assert want[0, -1] == eos and got.finish_reason == "stop", mode


@pytest.mark.parametrize("mode", ["diffusion", "ar", "linear_spec"])
def test_a_padded_batch_equals_each_prompt_alone(models, mode):
    llm, _ = models
    prompts = [prompt(5, 8)[0].tolist(), prompt(17, 9)[0].tolist()]
    together = llm.generate(prompts, max_tokens=20, mode=mode, ignore_eos=True)
    assert [r.token_ids for r in together] == [llm.generate(p, max_tokens=20, mode=mode, ignore_eos=True)[0].token_ids
                                               for p in prompts]


def test_mode_is_checked_and_each_mode_takes_its_own_knobs(models, llama_path):
    llm, _ = models
    with pytest.raises(ValueError, match="mode 'dlm' is not a decoding mode"):
        kstep.GenerationParams(mode="dlm")
    with pytest.raises(ValueError, match="mode does not apply to a llama model"):
        kstep.load(llama_path).generate("x", max_tokens=4, mode="ar")
    with pytest.raises(ValueError, match=r"threshold does not apply to mode 'ar' of a nemotron_labs_diffusion model "
                                          r"\(autoregressive decoding\); it is for diffusion / block-diffusion"):
        llm.generate("x", max_tokens=4, mode="ar", threshold=0.5)
    with pytest.raises(ValueError, match="mode 'linear_spec' of a nemotron_labs_diffusion"):
        llm.generate("x", max_tokens=4, mode="linear_spec", threshold=0.5)
    # drafts belong to linear_spec: the refusal points there, not to a draft 'self' it would refuse too
    with pytest.raises(ValueError, match="num_draft_tokens: mode 'diffusion' .* takes no drafts; .* mode 'linear_spec'"):
        llm.generate("x", max_tokens=8, mode="diffusion", num_draft_tokens=3)
    assert llm.resolve(kstep.GenerationParams(mode="linear_spec")).num_draft_tokens == 7  # the block size - 1
    resolved = llm.resolve(kstep.GenerationParams())
    assert (resolved.mode, resolved.block_length, resolved.threshold) == ("diffusion", 8, 0.9)
    # a LinearSpec round of 3 drafts: still the AR tokens
    ids = prompt(9, 10)[0].tolist()
    short = llm.generate(ids, max_tokens=16, mode="linear_spec", num_draft_tokens=3, ignore_eos=True)[0]
    assert short.token_ids == llm.generate(ids, max_tokens=16, mode="ar", ignore_eos=True)[0].token_ids


def test_time_budget_plans_each_mode(models):
    llm, _ = models
    ids = prompt(10, 11)[0].tolist()
    resolved = llm.resolve(kstep.GenerationParams(max_tokens=20))
    run = worst_run(resolved, 10, llm.family.block_rules)  # prefill + 3 blocks of 7 masks + 2 commits
    assert run.passes == 1 + 3 * 7 + 2
    for mode in ("diffusion", "ar", "linear_spec"):
        result = llm.generate(ids, max_tokens=20, mode=mode, time_budget=30.0)[0]
        assert result.timings["planned_passes"] >= result.nfe or mode == "linear_spec"  # planned in AR tokens
        assert result.timings["predicted_seconds"] > 0
    costs = llm.pass_costs  # calibrated now: LinearSpec's worst token costs two passes of its block
    ar, spec = (llm.resolve(kstep.GenerationParams(max_tokens=20, mode=m)) for m in ("ar", "linear_spec"))
    assert token_seconds(costs, spec, 30) == 2 * costs.predict(8, 37) > token_seconds(costs, ar, 30)


def test_modes_share_the_causal_prompt_keys(models):
    """The prefix cache: a prompt's keys are causal in every mode, so one mode's cached blocks serve the
    next request of another, with the tokens it has without a cache."""
    llm, _ = models
    ids = prompt(40, 12)[0].tolist()
    cache = llm.runner.make_prefix_cache(1 << 22, 16)
    for mode, cached in (("diffusion", 0), ("ar", 32), ("diffusion", 32)):  # whole blocks of 16 before the last token
        params = llm.resolve(kstep.GenerationParams(max_tokens=16, mode=mode, ignore_eos=True))
        decoder = llm.make_decoder([ids], params, cache)
        rows, _ = decode_alone(decoder)
        assert rows[0] == llm.generate(ids, max_tokens=16, mode=mode, ignore_eos=True)[0].token_ids, mode
        assert decoder.num_cached_tokens == cached, mode
