#!/usr/bin/env bash
# Retrains the bundled demo target, distils its draft from it and trains its EAGLE-3 head on the
# new target's own continuations, on one H200, in device jobs of at most ~8.5 minutes:
#   job 1: bash checkpoints/train_demo_and_eagle_on_h200.sh $OUT                 (target, draft)
#   job 2: bash checkpoints/train_demo_and_eagle_on_h200.sh $OUT eagle           (EAGLE-3 head)
# The second argument lists the stages to run (comma-separated, in the order target, draft,
# eagle; default all). A stage starts only while JOB_SECONDS leaves it its budget (the rest are
# reported as not started: run them in the next job). Each stage reads the outputs of the stages
# before it from this job, else from checkpoints/ (where job 1's results go before job 2).
# DEMO_TRAIN_SMOKE=1: tiny shapes and a few steps (a CPU smoke run of this whole script).
#
# Needs: build/demo_corpus/ or build/demo_corpus.tar.xz (carried; `python -m
# checkpoints.build_corpus`, then `tar -C build -cJf build/demo_corpus.tar.xz demo_corpus/train.npy
# demo_corpus/heldout.npy demo_corpus/tokenizer`). Python packages missing from the image are
# installed from .whl/ (carried) when it exists.
# Leaves under $OUT:
#   checkpoints.tar.part-*  the demo-target/, demo-draft/, demo-eagle3/ this job made (also of a
#                           stage cut short), in the repository's layout: cat ... | tar -xf -
#   benchmarks/results/train_demo_<gpu>.json (+ .png with matplotlib)   the record (demo_record.py)
#   demo_train.tar.part-*   a stage cut short (its state): cat them > build/demo_train.tar, carry
#                           it, run the stage again (the EAGLE head: ~40 MB)
#   train.log
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=$(realpath "${1:-${OUT:?usage: bash checkpoints/train_demo_and_eagle_on_h200.sh OUT_DIR [STAGES]}}")
STAGES=${2:-target,draft,eagle}
PY=${PYTHON:-python3}
JOB_SECONDS=${JOB_SECONDS:-490}      # this job's wall-clock budget
TARGET_SECONDS=${TARGET_SECONDS:-150}
DRAFT_SECONDS=${DRAFT_SECONDS:-115}
EAGLE_SECONDS=${EAGLE_SECONDS:-330}
WORK=build/demo_train
CORPUS=build/demo_corpus
# The target: 1,600 steps (WSD: decay over the last 30%); longer schedules over-fit the 8.5 M
# stdlib tokens (checkpoints/README.md). The draft: distilled, stdlib + extra code.
TARGET_ARGS=(--model target --max-steps 1600)
DRAFT_ARGS=(--model draft --extra)
EAGLE_ARGS=(--steps 5000 --batch-size 64 --seq-len 256 --prompt-tokens 64 --num-prompts 8192 --k 5
            --draft-vocab-size 2048 --lr 1e-3 --warmup-steps 200 --save-every 1000)
if [ "${DEMO_TRAIN_SMOKE:-0}" = 1 ]; then
  TINY=(--seq-len 64 --batch-size 2 --eval-windows 4 --eval-batch-size 4 --steps-per-call 5
        --warmup-steps 5 --eval-every 10 --compute-dtype float32)
  TARGET_ARGS+=("${TINY[@]}" --max-steps 20)
  DRAFT_ARGS+=("${TINY[@]}" --max-steps 10)
  EAGLE_ARGS+=(--steps 4 --batch-size 4 --seq-len 48 --prompt-tokens 16 --num-prompts 8
               --draft-vocab-size 256 --save-every 2 --compute-dtype float32)
fi
# Extra flags per stage, e.g. TARGET_EXTRA="--attention xla" (if cuDNN's kernel fails at run
# time), TARGET_EXTRA="--lr 3e-3 --extra", EAGLE_EXTRA="--steps 8000".
read -r -a extra <<< "${TARGET_EXTRA:-}"; TARGET_ARGS+=("${extra[@]}")
read -r -a extra <<< "${DRAFT_EXTRA:-}"; DRAFT_ARGS+=("${extra[@]}")
read -r -a extra <<< "${EAGLE_EXTRA:-}"; EAGLE_ARGS+=("${extra[@]}")
start=$SECONDS
mkdir -p "$OUT" "$WORK/checkpoints"
exec > >(tee -a "$OUT/train.log") 2>&1

