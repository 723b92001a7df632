"""Do two models in one `kstep serve` slow each other down more than sharing the CPU must?

Per-model output tokens/s under the same load (C streaming clients per model, greedy, N tokens):
each model alone in its own server; both in one server (`--model A --model B`); both in two servers
side by side (what sharing the CPU costs anyway). Every engine runs one torch thread. The load
generator is asyncio + httpx (no torch). Usage:
  .venv/bin/python scripts/two_models_one_process.py [--models default,default-ar] [--duration 30]
"""
import argparse
import asyncio
import json
import sys
from contextlib import ExitStack
from pathlib import Path

from kstep.eval.prompts import held_out_code_prompts
from kstep.bench.serve import run_load, summarize
from kstep.bench.server_process import running_server


def load(targets: list[tuple[str, str]], prompts, args) -> dict:
    """Load every (url, model) at once; output tokens/s per model."""
    async def both():
        return await asyncio.gather(*(run_load(url, model, prompts, args.concurrency, args.duration,
                                               {"max_tokens": args.max_tokens}) for url, model in targets))
    return {model: round(summarize(*result)["output_tokens_per_s"], 1)
            for (_, model), result in zip(targets, asyncio.run(both()))}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="default,default-ar")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    a, b = args.models.split(",")
    prompts = held_out_code_prompts(16)
    common = ["--threads", "1", "--max-batch-size", "16", "--log-level", "warning"]
    rows = {}
    for model in (a, b):
        with running_server(model, *common) as (url, _):
            rows[f"{model} alone"] = load([(url, model)], prompts, args)
    with running_server(a, "--model", b, *common) as (url, _):
        rows["one server, both"] = load([(url, a), (url, b)], prompts, args)
    with ExitStack() as stack:
        url_a, _ = stack.enter_context(running_server(a, *common))
        url_b, _ = stack.enter_context(running_server(b, *common))
        rows["two servers, both"] = load([(url_a, a), (url_b, b)], prompts, args)
    print("| setting | " + " | ".join(f"{m} tokens/s" for m in (a, b)) + " |\n|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(str(r.get(m, "-")) for m in (a, b)) + " |")
    for m in (a, b):
        print(f"{m}: one server / alone {rows['one server, both'][m] / rows[f'{m} alone'][m]:.2f}x, "
              f"one server / two servers {rows['one server, both'][m] / rows['two servers, both'][m]:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
