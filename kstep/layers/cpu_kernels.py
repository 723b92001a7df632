"""kstep's own CPU kernels (cpu_kernels.c) for a decode step's few rows, where a pass is bound by
reading the weights: matrix-vector products over float32, bfloat16 and int8 weights, the RMSNorm
(with the residual add before it), and the int8 quantization done at load time.

Why not torch's: on this project's 2-core AVX2 EPYC, torch's GEMV paths (MKL's `mv`, `F.linear`,
oneDNN, oneDNN on packed weights) read float32 weights at 11-14 GB/s, against 20-24 GB/s for a
`sum` over the same bytes; these read them at 18-22 GB/s, about 90% of that `sum` in the same run.
torch has no fast bf16 GEMV on an AVX2 CPU (oneDNN's needs AVX-512 BF16) and no fast int8 one
(`_weight_int8pack_mm` wants bf16 instructions; without them an int8 layer dequantized its weight
per call). A norm costs torch two or three dispatches, each ~100 us right after a GEMV has streamed
the weights through the caches (a 0.5B model's 49 norms: 6 ms of a 115 ms step; 1 ms in C).
llama.cpp's kernels are built the same way (AVX2 dot products, rows split over the threads); `kstep
bench llamacpp` measures the two engines against each other.

The C file is compiled once per source version with the system's C compiler into a cache directory
(`KSTEP_KERNEL_CACHE`, default ~/.cache/kstep/kernels) and loaded with ctypes, which drops the GIL
around each call. It links the OpenMP runtime torch runs on (libgomp.so.1, already loaded by torch),
so the two share one thread pool. Where there is no compiler, no AVX2/FMA, or KSTEP_CPU_KERNELS=0,
`available()` is False and kstep runs torch's kernels as before, quietly. Where a build was tried and
failed (a compiler without OpenMP, CC naming no program), the same, after one notice on stderr per
process saying what failed and how to fix it; the failure is remembered in the cache directory, so
later processes print the notice without compiling again.
"""
import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# The kernels, and the decode step's block built on them (cpu_decode.py); one library.
SOURCES = (Path(__file__).with_name("cpu_kernels.c"), Path(__file__).with_name("cpu_decode.c"))
HEADER = Path(__file__).with_name("cpu_kernels.h")  # what the two share
# Up to this many rows a call reads each weight row once and runs every x row against it while it is
# in cache (a 0.5B model's projections at 4 rows: 1.3x the time of 1 row). More rows (a prefill, a
# diffusion block) go to oneDNN/MKL's blocked matrix-matrix kernels.
MAX_ROWS = 4
# Weights below this many elements stay on torch's kernels: a small model's weights sit in cache,
# where MKL's `x @ W` is already fast, and its tests' reference tokens were pinned with it.
MIN_WEIGHT = 500_000

# no contraction of a * b + c into one FMA where the C is written as two operations: the scalar code
# then rounds as torch's separate ops do (the intrinsics' FMAs stay FMAs)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
COMPILE_SECONDS = 120
STDERR_LINES = 8  # of a failed compile's stderr, in the notice

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
# The exports' (argument types, result type), as cpu_kernels.h declares them (tests/test_cpu_interface.py
# checks the two agree, and that the header declares every function the C files export).
EXPORTS = {
    "kstep_gemv_f32": ([_P, _L, _P, _P, _P, _L, _L, _I], None),
    "kstep_gemv_bf16": ([_P, _L, _P, _P, _P, _L, _L, _I], None),
    "kstep_gemv_i8": ([_P, _L, _P, _P, _P, _P, _L, _L, _I], None),
    "kstep_rms_norm_f32": ([_P, _P, _P, _P, _P, _L, _L, _F], None),
    "kstep_rms_norm_bf16": ([_P, _P, _P, _P, _P, _L, _L, _F], None),
    "kstep_quantize_i8": ([_P, _L, _L, _P, _P, _I], None),
    "kstep_decode_layer": ([_P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _I], None),
    "kstep_decode_layout": ([_P, _L], _L),
}

_lib = None
_tried = False  # one attempt per process: a failed build is reported once, never retried here


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _cache_dir() -> Path:
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
    return _cache_dir() / f"kstep_cpu_kernels_{tag}_{key}.failed"


def _notice(what: str, fix: str) -> None:
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
    command = [*compiler, *FLAGS, *map(str, SOURCES), "-o", tmp]
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


def _build() -> Path | None:
    """The built library's path, building it if this source was never built here; None where it cannot
    be: quietly where there is no compiler at all (the documented fallback), else after a notice."""
    compiler = _compiler()
    if compiler is None:
        return None
    source = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    tag = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kstep_cpu_kernels_{tag}.so"
    if target.exists():
        return target
    fix = "point CC at a C compiler with OpenMP and AVX2 support (e.g. install gcc)"
    # A failure is remembered in the cache: every kstep process (each server replica, each CLI run)
    # would otherwise pay for the same failing compile and print the same notice after it.
    marker = _failure_marker(tag, compiler)
    if marker.exists():
        _notice(f"{marker.read_text(errors='replace')} (an earlier run's, remembered)",
                f"{fix}, then delete {marker} to build again")
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        failed = _compile(compiler, target)
    except OSError as e:  # the cache directory cannot be written
        _notice(f"cannot build into {target.parent}: {e}", "set KSTEP_KERNEL_CACHE to a writable directory")
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
    _notice(what, f"{fix}, then delete {marker} to build again" if remember else fix)
    return None


