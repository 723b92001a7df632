"""`kstep bench llamacpp`: kstep's AR engine against llama.cpp on the same weights, the same prompt
ids and the same length, batch 1, greedy, on the same cores; one engine at a time, their runs
interleaved (kstep, llama.cpp, kstep, ...) so that a slow spell of the machine hits both alike.

The checkpoint is converted with llama.cpp's own converter (convert.py) once per weight type:
float32 against GGUF F32, bfloat16 against BF16, kstep's `quantize="int8"` against Q8_0 (both int8
weights with a scale per group or row; Q8_0's groups are of 32). kstep runs in this process,
llama.cpp in a worker process of its own without torch (worker.py), while this one waits. Reported per weight type: prompt processing and decode tokens/s of
each (medians over the repeats), their ratios (kstep / llama.cpp: above 1, kstep is faster), and
whether the generated ids are identical (greedy argmax, end tokens ignored); and the start-up of each,
the wall time of `kstep generate` and of llama.cpp's `llama-simple` making one token, whole
processes, interleaved."""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
# kstep weights -> the GGUF type set beside them; int4 has none the converter writes: GGUF files only
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": None}


def llamacpp_paths(root: Path) -> dict[str, Path]:
    paths = {"src": root / "src", "bin": root / "src" / "build" / "bin", "python": root / "python"}
    if not (paths["bin"] / "libllama.so").exists() or not (paths["python"] / "llama_cpp").is_dir():
        raise ValueError(f"--llamacpp {root}: no built llama.cpp there; run scripts/build_llamacpp.sh {root}")
    return paths


def convert(paths: dict[str, Path], checkpoint: Path, weights: str, work: Path) -> Path:
    """The checkpoint as a GGUF of the weight type beside kstep's `weights` (cached in `work`); a GGUF
    file's view (kstep/gguf): the file itself, whatever `weights` says (both engines read the same file)."""
    from kstep.gguf.view import gguf_source
    if (source := gguf_source(checkpoint)) is not None:
        return source
    outtype = OUTTYPES[weights]
    if outtype is None:
        raise ValueError(f"--weights {weights} runs on a GGUF file (--model FILE.gguf): llama.cpp's converter "
                         f"writes no 4-bit type, and {checkpoint} is a checkpoint")
    out = work / f"{checkpoint.name}.{outtype}.gguf"
    if not out.exists():
        work.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, str(HERE / "convert.py"), str(paths["src"]), str(checkpoint),
                               "--outfile", str(out), "--outtype", outtype], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp's converter failed on {checkpoint} ({outtype}):\n{done.stderr[-2000:]}")
    return out


