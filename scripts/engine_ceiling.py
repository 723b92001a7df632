"""The serving engine's batching ceiling without HTTP: tokens/s with up to B requests kept in flight
(staggered, as under continuous load) against one at a time, stepping the engine directly on one
thread. `kstep bench serve` measures the same through a real server; this tells how much of its ratio
the engine itself allows. Usage: .venv/bin/python scripts/engine_ceiling.py [--model default] [--steps 300]"""
import argparse
import time

import torch

import kstep
from kstep.eval.prompts import held_out_code_prompts
from kstep.engine.engine import Engine, warm_up
from kstep.engine.request import Request
from kstep.params import GenerationParams


def tokens_per_second(llm, prompts: list[str], batch: int, max_tokens: int, steps: int, warm_steps: int = 40) -> float:
    engine = Engine(llm, max_batch_size=batch)
    sent = 0

    def send(n: int) -> None:
        nonlocal sent
        params = GenerationParams(max_tokens=n, temperature=0)
        engine.add_request(Request([llm.encode_prompt(prompts[sent % len(prompts)])], params))
        sent += 1
    for i in range(batch):  # staggered lengths first, so requests finish (and join) at different steps
        send(max_tokens if batch == 1 else max(1, max_tokens * (i + 1) // batch))
    committed, start = 0, None
    for step in range(warm_steps + steps):
        if step == warm_steps:
            committed, start = 0, time.perf_counter()
        outputs, stats = engine.step()
        for out in outputs:
            if out.is_finished:
                send(max_tokens)
        committed += stats.num_committed if stats else 0
    return committed / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300, help="timed steps of the batched engine")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = kstep.load(args.model)
    warm_up(llm)
    prompts = held_out_code_prompts()[:32]
    batched = tokens_per_second(llm, prompts, args.batch, args.max_tokens, args.steps)
    alone = tokens_per_second(llm, prompts, 1, args.max_tokens, args.steps * 5)
    print(f"{args.model}: batch {args.batch} {batched:.1f} tok/s, batch 1 {alone:.1f} tok/s, "
          f"ratio {batched / alone:.2f}x")


if __name__ == "__main__":
    main()
