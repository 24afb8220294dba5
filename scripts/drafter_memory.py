"""What the drafter adds to the process's memory: resident set size after loading the target, then the drafter.

    .venv/bin/python scripts/drafter_memory.py --dtype bfloat16 --drafter dspark

Each load runs in a fresh interpreter (one per `--repeats`), so the numbers are not a previous load's leftovers;
RSS is read from /proc/self/status (Linux). To compare trees, run it with another checkout's `src` on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, sys, torch
torch.set_num_threads(2)
from dspark.drafters import make_drafter
from dspark.models import load_model

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # MiB
loaded = load_model(sys.argv[1], dtype=sys.argv[2])
target = rss()
drafter = make_drafter(sys.argv[3], target=loaded.model, gamma=7)
print(json.dumps({"target_mib": target, "with_drafter_mib": rss(), "profile_id": getattr(drafter, "profile_id", "")}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, args.dtype, args.drafter], check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    added = statistics.median(r["with_drafter_mib"] - r["target_mib"] for r in runs)
    print(json.dumps({"runs": runs, "drafter_added_mib_median": round(added, 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
