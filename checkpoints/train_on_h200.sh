#!/usr/bin/env bash
# Trains both demo models, one after the other, in one call of the device tool (one H200), and
# leaves them under $OUT as a split tar (the tool returns files of at most 16 MB).
#
# Needs, carried with the call: build/demo_corpus (python3 checkpoints/build_corpus.py) and .whl/
# holding grain, array-record and portpicker wheels (the GPU image lacks them).
#   device run, carry [".whl", "build/demo_corpus"]: bash checkpoints/train_on_h200.sh
# Afterwards, here: cat <files_at>/ckpt.tar.part-* | tar -C checkpoints -xf -
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the output directory}
TARGET_SECONDS=${TARGET_SECONDS:-180}
DRAFT_SECONDS=${DRAFT_SECONDS:-75}
EXTRA_ARGS=${EXTRA_ARGS:-}  # e.g. "--seq-len 64 --batch-size 2" for a CPU smoke run of this script

if ! python3 -c "import grain" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/grain-*.whl .whl/array_record-*.whl .whl/portpicker-*.whl
  export PYTHONPATH=/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no GPU"; } \
  | tee "$OUT/gpu.txt"

mkdir -p /tmp/demo_ckpt
python3 checkpoints/train_demo.py --model target --out /tmp/demo_ckpt/demo-target \
  --max-seconds "$TARGET_SECONDS" $EXTRA_ARGS 2>&1 | tee "$OUT/train.log"
python3 checkpoints/train_demo.py --model draft --out /tmp/demo_ckpt/demo-draft \
  --max-seconds "$DRAFT_SECONDS" $EXTRA_ARGS 2>&1 | tee -a "$OUT/train.log"
tar -C /tmp/demo_ckpt -cf - demo-target demo-draft | split -b 15000000 - "$OUT/ckpt.tar.part-"
ls -la "$OUT"
