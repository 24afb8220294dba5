#!/usr/bin/env bash
# On a lent GPU machine (the device tool runs this in the repository root; $OUT comes back):
# .dev/ is staged by scripts/device_prepare.sh; scripts/device_tree.sh slim makes room for it. Three calls, each
# within 30 s of the last (the machine stays warm that long), each carrying one part of .dev:
#   scripts/device_run.sh smoke          the GPU tests: our forward and training steps on CUDA against the CPU,
#                                        datagen's transformers backend on CUDA; carry .dev/gguf.a, the wheels
#   scripts/device_run.sh stash          carry .dev/gguf.b (kept in /tmp/stash for the next call)
#   scripts/device_run.sh train TOTAL_S  the shipped-drafter recipe (scripts/train_default_drafter.sh) in
#                                        TOTAL_S seconds, results into $OUT; carry .dev/pool-*.jsonl.xz,
#                                        .dev/gguf.sha256, .dev/init-drafter, .dev/extra-data.jsonl.xz
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/stash .dev
# What a call carries is gone at the next call; the machine's /tmp stays while it is warm. So every call
# keeps its .dev files in /tmp/stash and gets back those of earlier calls.
cp -r .dev/. /tmp/stash/ 2>/dev/null; cp -rn /tmp/stash/. .dev/
if [ ! -d /tmp/site/transformers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .dev/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD/tests/training
# transformers 5.24 (what the project pins) unless this machine's other packages refuse it: then its own.
python3 -c "import transformers" 2>/dev/null || { echo "carried transformers refused; using the machine's"
  rm -rf /tmp/site/transformers /tmp/site/transformers-*; }
export DSPARK_NATIVE=0  # the CPU kernels' tuning at each model load: no use on a GPU run
case ${1:-} in
  smoke)
    nvidia-smi -L; nproc; free -g | head -2; df -h /tmp | tail -1
    python3 -m pytest -q -rs -p no:cacheprovider tests/training/test_training_device.py \
      tests/training/test_training_datagen.py -k "gpu or transformers" 2>&1 | tee "$OUT/smoke.log"
    ;;
  stash) ls -la /tmp/stash ;;
  train)
    total=${2:?train needs TOTAL_S}
    if [ ! -f .dev/target.gguf ]; then
      cat .dev/gguf.a .dev/gguf.b > .dev/target.gguf || exit 1
    fi
    echo "$(cat .dev/gguf.sha256)  .dev/target.gguf" | sha256sum -c - || exit 1
    for k in 1 2; do python3 -c "import lzma, sys; sys.stdout.write(lzma.open(sys.argv[1], 'rt').read())" \
      .dev/pool-$k.jsonl.xz > .dev/pool-$k.jsonl; done
    [ -d .dev/init-drafter ] && export INIT_FROM=${INIT_FROM:-.dev/init-drafter}
    [ -f .dev/extra-data.jsonl.xz ] && export EXTRA_DATA=${EXTRA_DATA:-.dev/extra-data.jsonl.xz}
    GGUF=.dev/target.gguf PROMPTS=".dev/pool-1.jsonl .dev/pool-2.jsonl" DEVICE=${DEVICE:-cuda} TOTAL_S=$total \
      RESULTS=$OUT WORK=/tmp/work THREADS=${THREADS:-6} scripts/train_default_drafter.sh 2>&1 | tee "$OUT/run.log"
    ;;
  *) echo "usage: scripts/device_run.sh smoke | stash | train TOTAL_S"; exit 2 ;;
esac