if ! $PY -c "import flax, optax, orbax.checkpoint, tokenizers, tqdm" 2>/dev/null && [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c "import flax, optax, orbax.checkpoint, tokenizers, tqdm"  # fail here, not after training
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no GPU"; } \
  | tee "$OUT/gpu.txt"
if [ ! -d "$CORPUS" ]; then
  $PY -c "import tarfile; tarfile.open('build/demo_corpus.tar.xz').extractall('build', filter='data')"
fi
if [ -f build/demo_train.tar ] && [ ! -d "$WORK/eagle" ] && [ ! -d "$WORK/target_state" ]; then
  tar -C build -xf build/demo_train.tar
fi

made=()        # checkpoint directories this job wrote
unfinished=()  # stages cut short or not started
# The model a stage reads: this job's, else the repository's.
model() { if [ -f "$WORK/checkpoints/$1/config.json" ]; then echo "$WORK/checkpoints/$1"; else echo "checkpoints/$1"; fi; }
# Starts stage $1 with budget $2 if it was asked for and the job has the time.
want() {
  [[ ",$STAGES," == *",$1,"* ]] || return 1
  local left=$(( JOB_SECONDS - (SECONDS - start) ))
  if [ "$left" -lt "$2" ] && [ "${DEMO_TRAIN_SMOKE:-0}" != 1 ]; then
    echo "== $1: not started ($left s left of JOB_SECONDS, needs $2 s)"; unfinished+=("$1"); return 1
  fi
  echo "== $1 (budget $2 s) at $(( SECONDS - start )) s"
}
# Runs stage $1 (output checkpoint $2; the command after). A stage that exits 0 has its model
# packaged, also when cut short (train_demo.py prints "NOT done", train-eagle's last line says
# "done": false: the best / latest weights so far); cut short or failed, it is unfinished and its
# state is handed back for the next job.
run_stage() {
  local stage=$1 ckpt=$2; shift 2
  if "$@" 2>&1 | tee "$WORK/$stage.log"; then
    made+=("$ckpt")
    if grep -q -e "NOT done" -e '"done": false' "$WORK/$stage.log"; then
      echo "== $stage: cut short (resumable)"; unfinished+=("$stage")
    fi
  else
    echo "== $stage: failed"; unfinished+=("$stage")
  fi
}

if want target "$TARGET_SECONDS"; then
  resume=(); [ -d "$WORK/target_state" ] && resume=(--resume)
  run_stage target demo-target $PY -m checkpoints.train_demo "${TARGET_ARGS[@]}" \
    --out "$WORK/checkpoints/demo-target" --max-seconds "$TARGET_SECONDS" \
    --state "$WORK/target_state" "${resume[@]}"
fi
if want draft "$DRAFT_SECONDS"; then
  run_stage draft demo-draft $PY -m checkpoints.train_demo "${DRAFT_ARGS[@]}" \
    --teacher "$(model demo-target)" --out "$WORK/checkpoints/demo-draft" --max-seconds "$DRAFT_SECONDS"
fi
if want eagle "$EAGLE_SECONDS"; then
  run_stage eagle demo-eagle3 $PY -m jaxinfer.cli.main train-eagle --model "$(model demo-target)" \
    --out "$WORK/checkpoints/demo-eagle3" --work "$WORK/eagle" --resume \
    --max-seconds "$EAGLE_SECONDS" --corpus "$CORPUS/train.npy" "${EAGLE_ARGS[@]}"
  if [ -f "$WORK/eagle/log.json" ] && [ -d "$WORK/checkpoints/demo-eagle3" ]; then
    cp "$WORK/eagle/log.json" "$WORK/checkpoints/demo-eagle3/training_log.json"
  fi
  if [ -f "$WORK/eagle/learning_curve.png" ]; then cp "$WORK/eagle/learning_curve.png" "$OUT/eagle_learning_curve.png"; fi
fi

if [ ${#made[@]} -gt 0 ]; then
  rm -rf "$WORK/package" && mkdir -p "$WORK/package/checkpoints"
  for d in "${made[@]}"; do cp -r "$WORK/checkpoints/$d" "$WORK/package/checkpoints/"; done
  tar -C "$WORK/package" -cf - checkpoints | split -b 15000000 - "$OUT/checkpoints.tar.part-"
fi
state=()
for s in target_state eagle; do
  if [[ " ${unfinished[*]} " == *" ${s%_state} "* ]] && [ -d "$WORK/$s" ]; then state+=("demo_train/$s"); fi
done
if [ ${#state[@]} -gt 0 ]; then tar -C build -cf - "${state[@]}" | split -b 15000000 - "$OUT/demo_train.tar.part-"; fi
# The record covers every model: this job's, the repository's for the rest.
rm -rf "$WORK/record" && mkdir -p "$WORK/record"
for d in demo-target demo-draft demo-eagle3; do
  if [ -d "$(model $d)" ]; then cp -r "$(model $d)" "$WORK/record/$d"; fi
done
$PY -m checkpoints.demo_record --checkpoints "$WORK/record" --save "$OUT/benchmarks/results" \
  || echo "== the record failed (the checkpoints above are packaged)"
echo "== done in $(( SECONDS - start )) s: made ${made[*]:-nothing}; unfinished: ${unfinished[*]:-none}"
ls -la "$OUT"
