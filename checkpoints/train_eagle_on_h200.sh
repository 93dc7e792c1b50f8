#!/usr/bin/env bash
# Trains the demo target's EAGLE-3 head (checkpoints/demo-eagle3) in resumable jobs of at most
# 9 minutes on one H200: run it again until its last line says "done": true. WORK (data, orbax
# checkpoints) stays on the machine between calls while it is held; each job also leaves it under
# $OUT as a split tar, so a fresh machine continues from it:
#   device run: bash checkpoints/train_eagle_on_h200.sh
#   if the machine was given back in between, here: cat <files_at>/eagle_work.tar.part-* >
#   build/eagle_work.tar, then device run with carry ["build/eagle_work.tar"].
# Afterwards, here: cp -r <files_at>/demo-eagle3 checkpoints/ (config.json + model.safetensors).
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the output directory}
WORK=build/eagle_work
MAX_SECONDS=${MAX_SECONDS:-480}
EXTRA_ARGS=${EXTRA_ARGS:-}  # e.g. "--num-prompts 8 --steps 4 --seq-len 48 --prompt-tokens 16" (CPU smoke)
if [ ! -d "$WORK" ] && [ -f build/eagle_work.tar ]; then
  tar -xf build/eagle_work.tar
fi
mkdir -p "$WORK"
python3 -m cli.main train-eagle --model checkpoints/demo-target --out "$OUT/demo-eagle3" \
  --work "$WORK" --resume --max-seconds "$MAX_SECONDS" --steps 6000 --batch-size 64 \
  --seq-len 256 --prompt-tokens 64 --num-prompts 4096 --k 5 --draft-vocab-size 2048 \
  --lr 1e-3 --warmup-steps 200 --save-every 500 $EXTRA_ARGS
cp "$WORK/log.json" "$OUT/eagle_log.json"
cp "$WORK/learning_curve.png" "$OUT/" 2>/dev/null || true
tar -cf - "$WORK" | split -b 15m - "$OUT/eagle_work.tar.part-"
