#!/usr/bin/env bash
# The bundled `default`, a block-diffusion coder, from the bundled AR twin (default-ar), in four steps
# on 2 CPU cores (not part of CI; a train step resumes with --resume, distill by appending to its JSONL):
#   1. convert: the AR twin's weights, block-causal attention (blocks of 8), the block-diffusion
#      objective on the training corpus (BD3-LM's [noisy; clean] pass, complementary masks)  ~30 min
#   2. distill: the AR twin's greedy completions of the training split's function prompts, cut where
#      the function ends, kept when they parse (kstep distill)                               ~60 min
#   3. distilled fine-tune: the first 8,800 rows (what step 2 had written when the bundled model's
#      step 3 started; 3,712 parse) + 25% corpus windows, dParallel's certainty forcing      ~55 min
#   4. the same on every row, 12.5% corpus windows, longer                                   ~80 min
# Steps 1 and 2 run side by side, one thread each; the bundled model's step 4 ran beside a variant
# with --certainty-weight 3 (README). Then the card, curves and evaluation.
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
head -n 8800 "$RUNS/distill/default-ar.jsonl" > "$RUNS/distill/first-8800.jsonl"
$KSTEP train --objective block-diffusion --out "$RUNS/block-stage2" --init-from "$RUNS/block-stage1" "${SIZE[@]}" \
  --seq-len 320 --batch-size 8 --token-budget 2500000 --lr 3e-4 --warmup-steps 20 \
  --distill-data "$RUNS/distill/first-8800.jsonl" --real-data-fraction 0.25 --certainty-weight 1.0 \
  > "$RUNS/block-stage2.log" 2>&1
$KSTEP train --objective block-diffusion --out "$RUNS/block-stage3" --init-from "$RUNS/block-stage2" "${SIZE[@]}" \
  --seq-len 320 --batch-size 8 --token-budget STAGE3_BUDGET --lr 3e-4 --warmup-steps 20 \
  --distill-data "$RUNS/distill/default-ar.jsonl" --real-data-fraction 0.125 --certainty-weight STAGE3_CERTAINTY \
  > "$RUNS/block-stage3.log" 2>&1
mkdir -p kstep/bundled/default
cp "$RUNS/block-stage3"/{config.json,model.safetensors,tokenizer.json,tokenizer_config.json,train_log.jsonl,train_config.json,data_split.json} \
  kstep/bundled/default/
$KSTEP train-report --model block-coder=kstep/bundled/default --model ar=kstep/bundled/default-ar \
  --out docs/block-coder --write-cards
