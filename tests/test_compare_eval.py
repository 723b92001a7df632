"""`kstep bench compare`'s cost model and `kstep eval`'s metrics, on configs and completions whose
answers are worked out by hand; then both commands end to end on tiny checkpoints."""
import json
import subprocess
import sys

import pytest

from kstep.bench.compare import interpolate_crossover, run_compare
from kstep.bench.cost_model import (
    Device,
    ar_cost,
    block_diffusion_cost,
    body_params,
    diffusion_cost,
    pass_cost,
)
from kstep.eval.execution import humaneval_program, passes_tests
from kstep.eval.metrics import edit_distance, function_part, normalized_edit_distance
from kstep.eval.run import block_settings, default_settings, run_eval
from kstep.models import ModelConfig

CFG = ModelConfig(family="llama", attention="causal", vocab_size=500, embedding_size=500, d_model=64, n_layers=2,
                  n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, norm_eps=1e-5, rope_theta=1e4,
                  max_positions=1024)


def test_cost_model_arithmetic_on_a_known_config():
    # per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288; MLP 3 x 64 x 128 = 24576; 2 norms 128
    assert body_params(CFG) == 2 * (12288 + 24576 + 128) + 64  # 74048
    one = pass_cost(CFG, tokens=1, attended=10, logit_rows=1)
    # FLOPs: 2 x 74048 (body) + 4 x 10 x 64 x 2 (attention: QK and AV over 10 keys, 2 layers) + 2 x 64 x 500 (head)
    assert one.flops == 148096 + 5120 + 64000
    assert one.attention_flops == 5120 and one.head_flops == 64000
    # bytes: weights (74048 + 32000) x 4 + KV (10 read + 1 written) x (2 x 2 x 16 x 2 layers) x 4
    #        + activations (6 x 64 + 3 x 128) x 2 layers x 4 + logits 500 x 4
    assert one.bytes == 106048 * 4 + 11 * 128 * 4 + 768 * 2 * 4 + 2000
    device = Device("toy", bandwidth_gb_s=1.0, matmul_tflops=1e-6, source="given")  # 1 GB/s, 1 MFLOP/s
    assert one.floor_seconds(device) == max(one.bytes / 1e9, one.flops / 1e6)
    # AR: a prefill of 4 tokens, then 2 single-token passes attending to 5 and 6 positions
    ar = ar_cost(CFG, prompt_len=4, n=3)
    expected = pass_cost(CFG, 4, 4, 1) + pass_cost(CFG, 1, 5, 1) + pass_cost(CFG, 1, 6, 1)
    assert (ar.flops, ar.bytes) == (expected.flops, expected.bytes)
    # diffusion, N = 64 in 2 blocks of 32, K = 10: exact = 10 full passes; dual = 2 full + 8 block windows
    full = pass_cost(CFG, 68, 68, 32)
    assert diffusion_cost(CFG, 4, 64, 10, 32, "none").flops == 10 * full.flops
    dual = diffusion_cost(CFG, 4, 64, 10, 32, "dual")
    assert dual.flops == 2 * full.flops + 8 * pass_cost(CFG, 32, 68, 32).flops
    # block diffusion, N = 64 in blocks of 8, K = 10: a prefill, then block passes against the exact
    # cache (on average the prompt, half the completion and the block itself), never a full pass
    block = block_diffusion_cost(CFG, 4, 64, 10, 8)
    assert block.flops == pass_cost(CFG, 4, 4, 1).flops + 10 * pass_cost(CFG, 8, 4 + 36, 8).flops
    assert block.flops < 10 * pass_cost(CFG, 8, 68, 8).flops


def test_crossover_interpolation():
    assert interpolate_crossover([16, 64, 256], [2.0, 1.5, 0.5]) == pytest.approx(64 * 4 ** (0.405465 / 1.098612),
                                                                                 rel=1e-4)
    assert interpolate_crossover([16, 64], [0.5, 0.4]) == 16
    assert interpolate_crossover([16, 64], [2.0, 1.1]) is None


def test_eval_metrics_on_hand_made_completions():
    prompt = 'def f(x):\n    """Double x."""\n'
    assert function_part(prompt, "    return 2 * x\n\ndef g():\n    pass\n") == "    return 2 * x\n\n"
    assert function_part(prompt, "    return 2 * x") == "    return 2 * x"
    assert function_part(prompt, "print(1)\n") == ""
    method = '    def push(self, x):\n        """Push."""\n'
    assert function_part(method, "        self.items.append(x)\n    def pop(self):\n") == "        self.items.append(x)\n"
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("a", "a") == 0
    assert normalized_edit_distance("kitten", "sitting") == pytest.approx(3 / 7)


