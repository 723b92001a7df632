"""Building the CPU kernels (kstep/layers/cpu_kernels.py `_build`): a build that cannot compile says
so once per process on stderr (the command, its stderr, the fix, KSTEP_CPU_KERNELS=0), is tried once
per process and remembered in the kernel cache for the next, and kstep runs torch's kernels: `kstep
generate` with CC=false gives the tokens of a KSTEP_CPU_KERNELS=0 run. KSTEP_CPU_KERNELS=0, no
compiler and a CPU without AVX2/FMA stay quiet."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from kstep.layers import cpu_build, cpu_kernels
from kstep.random_checkpoint import write_random_checkpoint

NOTICE = "kstep: its CPU kernels are off"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not tried to load the kernels yet, with an empty kernel cache; compiler runs
    counted."""
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setenv("KSTEP_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KSTEP_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_has_avx2_fma", lambda: True)
    runs = []
    real_run = subprocess.run
    monkeypatch.setattr(cpu_build.subprocess, "run", lambda command, **kw: runs.append(command) or
                        real_run(command, **kw))
    return runs


def test_a_failed_build_says_so_once_and_is_remembered(fresh, monkeypatch, capsys):
    monkeypatch.setenv("CC", "false")
    assert not cpu_kernels.available() and not cpu_kernels.available() and cpu_kernels.library() is None
    err = capsys.readouterr().err
    assert err.count(NOTICE) == 1 and len(fresh) == 1, err  # one attempt, one notice
    assert "`false -O3 -mavx2" in err and "exited with status 1" in err and "KSTEP_CPU_KERNELS=0" in err
    assert "point CC at a C compiler" in err
    [marker] = (cpu_build.cache_dir()).glob("*.failed")
    assert f"delete {marker} to build again" in err
    monkeypatch.setattr(cpu_kernels, "_tried", False)  # the next process: the notice, no compile
    assert not cpu_kernels.available()
    err = capsys.readouterr().err
    assert err.count(NOTICE) == 1 and "remembered" in err and "`false -O3" in err and len(fresh) == 1, err
    if shutil.which("gcc") is None:
        return
    monkeypatch.setenv("CC", "gcc -fno-such-option")  # another compiler command: tried, its stderr shown
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    assert not cpu_kernels.available()
    err = capsys.readouterr().err
    assert len(fresh) == 2 and "-fno-such-option" in err.split("its stderr:")[1], err


def test_a_compiler_that_is_not_there_says_so(fresh, monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert not cpu_kernels.available()
    err = capsys.readouterr().err
    assert err.count(NOTICE) == 1 and "did not run" in err and "no-such-compiler-here" in err, err


@pytest.mark.parametrize("why", ["KSTEP_CPU_KERNELS=0", "no compiler", "no AVX2/FMA"])
def test_kernels_off_for_these_reasons_stay_quiet(why, fresh, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("CC", "false")  # would fail loudly, were it run
    if why == "KSTEP_CPU_KERNELS=0":
        monkeypatch.setenv("KSTEP_CPU_KERNELS", "0")
    elif why == "no compiler":
        monkeypatch.delenv("CC")
        monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    else:
        monkeypatch.setattr(cpu_kernels, "cpu_has_avx2_fma", lambda: False)
    assert not cpu_kernels.available()
    assert capsys.readouterr().err == "" and fresh == []


def test_a_library_that_does_not_load_says_so_and_is_dropped(fresh, monkeypatch, capsys):
    monkeypatch.setenv("CC", "true")  # "succeeds", writing nothing: an empty .so
    assert not cpu_kernels.available()
    err = capsys.readouterr().err
    assert err.count(NOTICE) == 1 and "did not load" in err, err
    assert not list(cpu_build.cache_dir().glob("*.so"))  # the next process builds again


def generate(checkpoint, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kstep", "generate", "--model", str(checkpoint), "--prompt-ids",
                           "1,2,3", "--max-tokens", "6", "--ignore-eos", "--temperature", "0", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)


def test_kstep_generate_with_a_compiler_that_fails_runs_torchs_kernels(tmp_path):
    # d_model 768, ffn 1024: each layer's gate/up and down take the kernels where they are built
    checkpoint = write_random_checkpoint(tmp_path / "qwen2", family="qwen2", seed=2, d_model=768, n_layers=1,
                                         n_heads=12, n_kv_heads=2, ffn_dim=1024)
    assert 768 * 1024 >= cpu_kernels.MIN_WEIGHT
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "KSTEP_CPU_KERNELS")}
    env["KSTEP_KERNEL_CACHE"] = str(tmp_path / "cache")
    failing = generate(checkpoint, {**env, "CC": "false"})
    assert failing.returncode == 0, failing.stderr
    assert failing.stderr.count(NOTICE) == 1 and "`false " in failing.stderr, failing.stderr
    off = generate(checkpoint, {**env, "KSTEP_CPU_KERNELS": "0"})
    assert off.returncode == 0 and NOTICE not in off.stderr, off.stderr
    tokens = [json.loads(line)["token_ids"] for line in (failing.stdout, off.stdout)]
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]
