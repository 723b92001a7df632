"""DiffusionGemma against transformers' own DiffusionGemmaForBlockDiffusion, in the same test, on
tiny random checkpoints it writes (tests/gemma_reference.py): the network in both modes, and kstep's
decoding against transformers' `generate` token for token with the same denoising passes per canvas
(deterministic: its top-1 logits filter; seeded sampling: end to end where the bits agree, else pass
by pass on transformers' own logits)."""
import pytest
import torch

import kstep
from kstep.decoding.loop import decode_alone
from kstep.models.diffusion_gemma_layers import DECODER
from kstep.runner.pass_output import PassOutput

from gemma_reference import STOP_IDS, hf_forward, hf_generate, write_gemma_checkpoint  # noqa: I001

transformers = pytest.importorskip("transformers")
PROMPTS = torch.randint(5, 320, (2, 11), generator=torch.Generator().manual_seed(1))  # 11 > the window of 8
EOS_PROMPT = torch.tensor([[2, 17, 42, 99, 5, 64, 23, 11, 80, 33, 77]])  # with seed 5: an end token at once


@pytest.fixture(scope="module")
def gemma(gemma_path):
    """The near-uniform checkpoint (init std 0.02): kstep and transformers, and the same weights."""
    hf = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(gemma_path).eval()
    return kstep.load(gemma_path), hf


@pytest.fixture(scope="module")
def peaky(tmp_path_factory):
    """A peaky checkpoint (init std 0.5): large logits, several positions accepted per pass."""
    path, hf = write_gemma_checkpoint(tmp_path_factory.mktemp("peaky"), init_std=0.5, seed=3)
    return kstep.load(path), hf


def kstep_forward(llm, prompt, canvases, soft=None):
    """Logits of a decoder pass over canvases[-1] after encoder passes over the prompt and canvases[:-1]."""
    m, B, T = llm.model, prompt.shape[0], prompt.shape[1]
    L = canvases[-1].shape[1]
    kv = m.allocate_kv(B, T + L * len(canvases))
    with torch.inference_mode():
        m.hidden_states(prompt, torch.arange(T).expand(B, -1), kv, 0)
        for i, canvas in enumerate(canvases[:-1]):
            start = T + i * L
            m.hidden_states(canvas, torch.arange(start, start + L).expand(B, -1), kv, start)
        start = T + (len(canvases) - 1) * L
        hidden = m.hidden_states(canvases[-1], torch.arange(start, start + L).expand(B, -1), kv, start,
                                 mode=DECODER, soft=None if soft is None else m.soft_embedding(soft))
        return m.logits(hidden)


def test_forward_logits_match_both_modes_with_and_without_self_conditioning(peaky):
    llm, hf = peaky
    g = torch.Generator().manual_seed(3)
    V = llm.cfg.vocab_size
    first, second = torch.randint(0, V, (2, 8), generator=g), torch.randint(0, V, (2, 8), generator=g)
    sc_logits = torch.randn(2, 8, V, generator=g) * 4
    # encoder mode: the causal pass's final hidden states (the prompt is longer than the window)
    from transformers.cache_utils import DynamicCache
    with torch.no_grad():
        hf_hidden = hf.model.encoder(input_ids=PROMPTS, cache=DynamicCache(config=hf.config.get_text_config(
            decoder=True))).last_hidden_state
        hidden = llm.model.hidden_states(PROMPTS, torch.arange(11).expand(2, -1))
    assert (llm.model.logits(hidden) - llm.model.logits(hf_hidden)).abs().max() < 2e-5
    want, cache = hf_forward(hf, PROMPTS, first)
    assert (want - kstep_forward(llm, PROMPTS, [first])).abs().max() < 2e-5  # observed ~6e-6
    want, _ = hf_forward(hf, PROMPTS, first, sc_logits)
    assert (want - kstep_forward(llm, PROMPTS, [first], sc_logits)).abs().max() < 2e-5
    # a commit's encoder pass with a cache (the sliding layers' window now holds prompt tokens), then
    # a decoder pass whose sliding layers see only the last 7 prefix tokens
    positions = torch.arange(11, 19)[None]
    with torch.no_grad():
        hf.model.encoder(input_ids=first, cache=cache, position_ids=positions)
        want = hf(cache=cache, decoder_input_ids=second, self_conditioning_logits=sc_logits,
                  decoder_position_ids=positions + 8).logits
    assert want.abs().max() > 5  # peaky: a misplaced window or scalar would show
    assert (want - kstep_forward(llm, PROMPTS, [first, second], sc_logits)).abs().max() < 2e-5


