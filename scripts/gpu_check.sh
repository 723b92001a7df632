#!/usr/bin/env bash
# The day a GPU is lent (the device tool): one prepared run of what kstep has never measured on CUDA,
# inside one command's 10 minutes. The steps, in order, each bounded by its own limit (STEPS below):
#   env           nvidia-smi, python, torch, CUDA and the packages kstep imports (versions or "missing");
#   smoke_cuda    every family generates in bf16 on the GPU: its batch equals its rows alone, draft self
#                 equals exact (LinearSpec equals AR on Nemotron), the MoE grouped matmul equals the loop;
#   pool_cuda     the KV pool on the GPU: AR and block requests on a pool too small for all of them grow,
#                 are preempted and resume to their output alone; a batch larger than the pool is refused;
#   bench_passes  one pass at real shapes in bf16 against floors calibrated in the same run;
#   bench_compare diffusion vs AR (--quick) on the bundled models in bf16;
#   bench_decode  the block coder's exact, exact+self and threshold at N = 256, 1024 (a process per cell);
#   tests_cpu     a few CPU test files (that machine's Python 3.12, torch and transformers);
#   bench_serve   concurrent clients against kstep serve (skipped where fastapi/uvicorn/pydantic are
#                 missing, as on the lent H200: carry wheels to run it, the device tool's README says how);
#   tp_cuda       with 2+ GPUs: TP=2 on NCCL gives TP=1's tokens, per family;
#   bench_tp      with 2+ GPUs: bench tp (its ranks run on CPU cores: the command takes no --device).
# The machine returns at most 8 files from its output folder, so the script writes three at most:
#   OUT/summary.txt        one line per step: its limit, how it ended, its time (also on stdout);
#   OUT/gpu_check.tar.gz   gpu_check/STEP.log and gpu_check/STEP/ (each bench's --out) of every
#                          finished step, rewritten after each step: a kill keeps every finished step;
#   OUT/running.log        the running step's log (moved into the archive when the step ends): after a
#                          kill, what the interrupted step had printed.
# The step limits sum to at most 540 s and the whole run stops starting steps at its 540 s budget, so
# the device tool's 600 s limit is never reached (tests/test_gpu_check_script.py checks the sum).
# Read the results: tar xzf OUT/gpu_check.tar.gz -C OUT (then commit what is worth keeping, docs/gpu/).
#
# Usage: bash scripts/gpu_check.sh [--cpu | --dry] [OUT]        (OUT defaults to docs/gpu)
#   on the device:  bash scripts/gpu_check.sh "$OUT"
#   --cpu   rehearse here: every step on this CPU at toy sizes in float32, with fastapi, uvicorn,
#           pydantic and ray made unimportable as on the GPU host (bench_serve is skipped as it will be there)
#   --dry   the skeleton alone: each step's command replaced by a line (and KSTEP_GPU_CHECK_DRY_SECONDS
#           of sleep), for the layout and kill tests
# Environment: KSTEP_GPU_CHECK_STEPS=a,b (only those steps), KSTEP_GPU_CHECK_SECONDS (the whole run's
# budget, default 540). The lent machine's python3 has torch but no network: kstep runs from this
# checkout there (PYTHONPATH), as it does here.
set -uo pipefail

# name:seconds, in the order they run (the sum is at most 540: tests/test_gpu_check_script.py)
STEPS="env:15 smoke_cuda:90 pool_cuda:30 bench_passes:70 bench_compare:60 bench_decode:85 tests_cpu:40 bench_serve:50 tp_cuda:60 bench_tp:40"
BUDGET=${KSTEP_GPU_CHECK_SECONDS:-540}
TEST_FILES="tests/test_moe_layer.py tests/test_llada2.py tests/test_block_diffusion.py tests/test_hf_parity.py"

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SCRIPT=$ROOT/scripts/gpu_check.sh
cd "$ROOT" || exit 1

kstep() { "$PY" -m kstep "$@"; }
skip() { echo "skipped: $*"; exit 99; }  # inside a step: not run here, and why (the summary's line)

step_env() {
  nvidia-smi || echo "nvidia-smi: not here"
  "$PY" - <<'EOF'
import importlib.metadata as md
import importlib.util
import platform
import sys
import torch
print("python", sys.version.split()[0], platform.machine(), "torch", torch.__version__)
print("cuda available:", torch.cuda.is_available(), "devices:", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"capability {p.major}.{p.minor}", f"{p.total_memory / 2 ** 30:.0f} GiB")
print("torch._grouped_mm:", hasattr(torch, "_grouped_mm"))
for name in ("numpy", "safetensors", "tokenizers", "tqdm", "transformers", "matplotlib", "httpx", "jinja2",
             "prometheus_client", "pytest", "fastapi", "uvicorn", "pydantic", "ray"):
    if importlib.util.find_spec(name) is None:
        print(f"{name} missing")
        continue
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} (importable, no metadata)")
EOF
}

