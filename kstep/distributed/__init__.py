"""Tensor and expert parallel inference over torch.distributed: one process per rank, rank 0 runs
the engine; only the model runner knows there are ranks (kstep/distributed/runner.py)."""
