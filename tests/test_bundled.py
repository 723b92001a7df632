"""The bundled models load by name, work offline, and form a fair pair (same tokenizer, same size)."""
import pytest

import kstep
from kstep.bundled import BUNDLED_DIR, resolve_model

pytestmark = pytest.mark.skipif(not (BUNDLED_DIR / "default" / "model.safetensors").is_file(),
                                reason="bundled models not installed")


def test_default_pair_loads_and_generates():
    diffusion, ar = kstep.load("default"), kstep.load("default-ar")
    assert diffusion.is_diffusion and not ar.is_diffusion
    assert diffusion.cfg.family == "llada" and ar.cfg.family == "llama"
    # The fair comparison: same tokenizer, same architecture size.
    assert (resolve_model("default") / "tokenizer.json").read_bytes() == \
        (resolve_model("default-ar") / "tokenizer.json").read_bytes()
    assert abs(diffusion.cfg.num_params - ar.cfg.num_params) / ar.cfg.num_params < 0.05
    [d] = diffusion.generate("def add(a, b):\n", max_tokens=32, steps=16)
    [a] = ar.generate("def add(a, b):\n", max_tokens=32)
    assert d.nfe == 16 and d.text is not None and a.text is not None and 1 <= a.nfe <= 32


def test_draft_shares_the_ar_tokenizer_and_is_smaller():
    draft, ar = kstep.load("default-draft"), kstep.load("default-ar")
    assert (resolve_model("default-draft") / "tokenizer.json").read_bytes() == \
        (resolve_model("default-ar") / "tokenizer.json").read_bytes()
    assert draft.cfg.num_params < 0.5 * ar.cfg.num_params


def test_bundled_weights_stay_small():
    for name in ("default", "default-ar", "default-draft"):
        assert (resolve_model(name) / "model.safetensors").stat().st_size <= 15 * 2**20


def test_unknown_bundled_name_is_a_path_error():
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        kstep.load("no-such-model")