step_smoke_cuda() {
  "$PY" - <<'EOF'
import os
import sys
import traceback

import kstep
import kstep.layers.moe as moe
from kstep.params import BLOCK_DIFFUSION, DIFFUSION
from kstep.random_checkpoint import write_random_checkpoint
from kstep.registry import FAMILIES

device, dtype, scratch = os.environ["DEV"], os.environ["DTYPE"], os.environ["SCRATCH"]
prompts = ["def f(x):", "class A:\n    def g(self):"]


def tokens(results):
    return [r.token_ids for r in results]


failed = []
for family, spec in FAMILIES.items():  # every family, one line each; a failure does not stop the rest
    try:
        path = write_random_checkpoint(f"{scratch}/smoke-{family}", family=family, seed=1)
        llm = kstep.load(path, device=device, dtype=dtype)
        batch = llm.generate(prompts, max_tokens=16)
        checks = {"batch == alone": tokens(batch) == [llm.generate(p, max_tokens=16)[0].token_ids for p in prompts]}
        if family == "nemotron_labs_diffusion":  # LinearSpec self-speculation: the AR greedy tokens
            checks["linear_spec == ar"] = tokens(llm.generate(prompts, max_tokens=16, mode="linear_spec")) == \
                tokens(llm.generate(prompts, max_tokens=16, mode="ar"))
        elif spec.kind in (DIFFUSION, BLOCK_DIFFUSION):  # lossless self-speculation, batched
            checks["draft self == exact"] = tokens(llm.generate(prompts, max_tokens=16, exact=True)) == \
                tokens(llm.generate(prompts, max_tokens=16, draft="self", num_draft_tokens=3))
        if llm.cfg.moe is not None and device == "cuda":  # torch._grouped_mm against the loop over experts
            moe.HAS_GROUPED_MM, grouped = False, moe.HAS_GROUPED_MM
            try:
                checks["grouped mm == loop" if grouped else "no torch._grouped_mm"] = \
                    tokens(llm.generate(prompts, max_tokens=16)) == tokens(batch)
            finally:
                moe.HAS_GROUPED_MM = grouped
        print(family, "ok", "nfe", [r.nfe for r in batch], checks, flush=True)
    except Exception:
        failed.append(family)
        print(family, "FAILED", flush=True)
        traceback.print_exc()
print(f"{len(FAMILIES) - len(failed)}/{len(FAMILIES)} families ran", "failed: " + ", ".join(failed) if failed else "")
sys.exit(1 if failed else 0)
EOF
}

step_pool_cuda() {
  "$PY" - <<'EOF'
import os
import sys

import kstep
from kstep.engine.engine import Engine
from kstep.engine.request import Request
from kstep.random_checkpoint import write_random_checkpoint
from kstep.runner.kv_pool import KVBudgetExceeded, bytes_per_token

device, dtype, scratch = os.environ["DEV"], os.environ["DTYPE"], os.environ["SCRATCH"]
failed = []
for family, pages in (("qwen2", 12), ("sdar", 30)):  # a pool that holds a few of the requests' whole caches
    path = write_random_checkpoint(f"{scratch}/pool-{family}", family=family, seed=2)
    probe = kstep.load(path, device=device, dtype=dtype, kv_cache_memory="16MiB")  # (its page size only)
    page = probe.runner.kv_pool.page_tokens
    budget = (pages + 1) * page * bytes_per_token(probe.model.kv_geometry(), probe.runner.dtype)
    del probe
    llm = kstep.load(path, device=device, dtype=dtype, kv_cache_memory=budget)
    params = llm.resolve(kstep.GenerationParams(max_tokens=40, temperature=0, ignore_eos=True))
    prompts = [[3 + i, 40 + i, 7] for i in range(6)]

    def run(requests):
        engine = Engine(llm, max_batch_size=8)
        for request in requests:
            engine.add_request(request)
        while engine.has_work():
            engine.step()
        return engine.preemptions

    together = [Request([p], params) for p in prompts]
    preemptions = run(together)
    alone = []
    for p in prompts:
        request = Request([p], params)
        run([request])
        alone.append(request.output_ids)
    same = [r.output_ids for r in together] == alone
    try:
        llm.generate([[5, 6]] * 64, max_tokens=40)
        refused = False
    except KVBudgetExceeded:
        refused = True
    print(family, "preemptions", preemptions, "same as alone", same, "too big refused", refused, flush=True)
    if not (same and refused and preemptions > 0):
        failed.append(family)
sys.exit(1 if failed else 0)
EOF
}

