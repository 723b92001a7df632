"""`kstep bench decode` end to end on a tiny checkpoint: one measured and one extrapolated cell per mode."""
import json

from kstep.bench.decode import format_table, run_bench


def test_bench_decode_measures_each_mode_against_exact(tmp_path, llada_path):
    rows = run_bench([str(llada_path)], [32], 16, ["exact", "exact+self", "dual", "dual+threshold"], "cpu",
                     "float32", tmp_path, max_cell_seconds=0.0, extrapolate=True, threads=1, include_large=False)
    by_mode = {r["mode"]: r for r in rows}
    assert not by_mode["exact+self"]["extrapolated"] and by_mode["exact+self"]["nfe"] <= 32  # drafts: run in full
    assert by_mode["exact+self"]["positions_computed"] > 0
    assert by_mode["exact"]["extrapolated"] and by_mode["dual"]["extrapolated"]
    assert not by_mode["dual+threshold"]["extrapolated"]  # adaptive cells always run in full
    assert by_mode["exact"]["nfe"] == 32 and by_mode["exact"]["speedup_vs_exact"] == 1.0
    assert 1 <= by_mode["dual+threshold"]["nfe"] <= 32
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    saved = json.loads((tmp_path / "bench_decode.json").read_text())
    assert len(saved["rows"]) == 4
    assert "| dual |" in format_table(rows)


def test_judge_prefers_its_own_greedy_completion(llama_path):
    import torch

    import kstep
    from kstep.eval.metrics import judge_nll
    judge = kstep.load(llama_path)
    prompt = judge.encode_prompt("def f(x):")
    greedy = judge.generate(prompt, max_tokens=12, early_stop=False)[0].token_ids
    noise = torch.randint(5, judge.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    assert judge_nll(judge, prompt, greedy) < judge_nll(judge, prompt, noise)
    assert judge_nll(judge, prompt, []) is None


def test_bench_decode_runs_block_modes_on_a_block_model(tmp_path, v2_path):
    rows = run_bench([str(v2_path)], [24], 16, ["exact", "dual", "threshold", "threshold+commit-pass"], "cpu",
                     "float32", tmp_path, max_cell_seconds=60.0, extrapolate=True, threads=1, include_large=False)
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"exact", "threshold", "threshold+commit-pass"}  # dual is not a block-diffusion mode
    assert all(r["completion_tokens"] == 24 for r in rows)  # every mode produces N tokens
    blocks = 24 // 8 + 1  # bd_size 8; the prompt's tail shares the first block
    assert by_mode["exact"]["nfe"] >= 24  # one token per pass, plus prefill and commits
    assert by_mode["threshold"]["nfe"] <= by_mode["threshold+commit-pass"]["nfe"] <= by_mode["exact"]["nfe"]
    assert by_mode["threshold+commit-pass"]["nfe"] <= 24 + blocks
    assert by_mode["exact"]["speedup_vs_exact"] == 1.0
    # the threshold modes decode with the checkpoint's defaults (no generation_config here: 0.9)
    assert by_mode["threshold"]["threshold"] == by_mode["threshold+commit-pass"]["threshold"] == 0.9
    assert by_mode["exact"]["threshold"] is None
