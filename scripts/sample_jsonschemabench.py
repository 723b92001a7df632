"""Write kstep's sample of JSONSchemaBench (guidance-ai/jsonschemabench, arXiv 2501.10868) for
`kstep bench structured`: from a git checkout of that repository, per dataset the same seeded
choice of schemas of at most MAX_BYTES, each with its path and the commit it was read at.

    python scripts/sample_jsonschemabench.py CHECKOUT_OR_GIT_DIR [--per-dataset 12]

The sample (kstep/bench/data/jsonschemabench_sample.json) is committed; this script says how it was made."""
import argparse
import json
import random
import subprocess
from pathlib import Path

DATASETS = ("Glaiveai2K", "Github_trivial", "Github_easy", "Github_medium", "Github_hard", "Github_ultra",
            "Kubernetes", "Snowplow", "JsonSchemaStore", "WashingtonPost")
MAX_BYTES = 8192
SEED = 40
OUT = Path(__file__).resolve().parents[1] / "kstep" / "bench" / "data" / "jsonschemabench_sample.json"


def git(repo: str, *args: str) -> str:
    """A git command's output in `repo` (a checkout or a bare git directory)."""
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("repo")
    ap.add_argument("--per-dataset", type=int, default=12)
    args = ap.parse_args()
    commit = git(args.repo, "rev-parse", "HEAD").strip()
    schemas, short = [], {}
    for dataset in DATASETS:
        paths = sorted(git(args.repo, "ls-tree", "--name-only", "HEAD", f"data/{dataset}/").split())
        rng, chosen = random.Random(f"{SEED}-{dataset}"), []
        for path in rng.sample(paths, len(paths)):
            text = git(args.repo, "show", f"HEAD:{path}")
            if len(text.encode()) <= MAX_BYTES:
                chosen.append({"dataset": dataset, "path": path, "schema": json.loads(text)})
            if len(chosen) == args.per_dataset:
                break
        schemas += sorted(chosen, key=lambda s: s["path"])
        if len(chosen) < args.per_dataset:  # (Github_ultra: its smallest schema is 11.9 KB)
            short[dataset] = f"{len(chosen)} of {len(paths)} schemas are at most {MAX_BYTES} bytes"
    OUT.write_text(json.dumps({"source": "https://github.com/guidance-ai/jsonschemabench", "commit": commit,
                               "paper": "arXiv 2501.10868", "seed": SEED, "max_bytes": MAX_BYTES,
                               "per_dataset": args.per_dataset, "short": short, "schemas": schemas}, indent=1) + "\n")
    print(f"{len(schemas)} schemas -> {OUT}")


if __name__ == "__main__":
    main()
