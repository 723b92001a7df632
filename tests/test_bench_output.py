"""What a benchmark command prints: `kstep bench compare` gives its table once, header first (it
used to print its rows bare as they came, then the whole table again)."""
from kstep.cli import main

HEADER = "| side | N | latency s | TTFT s | passes | tokens/pass | tokens/s | floor s | measured/floor |"


def test_bench_compare_prints_its_table_once_with_its_header(llada_path, llama_path, tmp_path, capsys):
    assert main(["bench", "compare", "--diffusion-model", str(llada_path), "--ar-model", str(llama_path),
                 "--lengths", "8", "--num-prompts", "1", "--sides", "diffusion exact,ar",
                 "--bandwidth-gbs", "10", "--matmul-tflops", "0.05", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    assert (printed.out + printed.err).count(HEADER) == 1
    rows = [line for line in lines if line.startswith("| diffusion exact |") or line.startswith("| ar |")]
    assert len(rows) == 2 and lines.index(HEADER) < lines.index(rows[0])
    assert not any(row in printed.err for row in rows)  # no row streamed beside the table
    assert lines[lines.index(HEADER) + 1].startswith("|---|")  # a markdown table: header, rule, rows
    assert all(row.count("|") == HEADER.count("|") for row in rows)


SPEED = "speed vs exact (exact's time / this time, this CPU)"


def test_self_spec_names_its_time_column_as_a_speed():
    from kstep.bench.self_spec import format_table
    row = {"model": "m", "cache": "none", "n": 16, "drafts": 2, "prompts": 1, "identical": 1, "exact_passes": 16,
           "passes": 12, "pass_ratio": 16 / 12, "positions_vs_exact": 1.5, "acceptance": 0.5, "broke_on_position": 1,
           "broke_on_token": 1, "speed_vs_exact": 0.25}  # exact took a quarter of this run's time
    head, _, line = format_table([row]).splitlines()
    assert head.split("|")[-2].strip() == SPEED and line.split("|")[-2].strip() == "0.25x"


def test_the_committed_self_spec_tables_show_the_json_speeds():
    import json
    from pathlib import Path
    docs = Path(__file__).resolve().parent.parent / "docs"
    for name in ("bench_self_spec", "bench_self_spec_dual"):
        rows = json.loads((docs / "benchmarks/self_spec" / f"{name}.json").read_text())["rows"]
        head, _, *lines = (docs / "benchmarks/self_spec" / f"{name}.md").read_text().splitlines()
        assert head.split("|")[-2].strip() == SPEED
        assert [line.split("|")[-2].strip() for line in lines] == [f"{r['speed_vs_exact']:.2f}x" for r in rows]
    benchmarks = (docs / "benchmarks.md").read_text()
    assert "time vs exact" not in benchmarks
    assert all(line in benchmarks for line in (docs / "benchmarks/self_spec/bench_self_spec.md").read_text().splitlines())
