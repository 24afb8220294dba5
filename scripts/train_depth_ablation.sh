#!/usr/bin/env bash
# Depth ablation (issue 4): DSpark and DFlash with 2 draft layers on the Table-1 data and budget, evaluated on the
# same prompts and seeds as scripts/train_table1.sh (run that first; its 1-layer rows are the comparison).
# 2-core CPU: the two trainings share the cores, one thread each. Reruns resume from the last checkpoints.
source "$(dirname "$0")/table1_common.sh"
OUT=${OUT:-results/ablation-depth}
mkdir -p "$OUT"
train dspark-2l 1 --set drafter.num_layers=2 &
train dflash-2l 1 --set drafter.type=dflash --set drafter.num_layers=2 &
wait
"$DSPARK" bench acceptance --drafters runs/table1-dspark-2l/drafter,runs/table1-dflash-2l/drafter \
  --limit "$LIMIT" --max-new-tokens "$TOKENS" --temperatures 1.0 --batch 24 --speed-prompts 0 --out "$OUT"
