#!/usr/bin/env bash
# The recipe of the shipped SmolLM2 drafters, sized for one GPU in about ten minutes (DESIGN.md §3):
#   1. regenerate answers to the training prompts with the target (transformers backend, padded batches),
#   2. train DSpark (the shipped drafter) and the DFlash and Eagle3 baselines side by side, same data and budget,
#   3. export both (bf16) and pack the results into $RESULTS.
# Every stage is time-boxed and resumable, so a cut-off run still returns what it finished.
#
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf PROMPTS="a.jsonl b.jsonl" DEVICE=cuda scripts/train_default_drafter.sh
# On a CPU, for a dry run: DEVICE=cpu LIMIT=8 MAX_NEW=16 STEPS=2 BATCH_SEQS=2 scripts/train_default_drafter.sh
set -uo pipefail
GGUF=${GGUF:?set GGUF to the SmolLM2-135M-Instruct GGUF file}
PROMPTS=${PROMPTS:?set PROMPTS to one or more prompt .jsonl files}
WORK=${WORK:-runs/default-drafter}
RESULTS=${RESULTS:-$WORK/results}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-0}            # prompts per file (0 = all)
GEN_BATCH=${GEN_BATCH:-1024} # conversations per generate call
MAX_NEW=${MAX_NEW:-512}
DATAGEN_S=${DATAGEN_S:-200}  # time box of answer regeneration
TRAIN_S=${TRAIN_S:-240}      # time box of each training run
STEPS=${STEPS:-1500}
BATCH_SEQS=${BATCH_SEQS:-32}
THREADS=${THREADS:-4}
mkdir -p "$WORK" "$RESULTS"
log() { echo "[$(date +%T)] $*"; }

log "environment"; nvidia-smi -L 2>/dev/null; $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"

log "convert the target"
$PY -c "from dspark.models import load_model; m = load_model('$GGUF'); print(m.hf_dir, m.config.num_layers)" || exit 1

n=0
deadline=$((SECONDS + DATAGEN_S))  # one time box for all prompt files, taken in order
for p in $PROMPTS; do
  n=$((n + 1)); left=$((deadline - SECONDS))
  [ "$left" -gt 5 ] || break
  log "datagen $p ($left s left)"
  # timeout keeps every finished chunk: datagen resumes without duplicates.
  timeout "$left" $PY -m dspark.training datagen --backend transformers --device "$DEVICE" --model "$GGUF" \
    --prompts "$p" --out "$WORK/data-$n" --limit "$LIMIT" --batch-size "$GEN_BATCH" --max-new-tokens "$MAX_NEW" \
    --temperature 0.7 --seed "$n" --no-progress
  log "datagen exit $? ; $(wc -l < "$WORK/data-$n/data.jsonl") conversations"
done
cat "$WORK"/data-*/data.jsonl > "$WORK/train.jsonl"

train() {  # name, config, extra --set arguments...
  local name=$1 config=$2; shift 2
  $PY -m dspark.training train --config "$config" --no-progress \
    --set target.name="$GGUF" --set target.device="$DEVICE" --set data.dataset="$WORK/train.jsonl" --set data.cache= \
    --set run.out_dir="$WORK/$name" --set run.max_time_s="$TRAIN_S" --set run.threads="$THREADS" \
    --set optim.max_steps="$STEPS" --set optim.batch_seqs="$BATCH_SEQS" --set optim.loss_chunk_blocks=256 \
    --set run.log_every=10 --set run.ckpt_every=100000 --set run.export_on_stop=true "$@" \
    > "$WORK/$name.log" 2>&1
  log "train $name exit $?"
}
log "train"
train dspark configs/smollm2-dspark.toml --set drafter.num_layers=2 &
train dflash configs/smollm2-dspark.toml --set drafter.type=dflash --set drafter.num_layers=2 &
train eagle3 configs/smollm2-dspark.toml --set drafter.type=eagle3 &
wait

log "pack"
for name in dspark dflash eagle3; do tail -n 3 "$WORK/$name.log"; done
xz -T0 -6 -c "$WORK/train.jsonl" > "$WORK/data.jsonl.xz"
# One bundle, in pieces of at most 15 MB (what may travel back from a lent machine).
(cd "$WORK" && tar -cf - {dspark,dflash,eagle3}/drafter {dspark,dflash,eagle3}/train_log.csv {dspark,dflash,eagle3}.log \
  data-*/meta.json data.jsonl.xz) | split -b 15M - "$RESULTS/bundle.part-"
ls -la "$RESULTS"
log "done"
