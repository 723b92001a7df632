"""`kstep bench sampler`: DiffusionGemma's per-pass sampler at a large vocabulary, its time and the
process's peak memory, here and in a baseline tree (a worktree of an earlier commit), one process at
a time, the same run. The sampler is the decoder's per-pass work on a pass's logits
(`UniformDiffusionDecoder._denoise`: filters, temperature, the draw, argmax, entropy, the
self-conditioning signal), timed around that method, which both trees have; the model is a random
DiffusionGemma of the given vocabulary and canvas (hidden 64, 2 layers: its forward is small beside
the sampler's work over canvas x vocabulary)."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kstep.flags import add_command

# Run in a fresh interpreter with the measured tree first on sys.path: it may predate this module.
MEASURE = '''
import json, resource, statistics, sys, time
import kstep
from kstep.decoding import uniform_diffusion
path, rows, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
times, denoise = [], uniform_diffusion.UniformDiffusionDecoder._denoise
def timed(self, logits):
    start = time.perf_counter()
    denoise(self, logits)
    times.append(time.perf_counter() - start)
uniform_diffusion.UniformDiffusionDecoder._denoise = timed
llm = kstep.load(path)
out = llm.generate(["def add(a, b):"] * rows, max_tokens=llm.cfg.canvas_length, temperature=1.0, seed=0,
                   max_denoising_steps=passes, confidence_threshold=0.0)
print(json.dumps({"tree": str(__import__("pathlib").Path(kstep.__file__).parents[1]), "rows": rows,
                  "passes": len(times), "sampler_s_median": statistics.median(times),
                  "sampler_s": [round(t, 3) for t in times],
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "token_ids": [r.token_ids for r in out]}))
'''


def write_checkpoint(out: Path, vocab: int, canvas: int) -> Path:
    from kstep.random_checkpoint import write_random_checkpoint
    path = write_random_checkpoint(out, family="diffusion_gemma", vocab_size=vocab, d_model=64, n_layers=2, n_heads=2,
                                   n_kv_heads=1, ffn_dim=128, seed=1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "canvas_length": canvas}))
    return path


def measure(tree: Path, checkpoint: Path, rows: int, passes: int, script: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run([sys.executable, str(script), str(checkpoint), str(rows), str(passes)], cwd=tree, env=env,
                         capture_output=True, text=True, check=False)
    if run.returncode:
        raise RuntimeError(f"the measurement in {tree} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def add_sampler(kinds) -> None:
    sampler = add_command(kinds, "sampler", "DiffusionGemma's per-pass sampler at a large vocabulary, against a "
                                            "baseline tree")
    sampler.add_argument("--vocab", type=int, default=262_144)
    sampler.add_argument("--canvas", type=int, default=256)
    sampler.add_argument("--rows", type=int, default=1, help="requests in one batch")
    sampler.add_argument("--passes", type=int, default=4, help="decoder passes (max_denoising_steps)")
    sampler.add_argument("--baseline", type=Path, default=None,
                         help="a tree of an earlier commit (git worktree add DIR REV), measured first")
    sampler.set_defaults(run=_main)


def _main(args) -> int:
    here = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, script = write_checkpoint(Path(tmp) / "gemma", args.vocab, args.canvas), Path(tmp) / "measure.py"
        script.write_text(MEASURE)
        results = [measure(tree, checkpoint, args.rows, args.passes, script)
                   for tree in ([args.baseline.resolve()] if args.baseline else []) + [here]]
    for result in results:
        print(json.dumps({k: v for k, v in result.items() if k != "token_ids"}), flush=True)
    if len(results) == 2:
        before, after = results
        print(json.dumps({"speedup": before["sampler_s_median"] / after["sampler_s_median"],
                          "same_tokens": before["token_ids"] == after["token_ids"]}))
    return 0
