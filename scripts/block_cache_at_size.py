"""Fast-dLLM v2's block cache at a real shape: one generation with `cache=none` (whole-block passes)
and one with `cache=dual` (its use_block_cache), after a warm-up each, batch 1.

    kstep random-checkpoint --family fast_dllm_v2 --shape qwen2.5-1.5b --dtype bfloat16 --out runs/v2-1.5b
    .venv/bin/python scripts/block_cache_at_size.py runs/v2-1.5b float32 64 [OUT.json]
"""
import json
import sys
import time

import torch

import kstep

path, dtype, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(2)
llm = kstep.load(path, dtype=dtype)
prompt = list(range(100, 148))
knobs = dict(block_length=32, sub_block_length=8, threshold=0.9)
rows = []
for cache in ("none", "dual"):
    llm.generate(prompt, max_tokens=8, cache=cache, **knobs)  # warm-up
    start = time.perf_counter()
    out = llm.generate(prompt, max_tokens=n, cache=cache, **knobs)[0]
    seconds = time.perf_counter() - start
    rows.append({"dtype": dtype, "cache": cache, "n": n, "seconds": seconds, "nfe": out.nfe,
                 "tokens": len(out.token_ids), "ms_per_pass": seconds / out.nfe * 1e3})
    print(rows[-1], flush=True)
print(f"{dtype}: the block cache {rows[0]['seconds'] / rows[1]['seconds']:.2f}x")
if len(sys.argv) > 4:
    with open(sys.argv[4], "w") as f:
        json.dump(rows, f, indent=1)
