#!/usr/bin/env bash
# Table 1 on SmolLM2-135M-Instruct (issue 4): DSpark, DFlash and Eagle3 on the same data and budget, then
# `dspark bench acceptance` over the three and the shipped drafter. 2-core CPU: DSpark and DFlash train side by
# side on one thread each, then Eagle3 on both. Every run resumes from its last checkpoint when rerun.
#
#   prerequisites: data/smollm2-gen and data/smollm2-cache (the commands in configs/smollm2-dspark.toml).
#
# Environment: STEPS (default 400), LIMIT prompts per set (15), TOKENS new tokens per prompt (64), OUT.
source "$(dirname "$0")/table1_common.sh"
OUT=${OUT:-results/table1}
mkdir -p "$OUT"
train dspark 1 &
train dflash 1 --set drafter.type=dflash &
wait
train eagle3 2 --set drafter.type=eagle3
"$DSPARK" bench acceptance --drafters runs/table1-dspark/drafter,runs/table1-dflash/drafter,runs/table1-eagle3/drafter,dspark \
  --limit "$LIMIT" --max-new-tokens "$TOKENS" --temperatures 1.0 --batch 24 --speed-prompts 0 --head-latency --out "$OUT"
for name in dspark dflash eagle3; do
  .venv/bin/python -c "from dspark.training.train_log import plot_log as p; p('runs/table1-$name/train_log.csv', '$OUT/train_$name.png')" || true
done
