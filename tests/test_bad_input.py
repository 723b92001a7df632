"""Bad input: one line naming the bad value and the rule, exit code 2, no traceback."""
import json
import subprocess
import sys

import pytest
from conftest import copy_checkpoint
from safetensors.torch import load_file, save_file

import kstep


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kstep", *args], capture_output=True, text=True, timeout=120)


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 or lines[0].startswith("usage:"), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.mark.parametrize("args,needles", [
    (["--max-tokens", "30", "--block-length", "8"], ["max_tokens (30)", "block_length (8)"]),
    (["--max-tokens", "32", "--block-length", "8", "--steps", "6"], ["steps (6)", "4 blocks"]),
    (["--prompt-ids", "1,2,99999"], ["99999", "vocabulary"]),
    (["--prompt-ids", "1,2,MASK"], ["mask token id"]),
    (["--prompt-ids", ""], ["empty"]),
    (["--remasking", "best"], ["remasking", "best"]),
    (["--dtype", "int3"], ["dtype", "int3"]),
    (["--max-tokens", "0"], ["max_tokens"]),
    (["--exact", "--threshold", "0.5"], ["threshold", "exact"]),
])
def test_cli_rejects_bad_generation_input(llada_path, args, needles):
    mask_id = json.loads((llada_path / "config.json").read_text())["mask_token_id"]
    args = [a.replace("MASK", str(mask_id)) for a in args]
    if "--prompt-ids" not in args:
        args += ["--prompt-ids", "5,6,7"]
    assert_clean_error(run_cli("generate", "--model", str(llada_path), *args), *needles)


def test_cli_rejects_missing_path(tmp_path):
    assert_clean_error(run_cli("generate", "x", "--model", str(tmp_path / "nope")), "nope", "does not exist")


def test_cli_json_output(llada_path):
    proc = run_cli("generate", "def f():", "--prompt-ids", "5,6", "--model", str(llada_path),
                   "--max-tokens", "16", "--steps", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 2
    assert rows[0]["text"] is not None and rows[0]["nfe"] == 8 and rows[0]["seconds"] > 0
    assert {"token_ids", "finish_reason", "nfe", "seconds"} <= rows[1].keys()


def test_unknown_architecture(tmp_path, llada_path):
    bad = copy_checkpoint(llada_path, tmp_path / "arch", architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        kstep.load(bad)
    assert_clean_error(run_cli("generate", "x", "--model", str(bad)), "unknown architecture")


def test_missing_and_misshaped_tensors(tmp_path, llada_path):
    tensors = load_file(str(llada_path / "model.safetensors"))
    missing = copy_checkpoint(llada_path, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if k != "model.transformer.blocks.1.up_proj.weight"},
              str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model.transformer.blocks.1.up_proj.weight' "
                                         r"\(expected shape \[128, 64\]\)"):
        kstep.load(missing)
    shaped = copy_checkpoint(llada_path, tmp_path / "shaped")
    tensors["model.transformer.blocks.0.q_proj.weight"] = tensors["model.transformer.blocks.0.q_proj.weight"][:, :32].contiguous()
    save_file(tensors, str(shaped / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.transformer.blocks.0.q_proj.weight' has shape \[64, 32\], "
                                         r"expected \[64, 64\]"):
        kstep.load(shaped)
    assert_clean_error(run_cli("generate", "x", "--model", str(shaped)), str(shaped), "q_proj")


def test_api_errors_are_value_errors(llada_path):
    llm = kstep.load(llada_path)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="context"):
        llm.generate([5, 6], max_tokens=2048, block_length=32)


@pytest.mark.parametrize("field", ["cfg_scale", "threshold", "factor", "temperature", "top_p"])
def test_params_refuse_non_finite_numbers(field):
    """NaN compares false with every bound, so only an explicit check stops it before a decoding step."""
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            kstep.GenerationParams(**{field: value})
