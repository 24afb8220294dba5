#!/usr/bin/env bash
# Depth ablation (issue 4): DSpark and DFlash with 2 draft layers, on the Table-1 data and budget, evaluated
# beside the 1-layer runs of scripts/train_table1.sh (run that first). 2-core CPU: the two trainings share the
# cores, one thread each. Reruns resume from the last checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
DSPARK=${DSPARK:-.venv/bin/dspark}
STEPS=${STEPS:-400}
LIMIT=${LIMIT:-15}
TOKENS=${TOKENS:-64}
OUT=${OUT:-results/ablation-depth}
CFG=configs/smollm2-table1.toml

train() {  # name threads [--set ...]
  local name=$1 threads=$2
  shift 2
  "$DSPARK" train --config "$CFG" --set "optim.max_steps=$STEPS" --set "run.out_dir=runs/table1-$name" \
    --set "run.threads=$threads" --set run.progress=false "$@" > "runs/table1-$name.log" 2>&1
}

mkdir -p runs "$OUT"
train dspark-2l 1 --set drafter.num_layers=2 &
train dflash-2l 1 --set drafter.type=dflash --set drafter.num_layers=2 &
wait
"$DSPARK" bench acceptance \
  --drafters runs/table1-dspark/drafter,runs/table1-dspark-2l/drafter,runs/table1-dflash/drafter,runs/table1-dflash-2l/drafter \
  --limit "$LIMIT" --max-new-tokens "$TOKENS" --temperatures 1.0 --batch 24 --speed-prompts 0 --out "$OUT"