step_bench_passes() {
  if [ "$MODE" = cpu ]; then
    kstep bench passes --device cpu --dtypes float32 --shapes llama:bundled-3m --repeats 1 --out "$A/bench_passes"
  else
    kstep bench passes --device cuda --dtypes bfloat16 --repeats 3 --out "$A/bench_passes" \
      --shapes qwen2:qwen2.5-0.5b,llada:llada-1b,sdar:qwen3-1.7b
  fi
}

step_bench_compare() {
  if [ "$MODE" = cpu ]; then
    kstep bench compare --quick --lengths 16 --num-prompts 1 --bandwidth-gbs 10 --matmul-tflops 0.05 \
      --device cpu --dtype float32 --out "$A/bench_compare"
  else
    kstep bench compare --quick --device cuda --dtype bfloat16 --out "$A/bench_compare"
  fi
}

step_bench_decode() {
  if [ "$MODE" = cpu ]; then
    kstep bench decode --device cpu --dtype float32 --lengths 32 --modes exact,exact+self,threshold --no-large \
      --quality-prompts 0 --out "$A/bench_decode"
  else
    kstep bench decode --device cuda --dtype bfloat16 --lengths 256,1024 --modes exact,exact+self,threshold \
      --no-large --quality-prompts 0 --max-cell-seconds 20 --out "$A/bench_decode"
  fi
}

step_tests_cpu() {
  # no third-party plugins: one that imports pydantic (langsmith's, where client libraries are installed)
  # fails where pydantic is missing, as on the lent H200 and in the --cpu rehearsal
  # shellcheck disable=SC2086
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -p no:cacheprovider $TEST_FILES
}

step_bench_serve() {
  "$PY" -c "import fastapi, uvicorn, pydantic" 2>/dev/null || skip "fastapi, uvicorn or pydantic not importable"
  local port args=(--concurrency 16 --duration 15 --max-tokens 64)
  [ "$MODE" = cpu ] && args=(--concurrency 2 --duration 3 --max-tokens 16)
  port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  mkdir -p "$A/bench_serve"
  kstep serve --model default --model default-ar --device "$DEV" --dtype "$DTYPE" --port "$port" --log-level warning \
    > "$A/bench_serve/server.log" 2>&1 &
  local server=$!
  "$PY" - "$port" <<'EOF' || { kill "$server"; echo "the server did not come up"; exit 1; }
import sys, time
import httpx
for _ in range(120):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.25)
sys.exit(1)
EOF
  kstep bench serve --url "http://127.0.0.1:$port" --model default "${args[@]}" --out "$A/bench_serve"
  local rc=$?
  kill "$server"
  wait "$server"
  return $rc
}

gpu_count() { "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }

step_tp_cuda() {
  local families="llama llada sdar llada2_moe llada_moe diffusion_gemma"
  if [ "$MODE" = cpu ]; then
    families="llama llada"  # two CPU ranks of gloo stand in for NCCL
  elif [ "$(gpu_count)" -lt 2 ]; then
    skip "$(gpu_count) CUDA device(s): tensor parallel needs 2"
  fi
  cat > "$SCRATCH/tp_check.py" <<'EOF'
import os
import sys
import traceback

import kstep
from kstep.random_checkpoint import write_random_checkpoint

if __name__ == "__main__":
    device, dtype, scratch = os.environ["DEV"], os.environ["DTYPE"], os.environ["SCRATCH"]
    failed = []
    for family in sys.argv[1:]:
        try:
            path = write_random_checkpoint(f"{scratch}/tp-{family}", family=family, seed=1)
            one = kstep.load(path, device=device, dtype=dtype)
            two = kstep.load(path, device=device, dtype=dtype, tensor_parallel_size=2)
            try:
                same = one.generate([5, 6, 7], max_tokens=16)[0].token_ids == \
                    two.generate([5, 6, 7], max_tokens=16)[0].token_ids
                print(family, "tp2 == tp1:", same, dict(two.runner.group.counts), flush=True)
            finally:
                two.runner.close()
        except Exception:
            failed.append(family)
            print(family, "FAILED", flush=True)
            traceback.print_exc()
    sys.exit(1 if failed else 0)
EOF
  # shellcheck disable=SC2086
  "$PY" "$SCRATCH/tp_check.py" $families
}

step_bench_tp() {
  [ "$MODE" = cpu ] && skip "cpu rehearsal: bench tp's smallest shape (0.5B) is no quick run"
  [ "$(gpu_count)" -lt 2 ] && skip "$(gpu_count) CUDA device(s): tensor parallel needs 2"
  kstep bench tp --shapes qwen2:qwen2.5-0.5b:bfloat16 --repeats 3 --checkpoints "$SCRATCH/bench-tp" \
    --out "$A/bench_tp"
}

# ---- one step, in its own process (the runner below bounds it with timeout) ----
if [ "${1:-}" = --step ]; then
  "step_$2"
  exit $?
fi

# ---- the runner ----
MODE=gpu OUT=
while [ $# -gt 0 ]; do
  case $1 in
    --cpu) MODE=cpu ;;
    --dry) MODE=dry ;;
    -h|--help) sed -n '2,/^set -uo/p' "$SCRIPT" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1 (--cpu, --dry, --help)" >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
