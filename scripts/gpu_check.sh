#!/usr/bin/env bash
# The day a GPU is lent (the device tool): one prepared run, within 10 minutes, of what kstep has
# never measured on CUDA. It writes everything under docs/gpu/ (copy that back and commit it):
#   1. correctness on CUDA: every family generates in bf16 on the GPU and its batch equals its rows
#      alone (the test suite itself builds its models on the CPU: its parity tests run there, quickly);
#   2. pass costs at real shapes in bf16 (kstep bench passes) against floors measured in the same run;
#   3. bench decode / compare / serve on the bundled models in bf16 on cuda;
#   4. with 2+ GPUs: tensor parallel (NCCL) TP=2 against TP=1, and bench tp.
# Usage: bash scripts/gpu_check.sh [OUT]   (OUT defaults to docs/gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/gpu}
mkdir -p "$OUT"
# the lent machine has its own python3 with torch (and no network): kstep runs from the checkout there
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; fi
KSTEP="$PY -m kstep"
export PYTHONUNBUFFERED=1
run() {  # run NAME SECONDS CMD...: each step bounded, its output kept, a failure does not stop the rest
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? after $SECONDS s in all" | tee -a "$OUT/summary.txt"
}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0))" \
  > "$OUT/torch.txt" 2>&1
# 1. correctness on CUDA: every family generates in bf16 on the GPU, and equals itself batched
run smoke_cuda 120 $PY - <<'EOF'
import torch, kstep
from kstep.random_checkpoint import write_random_checkpoint
for family in ["llada", "dream", "fast_dllm_v2", "sdar", "llada2_moe", "llada_moe", "llama", "qwen2"]:
    path = write_random_checkpoint(f"/tmp/gpu-{family}", family=family, seed=1)
    llm = kstep.load(path, device="cuda", dtype="bfloat16")
    prompts = ["def f(x):", "class A:\n    def g(self):"]
    batch = llm.generate(prompts, max_tokens=16)
    alone = [llm.generate(p, max_tokens=16)[0] for p in prompts]
    same = all(a.token_ids == b.token_ids for a, b in zip(batch, alone))
    if family not in ("llama", "qwen2"):  # lossless self-speculation: the exact sampler's tokens, batched on cuda
        exact = llm.generate(prompts, max_tokens=16, exact=True)
        drafted = llm.generate(prompts, max_tokens=16, draft="self", num_draft_tokens=3)
        same = same and all(a.token_ids == b.token_ids for a, b in zip(exact, drafted))
    print(family, "ok", [r.nfe for r in batch], "batch == alone (and draft self == exact):", same)
EOF
run tests_cpu_quick 150 $PY -m pytest -q -x tests/test_moe_layer.py tests/test_llada2.py tests/test_block_diffusion.py
# 2. one pass at real shapes, bf16 and fp32, floors from this GPU's own calibration
run bench_passes 150 $KSTEP bench passes --device cuda --dtypes bfloat16 --shapes \
  qwen2:qwen2.5-0.5b,qwen2:qwen2.5-1.5b,llada:llada-1b,sdar:qwen3-1.7b --out "$OUT/passes"
# 3. the bundled models in bf16 on cuda
run bench_decode 90 $KSTEP bench decode --device cuda --dtype bfloat16 --lengths 256,1024 --quality-prompts 0 \
  --out "$OUT/decode"
run bench_compare 90 $KSTEP bench compare --quick --device cuda --dtype bfloat16 --out "$OUT/compare"
if $PY -c "import fastapi, uvicorn" 2>/dev/null; then  # the lent image lacks them: carry wheels (device README)
  $KSTEP serve --model default --model default-ar --device cuda --dtype bfloat16 --port 8011 > "$OUT/serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 60); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
  run bench_serve 60 $KSTEP bench serve --url http://127.0.0.1:8011 --model default --concurrency 16 --duration 20 \
    --max-tokens 64 --out "$OUT/serve"
  kill $SERVER
else
  echo "== bench_serve skipped: fastapi/uvicorn not importable" | tee -a "$OUT/summary.txt"
fi
# 4. with 2+ GPUs: tensor parallel on NCCL (never run yet): TP=2 tokens == TP=1, then bench tp
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  run tp_cuda 120 $PY - <<'EOF'
import kstep
from kstep.random_checkpoint import write_random_checkpoint
if __name__ == "__main__":
    for family in ["llama", "llada", "sdar", "llada2_moe", "llada_moe", "diffusion_gemma"]:
        path = write_random_checkpoint(f"/tmp/gpu-tp-{family}", family=family, seed=1)
        one = kstep.load(path, device="cuda", dtype="bfloat16")
        two = kstep.load(path, device="cuda", dtype="bfloat16", tensor_parallel_size=2)
        same = one.generate([5, 6, 7], max_tokens=16)[0].token_ids == two.generate([5, 6, 7], max_tokens=16)[0].token_ids
        print(family, "tp2 == tp1:", same, dict(two.runner.group.counts))
        two.runner.close()
EOF
  run bench_tp 150 $KSTEP bench tp --shapes qwen2:qwen2.5-1.5b:bfloat16 --out "$OUT/tp"
fi
echo "done in $SECONDS s" | tee -a "$OUT/summary.txt"
