"""Every family one command away: the "Try each family" commands of docs/models.md run as written
(in-process through kstep.cli.main, their runs/ paths moved into tmp_path) and print what its table
says; the DiffusionGemma checkpoint kstep writes without transformers is one transformers loads, with
kstep's logits and top-1 run; `--generation-config` reaches the checkpoint's defaults; bad sizes are
one-line errors with exit code 2."""
import json
import re
from pathlib import Path

import pytest
import torch

import kstep
import test_docs as docs_check  # the docs' shell parser (imported as a module: its tests are not re-collected)
from kstep.cli import main
from kstep.random_checkpoint import random_config, write_random_checkpoint
from kstep.registry import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
MODELS_PAGE = ROOT / "docs" / "models.md"
RUNS = re.compile(r"^runs/(tiny-\w+)$")


def try_section() -> str:
    text = MODELS_PAGE.read_text()
    start = text.index("\n## Try each family\n")
    return text[start:text.index("\n## ", start + 1)]


def try_commands() -> dict[str, tuple[list[str], list[str]]]:
    """family -> (the random-checkpoint arguments, the generate arguments), as the block gives them."""
    [body] = [body for _, lang, body in docs_check.shell_blocks(try_section()) if lang in docs_check.SHELL_LANGS]
    calls = [docs_check.kstep_call(words) for words in docs_check.split_commands(body)]
    pairs: dict[str, tuple[list[str], list[str]]] = {}
    for write, generate in zip(calls[::2], calls[1::2]):
        assert write[0] == "random-checkpoint" and generate[0] == "generate", (write, generate)
        family = write[write.index("--family") + 1]
        out = write[write.index("--out") + 1]
        assert generate[generate.index("--model") + 1] == out == f"runs/tiny-{family}", (write, generate)
        pairs[family] = (write, generate)
    assert len(calls) == 2 * len(pairs), "the block is one random-checkpoint and one generate line per family"
    return pairs


def documented_prints() -> dict[str, str]:
    """family -> the start of the stats line its table row says the generate prints."""
    rows = re.findall(r"^\| `(\w+)` \|.*\| `(-- [^`]+)`", try_section(), re.M)
    return dict(rows)


def in_tmp(args: list[str], tmp_path: Path) -> list[str]:
    return [str(tmp_path / m.group(1)) if (m := RUNS.match(a)) else a for a in args]


def test_the_block_covers_every_family_once():
    assert sorted(try_commands()) == sorted(FAMILIES)
    assert sorted(documented_prints()) == sorted(FAMILIES)


def test_kstep_help_and_usage_name_every_family():
    from kstep.cli import DESCRIPTION
    usage = (ROOT / "docs" / "usage.md").read_text()
    listed = re.search(r"`--family` is one of ([^;]+);", usage).group(1)
    for family in FAMILIES:
        assert re.search(rf"\b{family}\b", DESCRIPTION), family
        assert f"`{family}`" in listed, family


@pytest.mark.parametrize("family", list(try_commands()))
def test_try_each_family_runs_as_documented(family, tmp_path, capsys):
    write, generate = try_commands()[family]
    assert main(in_tmp(write, tmp_path)) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / f"tiny-{family}")
    assert main(in_tmp(generate, tmp_path)) == 0
    out, err = capsys.readouterr()
    stats = err.strip().splitlines()[-1]
    tokens = re.match(r"-- (\d+) tokens", stats)
    assert tokens and int(tokens.group(1)) > 0 and out.strip(), (out, err)
    assert stats.startswith(documented_prints()[family]), (stats, documented_prints()[family])


