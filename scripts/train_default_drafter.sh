#!/usr/bin/env bash
# The recipe of the shipped SmolLM2 drafter on one GPU, in one time box (DESIGN.md §3):
#   1. regenerate answers to the training prompts with the target (transformers backend, padded batches; one
#      process per prompt file, in parallel),
#   2. train the DRAFTERS on these answers plus EXTRA_DATA (earlier sessions'): from scratch, DSpark (the shipped
#      kind) and DFlash (its baseline) side by side; with INIT_FROM, DSpark alone, going on from that drafter.
#      Each schedule is fitted to the time left (run.fit_steps_to_time), so its cosine ends in the box,
#   3. export them (bf16) and pack the results into $RESULTS in priority order (the logs and profiles, the first
#      drafter, this run's new answers, then the rest), within what may travel back from a lent machine.
# Every stage is time-boxed and resumable, so a cut-off run still returns what it finished.
#
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf PROMPTS="a.jsonl b.jsonl" DEVICE=cuda TOTAL_S=480 \
#     scripts/train_default_drafter.sh
# On a CPU, for a dry run: DEVICE=cpu LIMIT=8 MAX_NEW=16 BATCH_SEQS=2 TOTAL_S=240 scripts/train_default_drafter.sh
set -uo pipefail
GGUF=${GGUF:?set GGUF to the SmolLM2-135M-Instruct GGUF file (or a model directory)}
PROMPTS=${PROMPTS:?set PROMPTS to one or more prompt .jsonl files (one datagen process each)}
WORK=${WORK:-runs/default-drafter}
RESULTS=${RESULTS:-$WORK/results}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-480}         # the whole run, packing included
DATAGEN_SHARE=${DATAGEN_SHARE:-$([ -n "${EXTRA_DATA:-}" ] && echo 0.25 || echo 0.38)}  # of TOTAL_S for answer
                                # regeneration (less when earlier answers come along); training gets the rest
LIMIT=${LIMIT:-0}               # prompts per file (0 = all)
GEN_BATCH=${GEN_BATCH:-1024}    # conversations per chunk
GEN_TOKENS=${GEN_TOKENS:-700000} # rows x (prompt + MAX_NEW) per generate call: bounds the padded KV cache
MAX_NEW=${MAX_NEW:-512}
STEPS=${STEPS:-20000}           # an upper bound: the fitted schedule decides
BATCH_SEQS=${BATCH_SEQS:-64}  # session 32 ran 32: 0.50 s a step on an H200, likely launch-bound
THREADS=${THREADS:-4}
INIT_FROM=${INIT_FROM:-}         # an exported DSpark drafter to go on training (run.init_from), e.g. the shipped one
EXTRA_DATA=${EXTRA_DATA:-}       # earlier sessions' regenerated answers (.jsonl or .jsonl.xz), trained on too
DSPARK_LAYERS=${DSPARK_LAYERS:-$([ -n "$INIT_FROM" ] && echo 1 || echo 2)}  # must match INIT_FROM's
TF32=${TF32:-true}               # training's fp32 products in TF32 (session 32 ran without: 0.50 s a step)
PROFILE_STEPS=${PROFILE_STEPS:-3}  # steps 11-13 of each run under torch.profiler: <run>/profile.txt
DRAFTERS=${DRAFTERS:-$([ -n "$INIT_FROM" ] && echo dspark || echo "dspark dflash")}
RETURN_MB=${RETURN_MB:-60}      # what may come back (a lent machine returns 64 MiB in at most 8 files)
mkdir -p "$WORK" "$RESULTS"
start=$SECONDS
log() { echo "[$(date +%T) +$((SECONDS - start))s] $*"; }
left() { echo $((TOTAL_S - (SECONDS - start))); }

log "environment"; nvidia-smi -L 2>/dev/null
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"

log "convert the target"
$PY -c "from dspark.models import load_model; m = load_model('$GGUF'); print(m.hf_dir, m.config.num_layers)" || exit 1

datagen_s=$(awk "BEGIN {print int($TOTAL_S * $DATAGEN_SHARE)}")
box=$((datagen_s - (SECONDS - start)))
log "datagen: $(echo $PROMPTS | wc -w) processes, $box s"
n=0
for p in $PROMPTS; do  # timeout keeps every finished conversation: datagen resumes without duplicates
  n=$((n + 1))
  timeout "$box" $PY -m dspark.training datagen --backend transformers --device "$DEVICE" --model "$GGUF" \
    --prompts "$p" --out "$WORK/data-$n" --limit "$LIMIT" --batch-size "$GEN_BATCH" --batch-tokens "$GEN_TOKENS" \
    --max-new-tokens "$MAX_NEW" --temperature 0.7 --seed "$n" --no-progress > "$WORK/datagen-$n.log" 2>&1 &
