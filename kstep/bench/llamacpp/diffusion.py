"""`kstep bench llamacpp --kind diffusion`: kstep's masked-diffusion sampler against llama.cpp's
`llama-diffusion-cli` on the same LLaDA, Dream or LLaDA-MoE weights (converted by llama.cpp's converter), the
same prompt text, the same generated length N and the same number of passes S, on the same cores,
one engine at a time, their runs interleaved.

Like for like: llama.cpp's timestep schedule (`--diffusion-eps`: the whole canvas one block, S
passes, no KV cache, every pass over prompt + N) against kstep with one block of N, S fixed steps
and `cache="none"` (every pass over prompt + N too). Beside it, kstep's dual cache at the same S,
and kstep's default (dual cache + threshold 0.9, which decides its own passes). llama.cpp reports
its own time (the passes and their sampling, without loading); kstep's is the generate call. Their
tokens are not compared: llama.cpp's CLI has no greedy low-confidence order (at temperature 0 its
confidence algorithm still draws positions)."""
import re
import statistics
import subprocess
import time
from pathlib import Path

TIME_LINE = re.compile(r"total time: ([0-9.]+)ms, time per step: ([0-9.]+)ms")


def run_cli(paths: dict[str, Path], gguf: Path, prompt: str, canvas: int, steps: int, threads: int) -> float:
    """Seconds llama-diffusion-cli reports for its passes (a canvas of `canvas` tokens, prompt included)."""
    done = subprocess.run([str(paths["bin"] / "llama-diffusion-cli"), "-m", str(gguf), "-p", prompt,
                           "-ub", str(canvas), "-b", str(canvas), "-c", str(canvas), "-t", str(threads),
                           "--diffusion-steps", str(steps), "--diffusion-eps", "0.001", "--temp", "0",
                           "--diffusion-algorithm", "4"], capture_output=True, text=True, errors="replace")
    found = TIME_LINE.search(done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"llama-diffusion-cli failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return float(found.group(1)) / 1000


def compare_diffusion(checkpoint: Path, prompt: str, prompt_tokens: int, max_tokens: int, steps: int, threads: int,
                      repeats: int, paths: dict[str, Path], work: Path) -> list[dict]:
    """Rows: llama.cpp, kstep without a cache, with the dual cache (both S fixed steps), kstep's default."""
    import torch

    from kstep.bench.llamacpp.ar import convert
    from kstep.llm import load
    torch.set_num_threads(threads)
    gguf = convert(paths, checkpoint, "float32", work)
    llm = load(checkpoint)
    prompt = llm.tokenizer.decode(llm.encode_prompt(prompt)[:prompt_tokens])  # about prompt_tokens in either tokenizer
    prompt_len = len(llm.encode_prompt(prompt))
    canvas = prompt_len + 1 + max_tokens  # llama.cpp adds a BOS token to LLaDA's prompt
    sides = {"kstep, no cache": dict(steps=steps, block_length=max_tokens, cache="none"),
             "kstep, dual cache": dict(steps=steps, block_length=max_tokens, cache="dual"),
             "kstep default (dual + threshold 0.9)": {}}
    llm.generate(prompt, max_tokens=8, steps=8, block_length=8, cache="none")  # warm-up
    times: dict[str, list[float]] = {name: [] for name in ["llama.cpp", *sides]}
    passes: dict[str, int] = {"llama.cpp": steps}
    for _ in range(repeats):
        times["llama.cpp"].append(run_cli(paths, gguf, prompt, canvas, steps, threads))
        for name, settings in sides.items():
            start = time.perf_counter()
            [out] = llm.generate(prompt, max_tokens=max_tokens, ignore_eos=True, **settings)
            times[name].append(time.perf_counter() - start)
            passes[name] = out.nfe
    base = statistics.median(times["llama.cpp"])
    rows = []
    for name, runs in times.items():
        seconds = statistics.median(runs)
        rows.append({"checkpoint": checkpoint.name, "side": name, "prompt_tokens": prompt_len, "max_tokens": max_tokens,
                     "passes": passes[name], "seconds": seconds, "seconds_per_pass": seconds / passes[name],
                     "time_vs_llamacpp": seconds / base, "threads": threads, "repeats": repeats})
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| checkpoint | side | prompt | N | passes | seconds | ms per pass | time vs llama.cpp |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|")
    return "\n".join([head] + [
        f"| {r['checkpoint']} | {r['side']} | {r['prompt_tokens']} | {r['max_tokens']} | {r['passes']} | "
        f"{r['seconds']:.1f} | {r['seconds_per_pass'] * 1000:.0f} | **{r['time_vs_llamacpp']:.2f}x** |" for r in rows])
