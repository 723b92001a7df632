#!/usr/bin/env bash
# Every figure of docs/benchmarks.md, one benchmark at a time (never two torch processes side by side).
# About 80 minutes on 2 CPU cores. Not part of CI. JSON, PNG and the printed tables (*.md) go to
# docs/benchmarks/ (committed, beside the page) unless OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/benchmarks}
KSTEP=.venv/bin/kstep
mkdir -p "$OUT/bench/ar" "$OUT/bench/exact" "$OUT/compare" "$OUT/eval"
$KSTEP bench decode --model llada-coder --max-cell-seconds 30 --out "$OUT/bench" | tee "$OUT/bench/bench_decode.md"
# the full-attention diffusion model with its default decoding (dual cache + threshold 0.9), then the exact sampler
$KSTEP bench serve --model llada-coder --concurrency 16 --duration 60 --max-tokens 64 --threads 2 \
  --out "$OUT/bench" | tee "$OUT/bench/bench_serve.md"
$KSTEP bench serve --model llada-coder --concurrency 16 --duration 60 --max-tokens 64 --threads 2 --setting exact=true \
  --out "$OUT/bench/exact" | tee "$OUT/bench/exact/bench_serve.md"
$KSTEP bench serve --model default-ar --concurrency 16 --duration 60 --max-tokens 64 --threads 2 \
  --out "$OUT/bench/ar" | tee "$OUT/bench/ar/bench_serve.md"
$KSTEP bench serve --model default-ar --shared-prefix-tokens 512 --concurrency 8 --duration 30 --max-tokens 16 \
  --threads 2 --out "$OUT/bench" | tee "$OUT/bench/bench_serve_prefix.md"
# the engine's own batching ceiling, no HTTP (what bench serve's ratio can reach)
.venv/bin/python scripts/engine_ceiling.py --model llada-coder | tee "$OUT/bench/engine_ceiling.md"
.venv/bin/python scripts/engine_ceiling.py --model default-ar | tee -a "$OUT/bench/engine_ceiling.md"
$KSTEP bench compare --diffusion-model llada-coder --out "$OUT/compare" | tee "$OUT/compare/compare.md"
$KSTEP eval --model llada-coder --out "$OUT/eval" | tee "$OUT/eval/eval.md"
# the block-diffusion coder (the bundled default): scripts/train_block_coder.sh's eval and benchmarks
$KSTEP bench quant --out "$OUT/bench" | tee "$OUT/bench/bench_quant.md"
$KSTEP bench ar --out "$OUT/bench" | tee "$OUT/bench/bench_ar.md"
# real sizes (issue 25) and the MoE layer: random weights at published shapes, built in memory
mkdir -p "$OUT/passes" "$OUT/moe"
$KSTEP bench passes --out "$OUT/passes"                       # ~35 minutes: 1.5B passes in bf16 run ~5 s each here
$KSTEP bench moe --out "$OUT/moe"
$KSTEP random-checkpoint --family llada2_moe --shape llada2-2b --dtype bfloat16 --out runs/llada2-2b-bf16
$KSTEP bench load --model runs/llada2-2b-bf16 --dtype bfloat16 --out "$OUT/moe/load_llada2_2b.json"
