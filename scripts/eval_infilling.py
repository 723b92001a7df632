"""What the suffix buys: infill the middle of held-out function bodies with and without the text after
the gap. Each shipped held-out function (prompt = signature + docstring, body = the real body) with
at least 3 body lines is cut into thirds by lines: prompt + first third is the prefix, the last third
the suffix, the middle third the gap to fill. The gap gets N = the real middle's token count (an
oracle length) or 2N (a caller that over-estimates). Greedy, the model's default decoding.

Measured per setting: parse rate of prefix + infilled middle + suffix (a whole function), and the
normalised edit distance of the middle to the real one. Run alone (nothing else on the CPU):

    .venv/bin/python scripts/eval_infilling.py --model llada-coder --out docs/decoding/infilling.json
"""
import argparse
import ast
import json
from pathlib import Path

import torch

import kstep
from kstep.eval.prompts import prompt_rows
from kstep.eval.metrics import normalized_edit_distance


def is_python(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError):
        return False


def thirds(row: dict) -> tuple[str, str, str] | None:
    lines = row["body"].splitlines(keepends=True)
    if len(lines) < 3:
        return None
    a, b = len(lines) // 3, 2 * len(lines) // 3
    return row["prompt"] + "".join(lines[:a]), "".join(lines[a:b]), "".join(lines[b:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llada-coder")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = kstep.load(args.model)
    cases = [c for c in (thirds(r) for r in prompt_rows(None, None)) if c is not None]
    reference = sum(is_python(prefix + middle + suffix) for prefix, middle, suffix in cases) / len(cases)
    rows = [{"gap": "the real middle", "suffix": True, "functions": len(cases), "parse_rate": round(reference, 3),
             "edit_distance": 0.0, "mean_passes": 0}]
    for scale in (1, 2):
        for with_suffix in (True, False):
            parsed, distance, passes = 0, 0.0, 0
            for prefix, middle, suffix in cases:
                n = scale * len(llm.tokenizer.encode(middle, add_special_tokens=False))
                out = llm.generate(prefix, max_tokens=n, suffix=suffix if with_suffix else None)[0]
                parsed += is_python(prefix + out.text + suffix)
                distance += normalized_edit_distance(out.text.strip(), middle.strip())
                passes += out.nfe
            rows.append({"gap": f"{scale}N", "suffix": with_suffix, "functions": len(cases),
                         "parse_rate": round(parsed / len(cases), 3), "edit_distance": round(distance / len(cases), 3),
                         "mean_passes": round(passes / len(cases), 1)})
            print(json.dumps(rows[-1]), flush=True)
    print("| gap | with suffix | functions | parse rate (whole function) | edit distance of the middle | passes |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['gap']} | {'yes' if r['suffix'] else 'no (prefix only)'} | {r['functions']} | {r['parse_rate']:.2f} | "
              f"{r['edit_distance']:.2f} | {r['mean_passes']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
