"""`kstep bench moe|load|passes` run end to end at tiny sizes (the real ones run only as benchmarks):
their tables and JSON carry every column the docs read, the ratios are against a baseline from the
same run, and bad arguments are refused naming them."""
import json

import pytest
from test_bad_input import run_cli

from kstep.bench.passes import BLOCKS
from kstep.random_checkpoint import write_random_checkpoint


def test_bench_passes_measures_every_kind_against_the_ar_step_of_the_same_run(tmp_path):
    out = tmp_path / "passes"
    proc = run_cli("bench", "passes", "--shapes", "llama:bundled-3m,llada2_moe:bundled-3m", "--dtypes", "float32",
                   "--repeats", "1", "--context", "64", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "bench_passes.json").read_text())["rows"]
    for family in ("llama", "llada2_moe"):
        mine = [r for r in rows if r["family"] == family]
        assert [r["kind"] for r in mine] == ["ar"] + ["block"] * len(BLOCKS) + ["window"] * len(BLOCKS)
        ar = mine[0]
        assert ar["over_ar"] == 1.0 and all(r["over_ar"] == pytest.approx(r["ms"] / ar["ms"]) for r in mine)
        assert all(0 < r["of_floor"] and r["floor_ms"] > 0 and r["planned_ms"] > 0 for r in mine)
    assert (out / "pass_over_step.png").stat().st_size > 0 and "to tie AR" in (out / "bench_passes.md").read_text()


def test_bench_moe_reads_the_union_of_experts_and_prints_floors(tmp_path):
    out = tmp_path / "moe"
    proc = run_cli("bench", "moe", "--shapes", "tiny:llada2_moe,tiny:llada_moe", "--dtypes", "float32",
                   "--tokens", "1,8", "--repeats", "1", "--gpus", "h100-sxm", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "bench_moe.json").read_text())
    one, eight = result["layers"][0], result["layers"][1]
    assert one["tokens"] == 1 and one["experts_read"] == one["top_k"]  # one token reads its k experts
    assert one["experts_read"] <= eight["experts_read"] <= eight["num_experts"]
    mini = [r for r in result["floors"] if r["shape"] == "llada2-mini"]
    assert [r["tokens"] for r in mini] == [4, 8, 16, 32] and mini[-1]["pass_over_step"] > 5  # MoE: not free
    dense = [r for r in result["floors"] if r["experts_read"] is None]
    assert dense and all(r["pass_over_step"] < 1.1 for r in dense)


def test_bench_load_reports_the_peak_over_the_weights(tmp_path):
    path = write_random_checkpoint(tmp_path / "ck", family="llada_moe", shard_bytes=64 * 1024)
    proc = run_cli("bench", "load", "--model", str(path), "--out", str(tmp_path / "load.json"))
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "load.json").read_text())
    assert row["weights_bytes"] > 0 and row["peak_over_weights"] > 0 and "x the weights" in proc.stdout


@pytest.mark.parametrize("args,named", [
    (["passes", "--shapes", "llama:gpt-5"], "--shapes"),
    (["moe", "--shapes", "tiny:llama"], "--shapes"),
    (["moe", "--gpus", "tpu-v9"], "--gpus"),
])
def test_bad_arguments_are_refused_naming_them(args, named):
    proc = run_cli("bench", *args)
    assert proc.returncode == 2 and named in proc.stderr
