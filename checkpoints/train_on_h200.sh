#!/usr/bin/env bash
# Trains both demo models, one after the other, in one call of the device tool (one H200), and
# leaves them under $OUT as a split tar (the tool returns files of at most 16 MB).
#
# Needs, next to the repository: the corpus, as build/demo_corpus/ or as the smaller
# build/demo_corpus.tar.xz (python3 checkpoints/build_corpus.py, then
# tar -C build -cJf build/demo_corpus.tar.xz demo_corpus), and .whl/ holding grain, array-record
# and portpicker wheels (the GPU image lacks them).
#   device run, carry [".whl", "build/demo_corpus.tar.xz"]: bash checkpoints/train_on_h200.sh
# Afterwards, here: cat <files_at>/target.tar.part-* | tar -C checkpoints -xf - (draft.tar.part-*: same)
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the output directory}
TARGET_SECONDS=${TARGET_SECONDS:-180}
DRAFT_SECONDS=${DRAFT_SECONDS:-75}
DRAFT_ARGS=${DRAFT_ARGS:-}  # e.g. "--teacher /tmp/demo_ckpt/demo-target" to distil the draft
EXTRA_ARGS=${EXTRA_ARGS:-}  # e.g. "--seq-len 64 --batch-size 2" for a CPU smoke run of this script

if ! python3 -c "import grain" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/grain-*.whl .whl/array_record-*.whl .whl/portpicker-*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no GPU"; } \
  | tee "$OUT/gpu.txt"

if [ ! -d build/demo_corpus ]; then
  python3 -c "import tarfile; tarfile.open('build/demo_corpus.tar.xz').extractall('build', filter='data')"
fi
mkdir -p /tmp/demo_ckpt
python3 checkpoints/train_demo.py --model target --out /tmp/demo_ckpt/demo-target \
  --max-seconds "$TARGET_SECONDS" $EXTRA_ARGS 2>&1 | tee "$OUT/train.log"
# Each model leaves as soon as it is trained: a run cut short keeps the target.
tar -C /tmp/demo_ckpt -cf - demo-target | split -b 15000000 - "$OUT/target.tar.part-"
python3 checkpoints/train_demo.py --model draft --out /tmp/demo_ckpt/demo-draft \
  --max-seconds "$DRAFT_SECONDS" $DRAFT_ARGS $EXTRA_ARGS 2>&1 | tee -a "$OUT/train.log"
tar -C /tmp/demo_ckpt -cf - demo-draft | split -b 15000000 - "$OUT/draft.tar.part-"
ls -la "$OUT"
