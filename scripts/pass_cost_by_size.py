"""What one forward pass costs at other model sizes, on this CPU: an AR decode step of the bundled
AR twin's architecture against a block-diffusion pass (blocks of 8) of the bundled coder's, both
with random weights at each width (4 layers, 4 heads, vocabulary 4,096, FFN 8/3 of the width).

Their ratio is the tokens per pass a block model needs to tie with its AR twin per generated token;
twice it, to be 2x faster. It decides whether another size could reach issue 14's speed targets
without training both twins at that size first. Run it alone (nothing else on the CPU):

    .venv/bin/python scripts/pass_cost_by_size.py --widths 128,192,256,320,512 --threads 1
"""
import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kstep
from kstep.bundled import resolve_model

PROMPT = 'def is_palindrome(s):\n    """Return True if s reads the same backwards."""'


def resized_checkpoint(bundled: str, width: int, out: Path) -> Path:
    """The bundled checkpoint's layout at another width, random weights (std 0.02, norms 1)."""
    src = resolve_model(bundled)
    shutil.copytree(src, out)
    config = json.loads((src / "config.json").read_text())
    old_width, old_ffn = config["hidden_size"], config["intermediate_size"]
    ffn = (width * 8 // 3 + 7) // 8 * 8
    config.update(hidden_size=width, intermediate_size=ffn)
    if "head_dim" in config:
        config["head_dim"] = width // config["num_attention_heads"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    resize = {old_width: width, old_ffn: ffn}
    tensors = {}
    with safe_open(src / "model.safetensors", "pt") as f:
        for name in f.keys():
            shape = [resize.get(d, d) for d in f.get_slice(name).get_shape()]
            norm = name.endswith("norm.weight")
            tensors[name] = torch.ones(shape) if norm else torch.randn(shape) * 0.02
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return out


def ms_per_pass(llm, n: int, repeats: int, **knobs) -> tuple[float, int]:
    llm.generate(PROMPT, max_tokens=16, **knobs)  # warm-up
    best, nfe = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        [out] = llm.generate(PROMPT, max_tokens=n, min_tokens=n, **knobs)
        best, nfe = min(best, time.perf_counter() - start), out.nfe
    return 1000 * best / nfe, nfe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="128,192,256,320,512")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| width | params | weights (bf16) MiB | AR ms/step | block ms/pass | block / AR |")
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for width in (int(w) for w in args.widths.split(",")):
            ar = kstep.load(resized_checkpoint("default-ar", width, Path(tmp) / f"ar{width}"))
            block = kstep.load(resized_checkpoint("default", width, Path(tmp) / f"block{width}"))
            ar_ms, _ = ms_per_pass(ar, args.tokens, args.repeats)
            block_ms, _ = ms_per_pass(block, args.tokens, args.repeats, exact=True)
            params = ar.cfg.num_params
            print(f"| {width} | {params / 1e6:.1f}M | {2 * params / 2**20:.1f} | {ar_ms:.2f} | {block_ms:.2f} | "
                  f"{block_ms / ar_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
