#!/usr/bin/env bash
# Reproduce the bundled models trained from scratch (kstep/bundled/*): the full-attention diffusion
# coder (llada-coder) and the AR twin (default-ar) train concurrently, one thread each (two 1-thread
# processes get more from 2 cores than one 2-thread process), then the draft model; then the report.
# About 60 + 10 minutes on 2 CPU cores. Not part of CI. The bundled `default`, the block-diffusion
# coder, is made from default-ar afterwards: scripts/train_block_coder.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs}
KSTEP=.venv/bin/kstep
# d_model 192 / 4 layers won a held-out-loss sweep at equal wall time against d_model 256 / 6 layers
# (docs/bundled-models.md, "Sizing").
COMMON=(--d-model 192 --n-layers 4 --n-heads 4 --n-kv-heads 4 --ffn-dim 512 --seq-len 512 --batch-size 8 --lr 2e-3
        --warmup-steps 100 --token-budget 7200000 --eval-every 256 --eval-windows 16 --save-every 256 --threads 1)
mkdir -p "$RUNS"
$KSTEP train --objective diffusion --out "$RUNS/llada-coder" "${COMMON[@]}" > "$RUNS/llada-coder.log" 2>&1 &
while [ ! -f "$RUNS/llada-coder/tokenizer.json" ]; do sleep 2; done   # the twin shares the diffusion run's tokenizer
$KSTEP train --objective ar --out "$RUNS/default-ar" --tokenizer "$RUNS/llada-coder" "${COMMON[@]}" > "$RUNS/default-ar.log" 2>&1 &
wait
$KSTEP train --objective ar --out "$RUNS/default-draft" --tokenizer "$RUNS/llada-coder" --d-model 128 --n-layers 3 \
  --n-heads 2 --n-kv-heads 2 --ffn-dim 352 --seq-len 512 --batch-size 8 --token-budget 3000000 \
  --eval-every 128 --eval-windows 16 --save-every 128 --threads 1 > "$RUNS/default-draft.log" 2>&1
$KSTEP train-report --model diffusion="$RUNS/llada-coder" --model ar="$RUNS/default-ar" --model draft="$RUNS/default-draft" \
  --out docs/bundled-models
for name in llada-coder default-ar default-draft; do
  mkdir -p "kstep/bundled/$name"
  cp "$RUNS/$name"/{config.json,model.safetensors,tokenizer.json,tokenizer_config.json,train_log.jsonl,train_config.json,data_split.json} "kstep/bundled/$name/"
done