def test_generated_code_runs_sandboxed_in_a_subprocess():
    prompt, test = "def add(a, b):\n", "def check(f):\n    assert f(2, 3) == 5\n"
    assert passes_tests(humaneval_program(prompt, "    return a + b\n", test, "add"))
    assert not passes_tests(humaneval_program(prompt, "    return a - b\n", test, "add"))
    assert not passes_tests(humaneval_program(prompt, "    while True: pass\n", test, "add"), timeout=2)
    network = "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return a + b\n"
    assert not passes_tests(humaneval_program(prompt, network, test, "add"))


def test_default_settings_sweep_k_and_threshold():
    names = [s.name for s in default_settings(64, 32)]
    assert names == ["diffusion K=8", "diffusion K=16", "diffusion K=32", "diffusion K=64",
                     "diffusion K=64 + draft self", "diffusion dual threshold=0.5", "diffusion dual threshold=0.7", "diffusion dual threshold=0.9",
                     "ar"]


def test_block_settings_sweep_thresholds_and_block_lengths():
    settings = block_settings([0.9], [4, 16], include_ar=False)
    assert [s.name for s in settings] == ["block exact block=4", "block threshold=0.9 block=4",
                                          "block exact block=16", "block threshold=0.9 block=16"]
    assert settings[1].settings == {"threshold": 0.9, "block_length": 4}
    assert [s.settings for s in block_settings([0.9])] == [{"exact": True}, {"threshold": 0.9}, {}]
    by_sub = block_settings([0.7, 0.9], include_ar=False, sub_block_lengths=[2, 8])
    assert [s.name for s in by_sub] == ["block exact", "block threshold=0.7 sub=2", "block threshold=0.9 sub=2",
                                        "block threshold=0.7 sub=8", "block threshold=0.9 sub=8"]
    assert by_sub[4].settings == {"threshold": 0.9, "sub_block_length": 8}
    assert len({s.family for s in by_sub[1:]}) == 2  # one curve per sub-block length


def test_compare_and_eval_run_end_to_end(llada_path, llama_path, tmp_path):
    given = Device("given", 10.0, 0.05, "given")
    result = run_compare(str(llada_path), str(llama_path), ["def f(x):", "import os"], [8, 16],
                         ["diffusion exact", "diffusion exact+self", "diffusion dual K=N/4", "ar"], 1, 8, "cpu",
                         "float32", tmp_path, given)
    assert (tmp_path / "compare.png").stat().st_size > 0
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert len(saved["rows"]) == 8 and all(r["seconds"] > 0 and r["floor_seconds"] > 0 for r in saved["rows"])
    exact, speculative = ([r for r in saved["rows"] if r["side"] == side] for side in ("diffusion exact",
                                                                                    "diffusion exact+self"))
    assert all(s["nfe"] <= e["nfe"] and s["canvases_per_pass"] >= 1 == e["canvases_per_pass"]
               for e, s in zip(exact, speculative))
    quarter = [r for r in saved["rows"] if r["side"] == "diffusion dual K=N/4"]
    assert [r["nfe"] for r in quarter] == [2, 4]  # K = N/4 passes
    assert [r["nfe"] for r in saved["rows"] if r["side"] == "ar"] == [8, 16]
    assert set(result["predictions"]) >= {"here", "h100-sxm", "h200"}
    rows = [{"prompt": "def add(a, b):\n", "body": "    return a + b\n"},
            {"prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(1, 2) == 3\n", "entry_point": "add",
             "task_id": "toy/0"}]
    evaluated = run_eval(str(llada_path), str(llama_path), str(llama_path), rows, 16, default_settings(16, 8),
                         2, tmp_path)
    assert (tmp_path / "quality_vs_nfe.png").stat().st_size > 0
    by_name = {r["setting"]: r for r in evaluated["results"]}
    assert by_name["diffusion K=2"]["mean_nfe"] == 2 and by_name["ar"]["prompts"] == 2
    exact, speculative = by_name["diffusion K=16"], by_name["diffusion K=16 + draft self"]  # the same tokens
    quality = ("parse_rate", "judge_nll", "distinct_ratio", "exact_match", "edit_distance", "pass_at_1", "samples")
    assert [exact[k] for k in quality] == [speculative[k] for k in quality]
    assert speculative["mean_nfe"] <= exact["mean_nfe"]
    assert all(r["pass_at_1"] is not None and r["edit_distance"] is not None for r in evaluated["results"])


@pytest.mark.parametrize("args,needle", [
    (["bench", "compare", "--sides", "diffusion fastest"], "--sides"),
    (["bench", "compare", "--lengths", "16,-4"], "--lengths"),
    (["eval", "--thresholds", "0.5,1.5"], "--thresholds"),
    (["eval", "--prompts", "/no/such/file.jsonl"], "--prompts"),
])
def test_bad_compare_and_eval_flags(args, needle):
    proc = subprocess.run([sys.executable, "-m", "kstep", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
