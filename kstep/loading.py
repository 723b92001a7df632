"""A checkpoint's model runner: the model loaded on one device (quantized if asked), or split over a
tensor-parallel group of processes or Ray actors (kstep/distributed), whose rank 0 runner is returned."""
from pathlib import Path

import torch

from kstep.gguf.view import default_quantization
from kstep.layers.linear import pack_fused_weights
from kstep.runner.model_runner import ModelRunner
from kstep.weights import load_model

BACKENDS = ("mp", "ray")  # vLLM's names for its `distributed_executor_backend`


def load_runner(path: Path, device: torch.device, dtype: torch.dtype, quantize: str | None = None,
                tensor_parallel_size: int = 1, threads_per_rank: int = 1, backend: str = "mp") -> ModelRunner:
    """The runner of the checkpoint at `path` (`threads_per_rank`: each CPU rank's torch threads;
    `backend`: the other ranks as processes, "mp", or Ray actors, "ray"; one rank needs neither)."""
    if backend not in BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if tensor_parallel_size == 1:
        # a quantized GGUF file's nearest kstep type, unless asked otherwise ("none": its dequantized floats)
        quantize = None if quantize == "none" else quantize or default_quantization(path)
        model = load_model(path, device, dtype, quantize)  # quantized layer by layer as it loads
        pack_fused_weights(model)  # CPU: large projection weights in oneDNN's blocked layout
        return ModelRunner(model)
    if quantize not in (None, "none"):
        raise ValueError(f"quantize {quantize!r} with tensor_parallel_size {tensor_parallel_size}: weight-only "
                         "quantization runs on one device only")
    if device.type == "cpu":  # rank 0 too: N ranks, one core each
        torch.set_num_threads(threads_per_rank)
    if backend == "ray":
        from kstep.distributed.ray_ranks import load_on_ray  # Ray: an optional dependency, only when asked for
        return load_on_ray(path, device, dtype, tensor_parallel_size, threads_per_rank)[1]
    from kstep.distributed.launch import load_tensor_parallel  # torch.distributed, only when asked for
    return load_tensor_parallel(path, device, dtype, tensor_parallel_size, threads_per_rank)[1]
