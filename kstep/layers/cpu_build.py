"""Builds kstep's CPU kernels (cpu_kernels.c, cpu_decode.c, cpu_draw.c) with the system's C compiler, once per
source version, into a cache directory (`KSTEP_KERNEL_CACHE`, default ~/.cache/kstep/kernels);
cpu_kernels.py loads the result. Where there is no compiler the kernels are quietly off; where a
build is tried and fails, one notice on stderr per process says what failed and how to fix it, and
the failure is remembered in the cache directory, so later processes print the notice without
compiling again."""
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The kernels, the decode step's block built on them (cpu_decode.py) and the exact draw's stream; one library.
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_kernels.c", "cpu_decode.c", "cpu_draw.c"))
HEADER = Path(__file__).with_name("cpu_kernels.h")  # what the two share
# no contraction of a * b + c into one FMA where the C is written as two operations: the scalar code
# then rounds as torch's separate ops do (the intrinsics' FMAs stay FMAs)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
COMPILE_SECONDS = 120
STDERR_LINES = 8  # of a failed compile's stderr, in the notice


def cpu_has_avx2_fma() -> bool:
    """Whether this CPU runs the kernels' instructions (they are built with -mavx2 -mfma)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def cache_dir() -> Path:
    """Where built libraries (and remembered failures) are kept."""
    base = os.environ.get("KSTEP_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kstep", "kernels")
    return Path(base)


def _compiler() -> list[str] | None:
    """The compiler's command: $CC split as a shell would (`ccache gcc`), else cc or gcc on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            return shlex.split(cc)
        except ValueError:  # unbalanced quotes: run as one name, which fails with a notice
            return [cc]
    found = shutil.which("cc") or shutil.which("gcc")
    return None if found is None else [found]


def _failure_marker(tag: str, compiler: list[str]) -> Path:
    """Where a failed build of this source with this compiler is remembered. Keyed by the compiler's
    command and its binary's size and mtime, so another compiler, or this one reinstalled, tries again."""
    found = shutil.which(compiler[0])
    try:
        stat = os.stat(found) if found else None
    except OSError:
        stat = None
    ident = [*compiler, str(found), *([] if stat is None else [str(stat.st_size), str(stat.st_mtime_ns)])]
    key = hashlib.sha256("\0".join(ident).encode()).hexdigest()[:12]
    return cache_dir() / f"kstep_cpu_kernels_{tag}_{key}.failed"


def notice(what: str, fix: str) -> None:
    """The one line (plus the compiler's output) saying why this process runs torch's kernels."""
    sys.stderr.write(f"kstep: its CPU kernels are off and torch's run instead (a slower CPU decode step): {what}\n"
                     f"kstep: to fix it, {fix}; KSTEP_CPU_KERNELS=0 runs torch's kernels without this notice\n")
    sys.stderr.flush()


def _compile(compiler: list[str], target: Path) -> tuple[str, bool] | None:
    """Builds the library into `target`: None, or (what failed: the command and the first lines of its
    stderr, whether to remember it: not a timeout, which a less loaded machine may not hit)."""
    # built beside the target and renamed: processes starting together never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = [*compiler, *FLAGS, *map(str, SOURCES), "-lm", "-o", tmp]  # libm (log1p) after the sources
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=COMPILE_SECONDS)
        if done.returncode == 0:
            os.replace(tmp, target)
            return None
        lines = done.stderr.strip().splitlines()
        shown = "".join(f"\n    {line}" for line in lines[:STDERR_LINES]) or " (no output)"
        more = f"\n    ... ({len(lines) - STDERR_LINES} more lines)" if len(lines) > STDERR_LINES else ""
        return f"`{shlex.join(command)}` exited with status {done.returncode}; its stderr:{shown}{more}", True
    except OSError as e:  # no such program, not executable
        return f"`{shlex.join(command)}` did not run: {e}", True
    except subprocess.TimeoutExpired:
        return f"`{shlex.join(command)}` ran past {COMPILE_SECONDS} s", False
    finally:
        Path(tmp).unlink(missing_ok=True)


def build() -> Path | None:
    """The built library's path, building it if this source was never built here; None where it cannot
    be: quietly where there is no compiler at all (the documented fallback), else after a notice."""
    compiler = _compiler()
    if compiler is None:
        return None
    source = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    tag = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"kstep_cpu_kernels_{tag}.so"
    if target.exists():
        return target
    fix = "point CC at a C compiler with OpenMP and AVX2 support (e.g. install gcc)"
    # A failure is remembered in the cache: every kstep process (each server replica, each CLI run)
    # would otherwise pay for the same failing compile and print the same notice after it.
    marker = _failure_marker(tag, compiler)
    if marker.exists():
        notice(f"{marker.read_text(errors='replace')} (an earlier run's, remembered)",
                f"{fix}, then delete {marker} to build again")
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        failed = _compile(compiler, target)
    except OSError as e:  # the cache directory cannot be written
        notice(f"cannot build into {target.parent}: {e}", "set KSTEP_KERNEL_CACHE to a writable directory")
        return None
    if failed is None:
        return target
    what, remember = failed
    if remember:
        try:
            fd, tmp = tempfile.mkstemp(suffix=".failed", dir=marker.parent)
            with os.fdopen(fd, "w") as f:
                f.write(what)
            os.replace(tmp, marker)  # whole, for a process starting alongside
        except OSError:
            remember = False  # the next process tries again
    notice(what, f"{fix}, then delete {marker} to build again" if remember else fix)
    return None
