#!/usr/bin/env bash
# After `dspark train --config configs/smollm2-dspark.toml`: install the trained drafter as the shipped one,
# calibrate it on held-out prompts, and measure acceptance and speed (results/ and README tables come from here).
set -euo pipefail
RUN=${RUN:-runs/smollm2-dspark}
SHIP=src/dspark/drafters/shipped/smollm2-135m-instruct
DSPARK=${DSPARK:-.venv/bin/dspark}
mkdir -p "$(dirname "$SHIP")"
rm -rf "$SHIP.tmp" && cp -r "$RUN/drafter" "$SHIP.tmp" && rm -rf "$SHIP" && mv "$SHIP.tmp" "$SHIP"
# Held out: for a drafter trained on a lent GPU (scripts/device_prepare.sh's pool, which holds every prompt of
# data/mix.jsonl) the 1,000 prompts of .dev/heldout.jsonl; for the CPU-trained ones, data/mix.jsonl lines after
# 6000, which were never regenerated or trained on.
if [ -f .dev/heldout.jsonl ]; then HELDOUT=(.dev/heldout.jsonl --skip 0); else HELDOUT=(data/mix.jsonl --skip 6000); fi
$DSPARK calibrate --drafter "$SHIP" --prompts "${HELDOUT[@]}" --limit ${CAL_PROMPTS:-96} \
  --max-new-tokens 128 --batch 16 --out results/calibration
$DSPARK bench acceptance --drafters dspark,ngram --limit ${PER_SET:-8} --max-new-tokens 128 --batch 16 \
  --speed-prompts ${SPEED_PROMPTS:-1} --head-latency --out results/acceptance