total=0
for entry in $STEPS; do total=$((total + ${entry#*:})); done
if [ "$total" -gt 540 ]; then echo "gpu_check.sh: the step limits sum to $total s, over 540" >&2; exit 2; fi
ASKED=${KSTEP_GPU_CHECK_STEPS:-}
for name in ${ASKED//,/ }; do
  [[ " $STEPS" == *" $name:"* ]] || { echo "gpu_check.sh: KSTEP_GPU_CHECK_STEPS: no step $name" >&2; exit 2; }
done
OUT=${OUT:-docs/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
trap 'exit 143' TERM INT
A=$WORK/gpu_check SCRATCH=$WORK/scratch
mkdir -p "$A" "$SCRATCH"
if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PY MODE A SCRATCH
if [ "$MODE" = cpu ]; then
  export DEV=cpu DTYPE=float32
  mkdir -p "$SCRATCH/block"  # the GPU host's missing packages, missing here too
  cat > "$SCRATCH/block/sitecustomize.py" <<'EOF'
"""fastapi, uvicorn, pydantic (and starlette), and ray not found, as on the lent GPU machine."""
import sys
from importlib.machinery import PathFinder

MISSING = {"fastapi", "uvicorn", "pydantic", "pydantic_core", "starlette", "ray"}


class WithoutMissing(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in MISSING else super().find_spec(name, path, target)


sys.meta_path[:] = [WithoutMissing if finder is PathFinder else finder for finder in sys.meta_path]
EOF
  export PYTHONPATH=$SCRATCH/block:$PYTHONPATH
else
  export DEV=cuda DTYPE=bfloat16
fi

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

pack() {  # every finished step into one archive, written aside and renamed: a kill never leaves half of one
  cp "$OUT/summary.txt" "$A/summary.txt"
  tar -czf "$OUT/gpu_check.tar.gz.part" -C "$WORK" gpu_check && mv -f "$OUT/gpu_check.tar.gz.part" "$OUT/gpu_check.tar.gz"
}

run_step() {  # NAME LIMIT: bounded by its limit and what is left of the budget; a failure stops nothing
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS)) start=$SECONDS rc status big
  if [ "$left" -lt 5 ]; then
    note "== $name: skipped, ${left} s left of the ${BUDGET} s budget"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  note "== $name (limit ${limit} s, $(date +%T))"
  if [ "$MODE" = dry ]; then
    { echo "dry run of $name"; sleep "${KSTEP_GPU_CHECK_DRY_SECONDS:-0}"; } > "$OUT/running.log" 2>&1
    rc=$?
  else
    timeout -k 5 "$limit" bash "$SCRIPT" --step "$name" > "$OUT/running.log" 2>&1
    rc=$?
  fi
  mv -f "$OUT/running.log" "$A/$name.log"
  case $rc in
    0) status=ok ;;
    99) status=$(tail -n 1 "$A/$name.log") ;;
    124|137) status="stopped at its ${limit} s limit" ;;
    *) status="failed (exit $rc)" ;;
  esac
  # a file the archive could not carry back (the tool returns files up to 16 MiB) is left out, by name
  while IFS= read -r big; do
    [ -n "$big" ] && rm -f "$big" && note "   left out ${big#"$A"/} (over 4 MiB)"
  done < <(find "$A/$name" -type f -size +4M 2>/dev/null)
  note "   $name: $status after $((SECONDS - start)) s ($SECONDS s in all)"
  sed 's/^/   | /' "$A/$name.log" | tail -n 4
  pack
}

: > "$OUT/summary.txt"
rm -f "$OUT/running.log" "$OUT/gpu_check.tar.gz.part"
note "gpu_check.sh, mode $MODE: $(uname -n), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), budget ${BUDGET} s"
DEADLINE=$((SECONDS + BUDGET))
for entry in $STEPS; do
  name=${entry%%:*}
  if [ -n "$ASKED" ] && [[ ",$ASKED," != *",$name,"* ]]; then continue; fi
  run_step "$name" "${entry#*:}"
done
note "done in $SECONDS s"
pack
