#!/usr/bin/env bash
# Depth ablation (issue 4): DSpark and DFlash with 2 and 4 draft layers (DEPTHS) on the Table-1 data and budget,
# evaluated on the same prompts and seeds as scripts/train_table1.sh (run that first; its 1-layer rows are the
# comparison). 2-core CPU: two trainings at a time, one thread each. Reruns resume from the last checkpoints, a
# finished run is not trained again, and a depth whose results exist ($OUT/<n>l) is not evaluated again (FORCE=1).
source "$(dirname "$0")/table1_common.sh"
OUT=${OUT:-results/ablation-depth}
DEPTHS=${DEPTHS:-2 4}
mkdir -p "$OUT"
for n in $DEPTHS; do
  train "dspark-${n}l" 1 --set "drafter.num_layers=$n" &
  train "dflash-${n}l" 1 --set drafter.type=dflash --set "drafter.num_layers=$n" &
  wait
  if [[ -f "$OUT/${n}l/acceptance.json" && -z "${FORCE:-}" ]]; then
    echo "depth $n: $OUT/${n}l exists, not evaluated again (FORCE=1 to redo)"
    continue
  fi
  "$DSPARK" bench acceptance --drafters "runs/table1-dspark-${n}l/drafter,runs/table1-dflash-${n}l/drafter" \
    --limit "$LIMIT" --max-new-tokens "$TOKENS" --temperatures 1.0 --batch 24 --speed-prompts 0 --out "$OUT/${n}l"
done
