#!/usr/bin/env bash
# The shipped SmolLM2 drafter, as it was made on the 2-core CPU, in three stages, each resuming from its last
# checkpoint when rerun:
#   1. the Table-1 DSpark run: 400 steps of configs/smollm2-dspark.toml on the first 1,376 sequences;
#   2. that run continued to LONG_STEPS (default 2,400) under a new cosine schedule (a warm restart: the
#      step-400 checkpoint's weights and optimizer state, peak learning rate again), same 1,376 sequences;
#   3. (session 9) continued to MORE_STEPS (default 3,200) on the regenerated answers of the first 2,076 prompts
#      of data/mix.jsonl (2,050 sequences, 0.59 M tokens; the schedule resumes at step 2,400 of a cosine to
#      MORE_STEPS, i.e. at ~30 % of the peak learning rate).
#   4. (session 33, with SESSION33=1) went on from stage 3's export (run.init_from: its weights and draft
#      vocabulary, a new optimizer and schedule) for S33_STEPS (default 1,287) steps on the 8,192 conversations
#      the session-32 GPU regenerated (results/training/gpu-s32/data.jsonl.xz), with online target features
#      from a bf16 target (1.3x a step on this CPU's avx512_bf16: results/training/cpu-s33), peak lr 3e-4.
# Prerequisites: data/smollm2-gen (`dspark datagen ... --limit 2076`) and data/smollm2-cache (the commands in
# configs/smollm2-dspark.toml). Afterwards: RUN=runs/smollm2-dspark-more scripts/evaluate_shipped_drafter.sh
source "$(dirname "$0")/table1_common.sh"
LONG_STEPS=${LONG_STEPS:-2400}
MORE_STEPS=${MORE_STEPS:-3200}
THREADS=${THREADS:-2}
FIRST=1376  # sequences the first two stages saw (the dataset was that long then)

continue_run() {  # from-run from-step to-run steps [--set ...]: warm-start to-run from a checkpoint, then train
  local from=$1 step=$2 run=$3 steps=$4
  shift 4
  local dir
  dir=$(printf 'step-%08d' "$step")
  if [ ! -f "$run/checkpoints/latest.json" ]; then
    mkdir -p "$run/checkpoints"
    cp -r "$from/checkpoints/$dir" "$run/checkpoints/"
    echo "{\"step\": $step, \"dir\": \"$dir\"}" > "$run/checkpoints/latest.json"
  fi
  "$DSPARK" train --config "$CFG" --set "optim.max_steps=$steps" --set "run.out_dir=$run" \
    --set "run.threads=$THREADS" --set run.progress=false --set run.ckpt_every=50 "$@" > "$run.log" 2>&1
}

STEPS=400 train dspark "$THREADS" --set data.limit=$FIRST  # stage 1 = runs/table1-dspark
continue_run runs/table1-dspark 400 runs/smollm2-dspark-long "$LONG_STEPS" --set data.limit=$FIRST
continue_run runs/smollm2-dspark-long "$LONG_STEPS" runs/smollm2-dspark-more "$MORE_STEPS"
.venv/bin/python -c "from dspark.training.train_log import plot_log as p; p('runs/smollm2-dspark-more/train_log.csv', 'results/training/smollm2-dspark-more-train.png')"
[ "${SESSION33:-0}" = 1 ] || exit 0
mkdir -p runs/cpu-s33
# dspark train reads the committed .jsonl.xz as it is (session 33 trained on a decompressed copy: the same records)
"$DSPARK" train --config "$CFG" --no-progress --set data.dataset=results/training/gpu-s32/data.jsonl.xz \
  --set data.cache= \
  --set run.out_dir=runs/cpu-s33/dspark --set run.init_from=runs/smollm2-dspark-more/drafter \
  --set optim.max_steps="${S33_STEPS:-1287}" --set optim.lr=3e-4 --set optim.warmup_steps=20 \
  --set target.dtype=bfloat16 --set run.threads="$THREADS" --set run.log_every=10 --set run.ckpt_every=100 \
  > runs/cpu-s33/dspark.log 2>&1