def run_llamacpp(paths: dict[str, Path], gguf: Path, prompt: list[int], max_tokens: int, threads: int,
                 repeats: int = 1) -> dict:
    env = {**os.environ, "PYTHONPATH": str(paths["python"]), "LLAMA_CPP_LIB_PATH": str(paths["bin"])}
    job = {"gguf": str(gguf), "prompt": prompt, "max_tokens": max_tokens, "threads": threads, "repeats": repeats}
    done = subprocess.run([sys.executable, str(HERE / "worker.py"), json.dumps(job)], capture_output=True,
                          text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the llama.cpp worker failed:\n{done.stdout[-1000:]}{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def kstep_runner(checkpoint: Path, weights: str):
    """One greedy generation of exactly max_tokens (end tokens ignored, as llama.cpp's side)."""
    from kstep.llm import load
    llm = load(checkpoint, dtype="bfloat16" if weights == "bfloat16" else "float32",
               quantize=weights if weights in ("int8", "int4") else "none")  # "none": a quantized GGUF file's floats

    def run(prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        start = time.perf_counter()
        [out] = llm.generate([prompt], max_tokens=max_tokens, ignore_eos=True)
        total = time.perf_counter() - start
        prompt_seconds = out.timings["prefill_pass_seconds"]
        return out.token_ids, prompt_seconds, total - prompt_seconds
    return run


def startup_seconds(command: list[str], env: dict | None = None) -> float:
    """Wall time of one whole command: process start, import, load, one token, exit."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def startup_commands(paths: dict[str, Path], checkpoint: Path, gguf: Path, weights: str,
                     prompt: list[int]) -> tuple[list[str], list[str]]:
    """`kstep generate` and `llama-simple` making one token from the prompt, each from a cold process
    (the files in the page cache: each command has run before)."""
    kstep = [sys.executable, "-m", "kstep", "generate", "--model", str(checkpoint), "--max-tokens", "1",
             "--prompt-ids", ",".join(map(str, prompt[:8]))]  # both on their default threads (the cores)
    if weights == "bfloat16":
        kstep += ["--dtype", "bfloat16"]
    kstep += ["--quantize", weights if weights in ("int8", "int4") else "none"]
    return kstep, [str(paths["bin"] / "llama-simple"), "-m", str(gguf), "-n", "1", "def f(x):"]


def compare(checkpoint: Path, weights: str, prompt: list[int], max_tokens: int, threads: int, repeats: int,
            paths: dict[str, Path], work: Path) -> dict:
    """One row: both engines on `weights`, `repeats` interleaved rounds after a warm-up each."""
    import torch
    torch.set_num_threads(threads)
    gguf = convert(paths, checkpoint, weights, work)
    kstep = kstep_runner(checkpoint, weights)
    kstep(prompt, 8)  # warm-up
    ours: list[tuple] = []
    theirs: dict[str, list] = {"prompt_seconds": [], "decode_seconds": []}
    for _ in range(repeats):
        ours.append(kstep(prompt, max_tokens))
        run = run_llamacpp(paths, gguf, prompt, max_tokens, threads)  # its own warm-up, then one timed run
        theirs["prompt_seconds"] += run["prompt_seconds"]
        theirs["decode_seconds"] += run["decode_seconds"]
        theirs["ids"] = run["ids"]
    del kstep
    ours_cmd, theirs_cmd = startup_commands(paths, checkpoint, gguf, weights, prompt)
    startup_seconds(ours_cmd), startup_seconds(theirs_cmd)  # the files into the page cache
    starts = {"kstep": [], "llamacpp": []}
    for _ in range(repeats):
        starts["kstep"].append(startup_seconds(ours_cmd))
        starts["llamacpp"].append(startup_seconds(theirs_cmd))
    k_start, l_start = statistics.median(starts["kstep"]), statistics.median(starts["llamacpp"])
    P, steps = len(prompt), max_tokens - 1
    k_pp = P / statistics.median(r[1] for r in ours)
    k_tg = steps / statistics.median(r[2] for r in ours)
    l_pp = P / statistics.median(theirs["prompt_seconds"])
    l_tg = steps / statistics.median(theirs["decode_seconds"])
    # each round's decode speed too: on a shared machine the bandwidth moves between minutes, so a
    # row is read as the range of its interleaved rounds' ratios, not as one median
    k_rounds, l_rounds = [steps / r[2] for r in ours], [steps / s for s in theirs["decode_seconds"]]
    same = next((i for i, (a, b) in enumerate(zip(ours[-1][0], theirs["ids"])) if a != b), None)
    from kstep.gguf.reader import GGUFFile
    from kstep.gguf.view import gguf_source
    return {"checkpoint": str(gguf_source(checkpoint) or checkpoint), "weights": weights,
            "gguf_type": "+".join(GGUFFile(gguf).matrix_types()).lower(), "threads": threads,
            "prompt_tokens": P, "max_tokens": max_tokens, "repeats": repeats,
            "kstep_prompt_tps": k_pp, "llamacpp_prompt_tps": l_pp, "prompt_ratio": k_pp / l_pp,
            "kstep_decode_tps": k_tg, "llamacpp_decode_tps": l_tg, "decode_ratio": k_tg / l_tg,
            "kstep_decode_tps_rounds": k_rounds, "llamacpp_decode_tps_rounds": l_rounds,
            "kstep_startup_s": k_start, "llamacpp_startup_s": l_start, "startup_ratio": k_start / l_start,
            "identical": same is None, "first_difference": same,
            "kstep_ids": ours[-1][0], "llamacpp_ids": theirs["ids"]}


def format_row(r: dict) -> str:
    same = "yes" if r["identical"] else f"from token {r['first_difference']}"
    rounds = [k / l for k, l in zip(r.get("kstep_decode_tps_rounds", []), r.get("llamacpp_decode_tps_rounds", []))]
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if rounds else ""
    return (f"| {Path(r['checkpoint']).name} | {r['weights']} / {r['gguf_type'].upper()} | {r['prompt_tokens']} | "
            f"{r['max_tokens']} | {r['kstep_prompt_tps']:.1f} | {r['llamacpp_prompt_tps']:.1f} | "
            f"**{r['prompt_ratio']:.2f}x** | {r['kstep_decode_tps']:.2f} | {r['llamacpp_decode_tps']:.2f} | "
            f"**{r['decode_ratio']:.2f}x**{spread} | {r['kstep_startup_s']:.2f} / {r['llamacpp_startup_s']:.2f} | {same} |")


def format_table(rows: list[dict]) -> str:
    head = ("| checkpoint | kstep / llama.cpp weights | prompt | N | kstep prompt tok/s | llama.cpp prompt tok/s | "
            "ratio | kstep decode tok/s | llama.cpp decode tok/s | ratio (rounds) | start-up s, kstep / llama.cpp | same ids |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    return "\n".join([head] + [format_row(r) for r in rows])

