"""One cell of `kstep bench decode`, in its own process (clean peak memory, no shared state):
load, warm up, generate once, print one JSON line."""
import json
import sys
import time

import torch

import kstep
from kstep.bench.memory import PeakMemory


def run_cell(spec: dict) -> dict:
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    llm = kstep.load(spec["model"], device=spec["device"], dtype=spec["dtype"])
    settings = dict(spec["settings"])
    llm.generate(spec["prompt_ids"][:8], **spec["warmup"])  # warm-up: first-call costs
    with PeakMemory(llm.device) as peak:
        start = time.perf_counter()
        [result] = llm.generate(spec["prompt_ids"], **settings)
        seconds = time.perf_counter() - start
    model_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    policy = llm.resolve(kstep.GenerationParams(**settings)).policy if llm.is_diffusion else None
    return {"threshold": policy.value if policy is not None and policy.kind == "threshold" else None,
            "seconds": seconds, "nfe": result.nfe, "peak_bytes": peak.bytes, "model_bytes": model_bytes,
            "timings": result.timings,
            "completion_tokens": result.completion_tokens, "finish_reason": result.finish_reason,
            "token_ids": result.token_ids}


if __name__ == "__main__":
    print(json.dumps(run_cell(json.loads(sys.argv[1]))))
