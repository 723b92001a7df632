"""Peak memory of one generation: CUDA's allocator statistics, or on the CPU the process's peak RSS
(VmHWM) after resetting it, minus the resident size before the generation."""
import ctypes
import ctypes.util
import re
import time
from pathlib import Path

import torch


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1)) if match else 0


def _release_free_heap() -> None:
    """Hand memory freed earlier (load-time copies, the warm-up) back to the OS (glibc's
    malloc_trim), so the generation's own allocations show in the RSS instead of silently reusing
    it. A no-op where the C library has no malloc_trim."""
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)


class PeakMemory:
    """`with PeakMemory(device) as peak: ...` then `peak.bytes`: extra memory the block needed at its peak."""

    def __init__(self, device: torch.device):
        self.device, self.bytes = device, 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            _release_free_heap()
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            self.base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.bytes = max(0, _status_kib("VmHWM") * 1024 - self.base)


def load_footprint(model: str, device: str, dtype: str) -> dict:
    """What loading a checkpoint costs in memory: the weights as held, and the process's peak
    resident size during the load over its size before it (on the CPU: VmHWM; on CUDA, the
    allocator's peak). Run in a fresh process (`kstep bench load`) so nothing else is resident."""
    from kstep.layers.quantized import model_bytes
    from kstep.llm import load
    from kstep.gguf.view import gguf_source
    device_ = torch.device(device)
    with PeakMemory(device_) as peak:
        start = time.perf_counter()
        llm = load(model, device=device, dtype=dtype)
        seconds = time.perf_counter() - start
    weights = model_bytes(llm.model)
    source = gguf_source(Path(llm.path))
    files = [source] if source is not None else list(Path(llm.path).glob("*.safetensors"))
    return {"model": str(model), "dtype": dtype, "device": device, "params": llm.cfg.num_params,
            "weights_bytes": weights, "checkpoint_bytes": sum(f.stat().st_size for f in files),
            "peak_bytes": peak.bytes, "peak_over_weights": peak.bytes / weights, "load_s": seconds}