def kstep_run(llm, prompts: torch.Tensor, **settings):
    params = llm.resolve(kstep.GenerationParams(**settings))
    with torch.inference_mode():
        decoder = llm.make_decoder(prompts.tolist(), params)
        rows, _ = decode_alone(decoder)
    return rows, decoder


def hf_tokens(sequences: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """transformers' rows cut as kstep cuts them: to max_tokens, after the first stop token."""
    rows = []
    for row in sequences[:, :max_tokens].tolist():
        stop = next((i for i, t in enumerate(row) if t in STOP_IDS), None)
        rows.append(row if stop is None else row[:stop + 1])
    return rows


@pytest.mark.parametrize("rows,seed,max_tokens", [
    (1, 1234, 24),  # three canvases (20, 17, 26 passes)
    (2, 1, 16),     # a batch whose rows stop denoising at different passes
    (0, 5, 16),     # an end token in the first canvas ends the row (EOS_PROMPT)
    (2, 4, 15),     # one row ends on an end token, the other runs; 15: not a whole number of canvases
])
def test_deterministic_generate_is_transformers_top1_run(gemma, rows, seed, max_tokens):
    llm, hf = gemma
    prompts = PROMPTS[:rows] if rows else EOS_PROMPT
    sequences, tokens_per_forward, hf_steps = hf_generate(hf, prompts, seed, max_tokens, top1=True)
    got, decoder = kstep_run(llm, prompts, max_tokens=max_tokens, temperature=0.0, seed=seed)
    assert got == hf_tokens(sequences, max_tokens)
    assert decoder.steps_per_canvas == hf_steps
    hf_passes = ((sequences != 0).sum(-1) / tokens_per_forward).round().long()
    assert decoder.decoder_passes.tolist() == hf_passes.tolist()
    if seed == 1:
        assert len(set(decoder.decoder_passes.tolist())) == 2
    if seed in (5, 4):
        assert any(row[-1] in STOP_IDS for row in got) and len(hf_steps) == -(-max_tokens // 8) - (seed == 5)


@pytest.mark.parametrize("rows,settings", [
    (1, dict(max_denoising_steps=12)),
    (2, dict(max_denoising_steps=8, entropy_bound=0.5, t_max=1.0, t_min=0.5)),
])
def test_seeded_sampling_is_transformers_run_end_to_end(gemma, rows, settings):
    """Near-uniform logits: kstep's forward and transformers' agree closely enough that every draw
    lands the same, so the whole seeded run is identical."""
    llm, hf = gemma
    prompts = PROMPTS[:rows]
    config = dict(settings)
    if "entropy_bound" in config:
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
        config["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=config.pop("entropy_bound"))
    sequences, _, hf_steps = hf_generate(hf, prompts, 77, 16, top1=False, **config)
    got, decoder = kstep_run(llm, prompts, max_tokens=16, temperature=1.0, seed=77, **settings)
    assert got == hf_tokens(sequences, 16) and decoder.steps_per_canvas == hf_steps


def record_decoder_passes(hf) -> list:
    """Every decoder pass transformers' generate runs (it calls `self.forward`, which module hooks do
    not see): its input canvas, self-conditioning logits and logits."""
    calls, forward = [], hf.forward

    def recording(**kwargs):
        out = forward(**kwargs)
        sc = kwargs.get("self_conditioning_logits")
        calls.append((kwargs["decoder_input_ids"].clone(), None if sc is None else sc.clone(), out.logits.clone()))
        return out
    hf.forward = recording
    return calls


@pytest.mark.parametrize("settings", [
    dict(max_denoising_steps=10, top_k=20),
    dict(max_denoising_steps=24, stability_threshold=0, confidence_threshold=1.0, entropy_bound=2.0),
])
def test_seeded_sampling_matches_transformers_pass_by_pass_on_its_logits(peaky, settings):
    """Peaky logits: ~1e-6 forward noise can flip a draw, so kstep's sampler is driven by
    transformers' logits: each pass's input canvas and self-conditioning signal, and the committed
    canvases, must be transformers' exactly."""
    from transformers.generation import LogitsProcessorList, TopKLogitsWarper
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
    llm, hf = peaky
    config = {k: v for k, v in settings.items() if k not in ("top_k", "entropy_bound")}
    if "entropy_bound" in settings:
        config["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=settings["entropy_bound"])
    processors = LogitsProcessorList([TopKLogitsWarper(settings["top_k"])]) if "top_k" in settings else None
    calls = record_decoder_passes(hf)
    try:
        torch.manual_seed(11)
        with torch.no_grad():
            out = hf.generate(PROMPTS[:1], max_new_tokens=16, logits_processor=processors, eos_token_id=STOP_IDS,
                              pad_token_id=0, **config)
    finally:
        del hf.forward
    params = llm.resolve(kstep.GenerationParams(max_tokens=16, temperature=1.0, seed=11, **settings))
    decoder = llm.make_decoder(PROMPTS[:1].tolist(), params)
    committed, calls = [], iter(calls)
    with torch.inference_mode():
        while passes := decoder.next_passes():
            [p] = passes
            if p.mode != DECODER:
                step = decoder.update([None])  # an encoder pass: its logits are not read
            else:
                canvas, sc_logits, logits = next(calls)
                assert torch.equal(p.ids, canvas)
                assert (p.soft_embeds is None) == (sc_logits is None)
                if sc_logits is not None:
                    assert torch.equal(p.soft_embeds, llm.model.soft_embedding(sc_logits))
                step = decoder.update([PassOutput.of_logits(logits)])
            committed += step.new_token_ids[0]
    assert next(calls, None) is None
    assert committed == hf_tokens(out.sequences[:, 11:], 16)[0]
    if "stability_threshold" in settings:  # the confident stop ended a canvas before its 24 passes
        assert min(decoder.steps_per_canvas) < 24


def test_config_and_knob_errors(gemma, llada_path):
    llm, _ = gemma
    with pytest.raises(ValueError, match="t_max .* must be greater than t_min"):
        llm.resolve(kstep.GenerationParams(t_max=0.3, t_min=0.4))
    with pytest.raises(ValueError, match="steps does not apply to a diffusion_gemma model"):
        llm.resolve(kstep.GenerationParams(steps=4))
    with pytest.raises(ValueError, match="entropy_bound does not apply to a llada model"):
        kstep.load(llada_path).resolve(kstep.GenerationParams(entropy_bound=0.2))
    with pytest.raises(ValueError, match="entropy_bound must be > 0"):
        kstep.GenerationParams(entropy_bound=0.0)
    with pytest.raises(ValueError, match="infilling"):
        llm.generate([5, 6, 7], suffix=[8, 9])
    llm.cfg.image_token_id = 300  # (the tiny vocabulary cannot hold the real 258880)
    try:
        with pytest.raises(ValueError, match="image token id 300: diffusion_gemma runs text only"):
            llm.generate([5, 300, 7])
    finally:
        llm.cfg.image_token_id = 258880
    # generation_config.json's defaults: the checkpoint's values are taken, the rest are transformers'
    resolved = llm.resolve(kstep.GenerationParams())
    assert (resolved.max_denoising_steps, resolved.entropy_bound, resolved.t_min, resolved.t_max,
            resolved.stability_threshold, resolved.confidence_threshold) == (48, 0.1, 0.4, 0.8, 1, 0.005)


def test_left_padded_rows_equal_themselves_alone(peaky):
    """A batch of prompts of different lengths (left-padded, positions counting real tokens): each
    row's encoder and decoder passes give its logits alone, sliding window included."""
    llm, _ = peaky
    m, V = llm.model, llm.cfg.vocab_size
    short, long = PROMPTS[0, 6:], PROMPTS[1]  # 5 and 11 tokens
    canvas = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(4))
    batch = torch.stack([torch.cat([torch.zeros(6, dtype=torch.long), short]), long])
    real = torch.ones(2, 19, dtype=torch.bool)
    real[0, :6] = False
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    kv = m.allocate_kv(2, 19)
    with torch.inference_mode():
        m.hidden_states(batch, positions[:, :11], kv, 0, key_mask=real[:, :11])
        got = m.logits(m.hidden_states(canvas, positions[:, 11:], kv, 11, mode=DECODER, key_mask=real))
    torch.testing.assert_close(got[0], kstep_forward(llm, short[None], [canvas[:1]])[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[1], kstep_forward(llm, long[None], [canvas[1:]])[0], atol=1e-4, rtol=1e-5)


def test_config_forms_transformers_accepts(gemma_path):
    import json
    from kstep.models.diffusion_gemma import parse_config
    raw = json.loads((gemma_path / "config.json").read_text())
    saved = parse_config(raw, "diffusion_gemma", "two_mode")
    assert saved.layer_head_dims == (8, 8, 16) and saved.layer_kv_heads == (2, 2, 1) and saved.softcap == 30.0
    # the constructor's keys instead of the per_layer_config save_pretrained writes
    text = {k: v for k, v in raw["text_config"].items() if k != "per_layer_config"}
    built = parse_config({**raw, "text_config": {**text, "global_head_dim": 16, "num_global_key_value_heads": 1,
                                                 "final_logit_softcapping": 20.0}}, "diffusion_gemma", "two_mode")
    assert built.layer_head_dims == saved.layer_head_dims and built.layer_kv_heads == saved.layer_kv_heads
    assert built.softcap == 20.0
    default = parse_config({**raw, "text_config": text}, "diffusion_gemma", "two_mode")
    assert default.layer_head_dims == (8, 8, 512)  # transformers' default global_head_dim
    for change, match in (({"use_bidirectional_attention": "all"}, "bidirectional encoder"),
                          ({"num_experts": None}, "num_experts is required"),
                          ({"hidden_activation": "silu"}, "hidden_activation")):
        with pytest.raises(ValueError, match=match):
            parse_config({**raw, "text_config": {**raw["text_config"], **change}}, "diffusion_gemma", "two_mode")
    cfg = kstep.load(gemma_path).cfg  # active parameters: top-2 of 4 experts
    assert cfg.num_active_params < cfg.num_params


def test_generation_config_supplies_the_defaults(gemma_path, tmp_path):
    import json
    import shutil
    shutil.copytree(gemma_path, tmp_path / "ck")
    gen_path = tmp_path / "ck" / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen.update(max_denoising_steps=7, t_max=0.9, sampler_config={"_cls_name": "EntropyBoundSamplerConfig",
                                                                  "entropy_bound": 0.3})
    gen_path.write_text(json.dumps(gen))
    llm = kstep.load(tmp_path / "ck")
    resolved = llm.resolve(kstep.GenerationParams())
    assert (resolved.max_denoising_steps, resolved.t_max, resolved.entropy_bound, resolved.t_min) == (7, 0.9, 0.3, 0.4)
    assert llm.resolve(kstep.GenerationParams(max_denoising_steps=3)).max_denoising_steps == 3  # the request's wins
    assert llm.stop_ids[:2] == STOP_IDS  # its end tokens, a list
    gen["sampler_config"]["_cls_name"] = "OtherSampler"
    gen_path.write_text(json.dumps(gen))
    with pytest.raises(ValueError, match="sampler_config 'OtherSampler' is not supported"):
        kstep.load(tmp_path / "ck")
