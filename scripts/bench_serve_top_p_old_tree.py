"""`dspark bench serve` of a tree from before `--top-p` existed (session 29 and earlier), every request at one top-p:
the before side of a before/after serving measurement. Check out the old commit beside this one and put its
sources first:

    git worktree add /tmp/old 403441c
    PYTHONPATH=/tmp/old/src .venv/bin/python scripts/bench_serve_top_p_old_tree.py 0.9 bench serve --drafter dspark ...

The arguments after the top-p are `dspark`'s own.
"""
import functools
import sys

import dspark.bench.serving as serving
from dspark.cli import main
from dspark.decoding import SamplingParams

if __name__ == "__main__":
    print(f"dspark from {serving.__file__}", flush=True)
    serving.SamplingParams = functools.partial(SamplingParams, top_p=float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
