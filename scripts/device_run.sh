#!/usr/bin/env bash
# On a lent GPU machine (the device tool runs this in the repository root; $OUT comes back):
#   scripts/device_run.sh smoke          the GPU tests: our forward and training steps on CUDA against the CPU,
#                                        datagen's transformers backend on CUDA (carry .dev/gguf.a and wheels)
#   scripts/device_run.sh train TOTAL_S  the shipped-drafter recipe (scripts/train_default_drafter.sh) in
#                                        TOTAL_S seconds, results into $OUT (carry .dev/gguf.b and the pools)
# .dev/ is staged by scripts/device_prepare.sh; what an earlier call carried stays while the machine is warm.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
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
  train)
    total=${2:?train needs TOTAL_S}
    if [ ! -f .dev/target.gguf ]; then
      cat .dev/gguf.a .dev/gguf.b > .dev/target.gguf || exit 1
    fi
    echo "$(cat .dev/gguf.sha256)  .dev/target.gguf" | sha256sum -c - || exit 1
    for k in 1 2; do python3 -c "import lzma, sys; sys.stdout.write(lzma.open(sys.argv[1], 'rt').read())" \
      .dev/pool-$k.jsonl.xz > .dev/pool-$k.jsonl; done
    GGUF=.dev/target.gguf PROMPTS=".dev/pool-1.jsonl .dev/pool-2.jsonl" DEVICE=${DEVICE:-cuda} TOTAL_S=$total \
      RESULTS=$OUT WORK=/tmp/work THREADS=${THREADS:-6} scripts/train_default_drafter.sh 2>&1 | tee "$OUT/run.log"
    ;;
  *) echo "usage: scripts/device_run.sh smoke | train TOTAL_S"; exit 2 ;;
esac
