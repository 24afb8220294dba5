"""Training logs: a CSV file (one row per logged step, resumable) and a progress bar."""
from __future__ import annotations

import csv
import os
import time
from pathlib import Path


class CsvLog:
    """Appends rows; on resume, rows past the resumed step (logged after the last checkpoint) are dropped so a
    step never appears twice."""

    def __init__(self, path: str | Path, resume_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fields: list[str] | None = None
        if self.path.exists():
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            keep = [r for r in rows if int(r.get("step", 0)) <= resume_step]
            self.fields = list(rows[0].keys()) if rows else None
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            with open(tmp, "w", newline="") as f:
                if self.fields:
                    writer = csv.DictWriter(f, self.fields)
                    writer.writeheader()
                    writer.writerows(keep)
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, self.fields, extrasaction="ignore") if self.fields else None

    def write(self, row: dict) -> None:
        if self._writer is None:
            self.fields = list(row.keys())
            self._writer = csv.DictWriter(self._file, self.fields, extrasaction="ignore")
            self._writer.writeheader()
        self._writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def progress_bar(total: int, initial: int, enabled: bool, desc: str = "train"):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", desc=desc, disable=not enabled, dynamic_ncols=True)


def plot_log(csv_path: str | Path, png_path: str | Path, window: int = 20) -> Path:
    """Loss, estimated τ and slot-1 acceptance against step (moving averages over `window` logged rows)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{csv_path} has no logged steps")
    steps = [int(r["step"]) for r in rows]

    def smooth(key: str) -> list[float]:
        vals = [float(r[key]) for r in rows]
        return [sum(vals[max(0, i - window + 1): i + 1]) / len(vals[max(0, i - window + 1): i + 1])
                for i in range(len(vals))]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for ax, keys, title in ((axes[0], ("loss", "tv"), "loss"), (axes[1], ("tau_est",), "estimated τ (full block)"),
                            (axes[2], ("acc1", "acc2", "acc7"), "estimated acceptance per slot")):
        for key in keys:
            if key in rows[0]:
                ax.plot(steps, smooth(key), label=key)
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


class StepProfiler:
    """torch.profiler over the next `steps` training steps; writes where their time went (CPU and, on a GPU,
    device operators, top 40 by self time) to `path`, so a run on a lent machine reports its own breakdown."""

    def __init__(self, device, steps: int, path):
        from torch.profiler import ProfilerActivity, profile

        self.cuda, self.left, self.path = device.type == "cuda", steps, Path(path)
        self.t0, self.first = time.perf_counter(), None
        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []))
        self.prof.__enter__()

    def stepped(self, step: int) -> bool:
        """After each step; True once the profile is written."""
        self.first = step if self.first is None else self.first
        self.left -= 1
        if self.left > 0:
            return False
        self.stop(step)
        return True

    def stop(self, step: int) -> None:
        self.prof.__exit__(None, None, None)
        wall = time.perf_counter() - self.t0
        key = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = self.prof.key_averages().table(sort_by=key, row_limit=40)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(f"steps {self.first}-{step}: {wall:.2f} s wall under the profiler\n{table}\n")
