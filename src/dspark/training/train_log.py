"""Training logs: a CSV file (one row per logged step, resumable) and a progress bar."""
from __future__ import annotations

import csv
import os
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
