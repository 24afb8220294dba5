# Shared by scripts/train_table1.sh and scripts/train_depth_ablation.sh (sourced, not run).
set -euo pipefail
cd "$(dirname "$0")/.."
DSPARK=${DSPARK:-.venv/bin/dspark}
STEPS=${STEPS:-400}
LIMIT=${LIMIT:-15}
TOKENS=${TOKENS:-64}
CFG=configs/smollm2-dspark.toml
mkdir -p runs

train() {  # name threads [--set ...]: one run of the shared recipe into runs/table1-NAME (resumes if rerun)
  local name=$1 threads=$2
  shift 2
  "$DSPARK" train --config "$CFG" --set "optim.max_steps=$STEPS" --set "run.out_dir=runs/table1-$name" \
    --set "run.threads=$threads" --set run.progress=false "$@" > "runs/table1-$name.log" 2>&1
}
