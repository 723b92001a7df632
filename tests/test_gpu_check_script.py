"""scripts/gpu_check.sh, the one prepared run for a lent GPU machine: its steps fit one command's
600 s, what it leaves fits what that machine sends back (at most 8 files, no more than 2 folders
down, names of letters, digits, '.', '_', '-'), and a kill keeps every finished step. Its skeleton
runs here with --dry (each step's command replaced by a line), a real step or two with --cpu."""
import os
import re
import signal
import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
NAME = re.compile(r"[A-Za-z0-9._-]+")


def steps() -> list[tuple[str, int]]:
    """The script's STEPS line: (name, seconds) in the order they run."""
    [line] = [line for line in SCRIPT.read_text().splitlines() if line.startswith("STEPS=")]
    return [(name, int(seconds)) for name, seconds in
            (entry.split(":") for entry in line.partition("=")[2].strip('"').split())]


def run(out: Path, tmp_path: Path, *flags: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPT), *flags, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp_path), **env})


def check_returnable(out: Path) -> None:
    """What the device tool brings back of its output folder: all of it, or the run's figures are lost."""
    entries = list(out.rglob("*"))
    assert len([p for p in entries if p.is_file()]) <= 8
    for path in entries:
        parts = path.relative_to(out).parts
        assert len(parts) <= 3 and all(NAME.fullmatch(part) for part in parts), path  # out/a/b/file at most


def archived(out: Path) -> list[str]:
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        return [Path(name).name for name in tar.getnames()]


def test_the_step_limits_fit_one_device_command():
    text = SCRIPT.read_text()
    limits = dict(steps())
    assert sum(limits.values()) <= 540  # of the device tool's 600 s per command
    budget = re.search(r"^BUDGET=\$\{KSTEP_GPU_CHECK_SECONDS:-(\d+)\}$", text, re.M)
    assert budget and int(budget.group(1)) <= 540  # the whole run stops starting steps there
    assert {"smoke_cuda", "bench_passes", "bench_compare", "bench_decode", "tests_cpu", "bench_serve",
            "tp_cuda", "bench_tp"} <= set(limits)
    assert all(f"step_{name}() {{" in text for name in limits)


def test_a_dry_run_leaves_every_step_in_one_archive_and_a_summary(tmp_path):
    out = tmp_path / "out"
    proc = run(out, tmp_path, "--dry")
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    check_returnable(out)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]
    names = [name for name, _ in steps()]
    assert set(archived(out)) >= {f"{name}.log" for name in names} | {"summary.txt"}
    summary = (out / "summary.txt").read_text()
    assert all(f"   {name}: ok" in summary for name in names) and "done in" in summary


def test_a_kill_keeps_the_finished_steps(tmp_path):
    out = tmp_path / "out"
    proc = run(out, tmp_path, "--dry", KSTEP_GPU_CHECK_DRY_SECONDS="1")
    deadline = time.monotonic() + 15
    try:
        # the archive is renamed into place whole: whenever it is there, it is a complete one
        while not ((out / "gpu_check.tar.gz").exists() and len(archived(out)) >= 4):  # gpu_check/, summary, 2 logs
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.3)  # inside the third step's second
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # as the device tool ends a command past its limit
    proc.wait(timeout=10)
    check_returnable(out)
    logs = [name for name in archived(out) if name.endswith(".log")]
    names = [name for name, _ in steps()]
    assert logs and set(logs) < {f"{name}.log" for name in names}
    summary = (out / "summary.txt").read_text()
    assert all(f"   {name.removesuffix('.log')}: ok" in summary for name in logs) and "done in" not in summary
    running = names[len(logs)]  # the step the kill interrupted: its log so far beside the archive
    assert (out / "running.log").read_text().startswith(f"dry run of {running}")


def test_a_cpu_rehearsal_runs_real_steps_without_the_web_packages(tmp_path):
    """--cpu: real steps here, with fastapi/uvicorn/pydantic missing as on the GPU host."""
    out = tmp_path / "out"
    proc = run(out, tmp_path, "--cpu", KSTEP_GPU_CHECK_STEPS="env,bench_serve")
    assert proc.wait(timeout=60) == 0, proc.stdout.read()
    check_returnable(out)
    summary = (out / "summary.txt").read_text()
    assert "   env: ok" in summary and "bench_serve: skipped: fastapi, uvicorn or pydantic not importable" in summary
    assert "smoke_cuda" not in summary  # only the steps asked for
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        env_log = tar.extractfile("gpu_check/env.log").read().decode()
    assert re.search(r"^python 3\.\d+.* torch \d", env_log, re.M) and "cuda available:" in env_log
