"""The bundled models load by name, work offline, and form fair pairs (same tokenizer, same size)."""
import pytest

import kstep
from kstep.bundled import BUNDLED_DIR, BUNDLED_MODELS, resolve_model

pytestmark = pytest.mark.skipif(not (BUNDLED_DIR / "default" / "model.safetensors").is_file(),
                                reason="bundled models not installed")


def same_tokenizer(a: str, b: str) -> bool:
    return (resolve_model(a) / "tokenizer.json").read_bytes() == (resolve_model(b) / "tokenizer.json").read_bytes()


def test_default_pair_loads_and_generates():
    diffusion, ar = kstep.load("default"), kstep.load("default-ar")
    assert diffusion.kind == "block-diffusion" and diffusion.cfg.family == "fast_dllm_v2"
    assert ar.cfg.family == "llama" and not ar.is_diffusion
    # The fair comparison: same tokenizer, same architecture size (the coder is the twin, converted).
    assert same_tokenizer("default", "default-ar")
    assert diffusion.cfg.num_params == ar.cfg.num_params
    [d] = diffusion.generate("def add(a, b):", max_tokens=32, min_tokens=32)
    [a] = ar.generate("def add(a, b):", max_tokens=32)
    assert len(d.token_ids) == 32 and d.text is not None and a.text is not None and 1 <= a.nfe <= 32
    # its default decoding (generation_config.json) unmasks several tokens in some passes
    defaults = diffusion.resolve(kstep.GenerationParams(max_tokens=32))
    assert defaults.policy.value == 0.8 and defaults.sub_block_length == 2
    assert d.nfe < 32


def test_llada_coder_is_the_full_attention_twin():
    llada, ar = kstep.load("llada-coder"), kstep.load("default-ar")
    assert llada.kind == "diffusion" and llada.cfg.family == "llada"
    assert same_tokenizer("llada-coder", "default-ar")
    assert abs(llada.cfg.num_params - ar.cfg.num_params) / ar.cfg.num_params < 0.05
    [d] = llada.generate("def add(a, b):", max_tokens=32, steps=16)
    assert d.nfe == 16 and d.text is not None


def test_draft_shares_the_ar_tokenizer_and_is_smaller():
    draft, ar = kstep.load("default-draft"), kstep.load("default-ar")
    assert same_tokenizer("default-draft", "default-ar")
    assert draft.cfg.num_params < 0.5 * ar.cfg.num_params


def test_bundled_weights_stay_small():
    for name in BUNDLED_MODELS:
        assert (resolve_model(name) / "model.safetensors").stat().st_size <= 15 * 2**20


def test_unknown_bundled_name_is_a_path_error():
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        kstep.load("no-such-model")


def test_block_coder_card_names_its_origin_data_and_decoding():
    from kstep.train.report import model_card
    card = model_card(resolve_model("default"), "block coder", {"masked-token CE": 4.9}, "scripts/x.sh")
    assert "from `bd8-stage1`'s weights" in card and "Trained from scratch" not in card
    assert "75% of the rows are the AR twin's greedy completions" in card
    assert "certainty forcing" in card and "threshold 0.8, small_block_size 2" in card
    ar_card = model_card(resolve_model("default-ar"), "ar", {"NLL": 3.4}, "x")
    assert "Trained from scratch" in ar_card and "distill" not in ar_card and "decoding defaults" not in ar_card