done
wait
for d in "$WORK"/data-*; do log "$d: $(wc -l < "$d/data.jsonl") conversations"; tail -n 2 "${d/data-/datagen-}.log"; done
cat "$WORK"/data-*/data.jsonl > "$WORK/new.jsonl"
if [ -n "$EXTRA_DATA" ]; then
  $PY -c "import lzma, sys; p = sys.argv[1]; sys.stdout.write((lzma.open(p, 'rt') if p.endswith('.xz') else open(p)).read())" \
    "$EXTRA_DATA" > "$WORK/extra.jsonl" || exit 1
  log "extra data: $(wc -l < "$WORK/extra.jsonl") conversations from $EXTRA_DATA"
fi
cat "$WORK/new.jsonl" ${EXTRA_DATA:+"$WORK/extra.jsonl"} > "$WORK/train.jsonl"

train() {  # name, extra --set arguments...
  local name=$1; shift
  $PY -m dspark.training train --config configs/smollm2-dspark.toml --no-progress \
    --set target.name="$GGUF" --set target.device="$DEVICE" --set data.dataset="$WORK/train.jsonl" --set data.cache= \
    --set run.out_dir="$WORK/$name" --set run.max_time_s="$train_s" --set run.fit_steps_to_time=true \
    --set run.threads="$THREADS" --set optim.max_steps="$STEPS" --set optim.batch_seqs="$BATCH_SEQS" \
    --set optim.loss_chunk_blocks=256 --set run.log_every=10 --set run.ckpt_every=100000 \
    --set run.export_on_stop=true --set run.profile_steps="$PROFILE_STEPS" --set run.tf32="$TF32" "$@" \
    > "$WORK/$name.log" 2>&1
  log "train $name exit $?"
}
train_s=$(( $(left) - 75 ))  # loading and tokenizing before the clock starts, export and packing after it
log "train $DRAFTERS: $train_s s each"
for name in $DRAFTERS; do
  case $name in
    dspark) train dspark --set drafter.num_layers="$DSPARK_LAYERS" ${INIT_FROM:+--set run.init_from="$INIT_FROM"} & ;;
    dflash) train dflash --set drafter.type=dflash --set drafter.num_layers=2 & ;;
    eagle3) train eagle3 --set drafter.type=eagle3 & ;;
  esac
done
wait

log "pack"
for name in $DRAFTERS; do tail -n 3 "$WORK/$name.log"; done
$PY - "$WORK" "$RESULTS" "$RETURN_MB" $DRAFTERS <<'EOF'
import glob, io, lzma, os, sys, tarfile
work, results, budget, names = sys.argv[1], sys.argv[2], float(sys.argv[3]) * 2**20, sys.argv[4:]
with open(f"{work}/new.jsonl", "rb") as f, lzma.open(f"{work}/data.jsonl.xz", "wb", preset=6) as out:
    out.write(f.read())
logs = [p for n in names for p in (f"{n}.log", f"{n}/train_log.csv", f"{n}/profile.txt")] + sorted(
    os.path.relpath(p, work) for p in glob.glob(f"{work}/data-*/meta.json") + glob.glob(f"{work}/datagen-*.log"))
pieces = [("logs", logs), ("data", ["data.jsonl.xz"])] + [(n, [f"{n}/drafter"]) for n in names]
pieces.insert(1, pieces.pop(2))  # the first drafter (the shipped one) right after the logs
used, files = 0, 0
for name, paths in pieces:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in paths:
            if os.path.exists(f"{work}/{p}"):
                tar.add(f"{work}/{p}", arcname=p)
    data = buf.getvalue()
    parts = [data[i: i + 15 * 2**20] for i in range(0, len(data), 15 * 2**20)]
    if used + len(data) > budget or files + len(parts) > 7:  # the 8th file that comes back: run.log
        print(f"pack: {name} ({len(data) / 2**20:.1f} MiB) left behind: no room", flush=True)
        continue
    for i, part in enumerate(parts):
        with open(f"{results}/{name}.tar.part-{i}", "wb") as f:
            f.write(part)
    used, files = used + len(data), files + len(parts)
    print(f"pack: {name} {len(data) / 2**20:.1f} MiB in {len(parts)} file(s)", flush=True)
EOF
ls -la "$RESULTS"
log "done"
