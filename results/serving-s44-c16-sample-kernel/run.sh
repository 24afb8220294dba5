# run from /work/main: old = worktree of 29b08fb (torch sampling), new = worktree of dc47331 (C sampling kernel)
set -x
for t in old new old new; do
  cd /tmp/s44/$t && PYTHONPATH=/tmp/s44/$t/src DSPARK_SHARED=/work/shared /work/main/.venv/bin/dspark bench serve --drafter dspark --dtype bfloat16 --policies none,async --concurrency 16 --requests-per-client 4 --max-new-tokens 64 --repeats 1 --temperature 1 --traces results/calibration-s34/traces.npz --out /tmp/s44/runs/c16-$t-$RANDOM
done