def _load():
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("KSTEP_CPU_KERNELS", "1") == "0" or not _cpu_has_avx2_fma():
        return None  # quiet: off by request, or nothing to fix on this CPU
    path = _build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in EXPORTS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    except (OSError, AttributeError) as e:  # a cached file that is not this library (CC=true, a truncated copy)
        path.unlink(missing_ok=True)  # so the next process builds it again
        _notice(f"{path} did not load: {e}", "check that CC is a working C compiler")
        return None
    _lib = lib
    return lib


def library():
    """The loaded kernels' library (ctypes), or None where they are not built (see `available`)."""
    return _load()


def available() -> bool:
    """Whether the kernels are built and loaded here (builds them on first use)."""
    return _load() is not None


_DTYPES = (torch.float32, torch.bfloat16)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` runs x (..., in) @ weight (out, in).T: a float32 or bf16 weight of MIN_WEIGHT
    elements or more, contiguous (out, in), on the CPU, in inference, at most MAX_ROWS rows of x."""
    return (weight.dtype in _DTYPES and x.dtype == weight.dtype and weight.device.type == "cpu"
            and not weight.is_mkldnn and weight.numel() >= MIN_WEIGHT and weight.is_contiguous()
            and x.numel() <= MAX_ROWS * weight.shape[1] and not torch.is_grad_enabled() and available())


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T (+ bias), float32 or bf16 (as `takes` says); float32 sums."""
    out_f, in_f = weight.shape
    flat = x.reshape(-1, in_f).contiguous()
    y = torch.empty(flat.shape[0], out_f, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    lib = _load()
    fn = lib.kstep_gemv_f32 if x.dtype == torch.float32 else lib.kstep_gemv_bf16
    fn(flat.data_ptr(), flat.shape[0], weight.data_ptr(), _ptr(bias), y.data_ptr(), out_f, in_f,
       torch.get_num_threads())
    return y.view(*x.shape[:-1], out_f)


def takes_int8(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether `gemv_int8` runs x against these (out, in) int8 codes."""
    return (codes.device.type == "cpu" and x.dtype in _DTYPES and x.numel() <= MAX_ROWS * codes.shape[1]
            and codes.is_contiguous() and available())


def gemv_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ (codes (out, in) * scales (out,)[:, None]).T (+ bias), in x's dtype: x rounded to
    int16 per block of 256 (relative error < 2e-5 of the block's largest value), float32 sums."""
    out_f, in_f = codes.shape
    flat = x.reshape(-1, in_f).float().contiguous()
    y = torch.empty(flat.shape[0], out_f)
    scales = scales.float().contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    _load().kstep_gemv_i8(flat.data_ptr(), flat.shape[0], codes.data_ptr(), scales.data_ptr(), _ptr(bias),
                       y.data_ptr(), out_f, in_f, torch.get_num_threads())
    return y.to(x.dtype).view(*x.shape[:-1], out_f)


# Norms of rows at least this wide run in C (`rms_norm`): the widths of models whose weights take the
# GEMV; a small model's norms stay on torch's kernel, with which its tests' reference tokens were pinned.
NORM_MIN_DIM = 512


def takes_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` normalizes x (..., dim): float32 or bf16 (its weight too), at most MAX_ROWS
    rows of NORM_MIN_DIM or more, on the CPU, in inference."""
    return (x.dtype in _DTYPES and weight.dtype == x.dtype and x.device.type == "cpu"
            and x.shape[-1] >= NORM_MIN_DIM and x.numel() <= MAX_ROWS * x.shape[-1] and not torch.is_grad_enabled()
            and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta) * weight), or (x, rms_norm(x) * weight) without delta; float32
    or bf16 (as `takes_norm` says), the same sums and roundings as kstep's torch path (RMSNorm) up to
    the order of the sums."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if delta is not None:
        delta = delta.reshape(x.shape).contiguous()
        total = torch.empty_like(x)
    else:
        total = x
    lib = _load()
    fn = lib.kstep_rms_norm_f32 if x.dtype == torch.float32 else lib.kstep_rms_norm_bf16
    fn(x.data_ptr(), _ptr(delta), total.data_ptr() if delta is not None else None, weight.contiguous().data_ptr(),
       y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return total, y


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes (out, in) int8, scales (out,) float32) of a float32 CPU weight, one scale per row, as
    Int8Linear's torch expression computes them (bit for bit); None where the kernels are not built."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not available():
        return None
    w = weight.contiguous()
    codes = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0])
    _load().kstep_quantize_i8(w.data_ptr(), w.shape[0], w.shape[1], codes.data_ptr(), scales.data_ptr(),
                              torch.get_num_threads())
    return codes, scales
