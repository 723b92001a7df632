#!/usr/bin/env bash
# The block-diffusion coder (issue: a diffusion coder that unmasks several tokens per pass), from the
# bundled AR twin, in three steps on 2 CPU cores (not part of CI; each step resumes with --resume or,
# for distill, by appending to its JSONL):
#   1. convert: the AR twin's weights, block-causal attention (blocks of 8), the block-diffusion
#      objective on the training corpus (BD3-LM's [noisy; clean] pass, complementary masks)  ~30 min
#   2. distill: the AR twin's greedy completions of the training split's function prompts, cut where
#      the function ends, kept when they parse (kstep distill)                               ~60 min
#   3. distilled fine-tune: those completions (prompt never masked) + 25% corpus windows, with
#      dParallel's certainty forcing                                                         ~60 min
# Steps 1 and 2 run side by side, one thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs}
KSTEP=.venv/bin/kstep
SIZE=(--d-model 192 --n-layers 4 --n-heads 4 --n-kv-heads 4 --ffn-dim 512 --tokenizer kstep/bundled/default-ar
      --block-size 8 --threads 1 --eval-every 100 --eval-windows 8 --save-every 50)
mkdir -p "$RUNS/distill"
$KSTEP train --objective block-diffusion --out "$RUNS/block-stage1" --init-from kstep/bundled/default-ar "${SIZE[@]}" \
  --seq-len 256 --batch-size 8 --token-budget 1200000 --lr 5e-4 --warmup-steps 30 > "$RUNS/block-stage1.log" 2>&1 &
$KSTEP distill --model default-ar --out "$RUNS/distill/default-ar.jsonl" --max-tokens 256 --batch-size 16 \
  --threads 1 > "$RUNS/distill.log" 2>&1 &
wait
$KSTEP train --objective block-diffusion --out "$RUNS/block-stage2" --init-from "$RUNS/block-stage1" "${SIZE[@]}" \
  --seq-len 320 --batch-size 8 --token-budget 2500000 --lr 3e-4 --warmup-steps 20 \
  --distill-data "$RUNS/distill/default-ar.jsonl" --real-data-fraction 0.25 --certainty-weight 1.0 \
  > "$RUNS/block-stage2.log" 2>&1
$KSTEP eval --model "$RUNS/block-stage2" --ar-model default-ar --max-tokens 128 --thresholds 0.5,0.7,0.9 \
  --out "$RUNS/block-stage2-eval"
