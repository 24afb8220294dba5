#!/usr/bin/env bash
# The shipped SmolLM2 drafter, as it was made on the 2-core CPU: the Table-1 DSpark run (400 steps of
# configs/smollm2-dspark.toml), then that run continued to LONG_STEPS (default 2,400) under a new cosine schedule
# (a warm restart: the step-400 checkpoint's weights and optimizer state, peak learning rate again).
# Both stages resume from their last checkpoint when rerun. Prerequisites: data/smollm2-gen and
# data/smollm2-cache (the commands in configs/smollm2-dspark.toml). Afterwards:
#   RUN=runs/smollm2-dspark-long scripts/evaluate_shipped_drafter.sh
source "$(dirname "$0")/table1_common.sh"
LONG_STEPS=${LONG_STEPS:-2400}
THREADS=${THREADS:-2}
STEPS=400 train dspark "$THREADS"  # stage 1 = runs/table1-dspark (a no-op when it is already at step 400)
RUN=runs/smollm2-dspark-long
if [ ! -f "$RUN/checkpoints/latest.json" ]; then
  mkdir -p "$RUN/checkpoints"
  cp -r runs/table1-dspark/checkpoints/step-00000400 "$RUN/checkpoints/"
  echo '{"step": 400, "dir": "step-00000400"}' > "$RUN/checkpoints/latest.json"
fi
"$DSPARK" train --config "$CFG" --set "optim.max_steps=$LONG_STEPS" --set "run.out_dir=$RUN" \
  --set "run.threads=$THREADS" --set run.progress=false --set run.ckpt_every=50 > "$RUN.log" 2>&1
.venv/bin/python -c "from dspark.training.train_log import plot_log as p; p('$RUN/train_log.csv', 'results/training/smollm2-dspark-long-train.png')"