def test_generation_config_entries_become_the_checkpoint_defaults(tmp_path, capsys):
    l21 = tmp_path / "l21"
    assert main(["random-checkpoint", "--family", "llada2_moe", "--out", str(l21),
                 "--generation-config", "editing_threshold=0.9", "max_post_steps=4"]) == 0
    assert json.loads((l21 / "generation_config.json").read_text()) == {"editing_threshold": 0.9, "max_post_steps": 4}
    params = kstep.load(l21).resolve(kstep.GenerationParams(max_tokens=32))
    assert (params.editing_threshold, params.max_post_steps) == (0.9, 4)
    plain = write_random_checkpoint(tmp_path / "plain", family="llada2_moe")  # no entries: no file
    assert not (plain / "generation_config.json").exists() and kstep.load(plain).checkpoint_defaults == {}
    # models.md's "(49 without editing)": the same weights (seed 0), one generate each
    nfe = [kstep.load(p).generate("def add(a, b):", max_tokens=32)[0].nfe for p in (l21, plain)]
    assert nfe == [56, 49] and "nfe=56` (49 without editing)" in try_section()
    gemma = tmp_path / "gemma"  # the family's own generation_config.json, updated by the entries
    assert main(["random-checkpoint", "--family", "diffusion_gemma", "--out", str(gemma),
                 "--generation-config", "max_denoising_steps=8", "t_max=0.9"]) == 0
    gen = json.loads((gemma / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 4] and gen["return_dict_in_generate"] is True
    resolved = kstep.load(gemma).resolve(kstep.GenerationParams())
    assert (resolved.max_denoising_steps, resolved.t_max, resolved.t_min) == (8, 0.9, 0.4)


@pytest.mark.parametrize("args,message", [
    (["--family", "llada", "--n-kv-heads", "3"], "kstep: error: n_heads (4) must be a multiple of n_kv_heads (3)"),
    (["--family", "diffusion_gemma", "--n-kv-heads", "3"], "must be a multiple of"),
    (["--family", "diffusion_gemma", "--top-k", "9"], "kstep: error: top_k (9) exceeds num_experts (8)"),
    (["--family", "diffusion_gemma", "--n-group", "2"], "kstep: error: --n-group: a diffusion_gemma checkpoint"),
    (["--family", "llama", "--num-experts", "4"], "kstep: error: --num-experts: a llama checkpoint has no such size"),
    (["--family", "sdar", "--d-model", "0"], "kstep: error: --d-model 0: sizes must be positive"),
    (["--family", "llama", "--head-dim", "7"], "kstep: error: head_dim 7 is odd"),
    (["--family", "qwen2", "--d-model", "60"], "kstep: error: head_dim 15 is odd"),
])
def test_bad_sizes_are_one_line_errors(args, message, tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["random-checkpoint", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("args,message", [
    (["--family", "nope"], "argument --family: invalid choice: 'nope'"),
    (["--family", "llada", "--shape", "nope"], "argument --shape: invalid choice: 'nope'"),
    (["--family", "llada2_moe", "--generation-config", "editing_threshold"], "'editing_threshold' is not KEY=VALUE"),
])
def test_bad_flag_values_are_a_usage_line_and_the_error(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["random-checkpoint", "--out", str(tmp_path / "ck"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 2 and err[0].startswith("usage: kstep random-checkpoint")
    assert message in err[1], err


# ------------------------------------------------------------------ DiffusionGemma against transformers


@pytest.fixture(scope="module")
def written_gemma(tmp_path_factory):
    """kstep's own DiffusionGemma checkpoint (the tiny default), kstep's model and transformers' of it."""
    transformers = pytest.importorskip("transformers")
    path = write_random_checkpoint(tmp_path_factory.mktemp("gemma"), family="diffusion_gemma", seed=3)
    hf, info = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(path, output_loading_info=True)
    return path, kstep.load(path), hf.eval(), info


def test_transformers_loads_every_text_weight_kstep_writes(written_gemma):
    path, llm, hf, info = written_gemma
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert info["missing_keys"] and all(".vision_tower." in k or ".embed_vision." in k for k in info["missing_keys"])
    text = hf.config.text_config
    assert text.layer_types == ["sliding_attention", "full_attention"] and text.sliding_window == 16
    attns = [layer.self_attn for layer in hf.model.decoder.layers]
    assert [a.head_dim for a in attns] == [16, 32] and attns[1].v_proj is None  # full layer: keys as values
    assert hf.config.canvas_length == llm.cfg.canvas_length == 16
    assert llm.cfg.layer_head_dims == (16, 32) and llm.cfg.layer_kv_heads == (2, 1)
    assert llm.cfg == random_config("diffusion_gemma", llm.cfg.vocab_size)  # config.json read back as written
    tied = hf.model.encoder.language_model.layers[1].self_attn.q_proj.weight  # the encoder's: tied to the decoder's
    assert torch.equal(tied, hf.model.decoder.layers[1].self_attn.q_proj.weight)
    assert torch.equal(hf.model.decoder.embed_tokens.weight, llm.model.embed.weight)


def test_transformers_logits_equal_kstep_on_the_written_checkpoint(written_gemma):
    from gemma_reference import hf_forward
    from test_diffusion_gemma import kstep_forward
    _, llm, hf, _ = written_gemma
    g = torch.Generator().manual_seed(0)
    V = llm.cfg.vocab_size
    prompt = torch.randint(5, V, (2, 20), generator=g)  # 20 > the window of 16
    canvas, sc_logits = torch.randint(0, V, (2, 16), generator=g), torch.randn(2, 16, V, generator=g) * 4
    for sc in (None, sc_logits):
        want, _ = hf_forward(hf, prompt, canvas, sc)
        assert want.abs().max() > 5  # random weights at std 0.2-0.5: peaky, so a wrong weight shows
        assert (want - kstep_forward(llm, prompt, [canvas], sc)).abs().max() < 5e-5  # observed ~8e-6


def test_transformers_top1_generate_equals_kstep_on_the_written_checkpoint(written_gemma):
    from gemma_reference import hf_generate
    from test_diffusion_gemma import hf_tokens, kstep_run
    _, llm, hf, _ = written_gemma
    prompts = torch.randint(5, llm.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    sequences, _, hf_steps = hf_generate(hf, prompts, 1, 32, top1=True)
    got, decoder = kstep_run(llm, prompts, max_tokens=32, temperature=0.0, seed=1)
    assert got == hf_tokens(sequences, 32) and decoder.steps_per_canvas == hf_steps
