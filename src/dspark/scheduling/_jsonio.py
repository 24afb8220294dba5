"""Small shared helpers for the versioned files of this package (speed profiles, calibration, traces, rollouts).

Both files are caches or artefacts that other processes read while we may be rewriting them (an engine
restarting, a benchmark running next to a calibration job), so every write goes to a temporary file in the
same directory and is moved into place with ``os.replace`` — readers see the old file or the new one, never a
half-written one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


class FileFormatError(ValueError):
    """A file exists but is not a valid file of the expected kind/version; the message says where."""


def write_json_atomic(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: NaN/Infinity are not JSON and other tools (jq, JS) would reject the file.
    text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the result is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        # Never leave temp files behind, whatever went wrong (including KeyboardInterrupt).
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def read_json(path: str | os.PathLike, *, kind: str, error: type[FileFormatError] = FileFormatError) -> Any:
    """Parse JSON, turning syntax errors into FileFormatError that names the file, line and column."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not a valid {kind} JSON file (line {e.lineno}, column {e.colno}: {e.msg})") from e


def write_npz_atomic(path: str | os.PathLike, **arrays) -> Path:
    """np.savez_compressed through a temporary file in the same directory, moved into place."""
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.npz")  # np.savez appends .npz unless present; keep it explicit
    try:
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_header(obj: Any, path: str | os.PathLike, *, fmt: str, version: int | tuple[int, ...],
                 error: type[FileFormatError] = FileFormatError) -> None:
    """Validate the ``format``/``version`` header every file of ours starts with (raising ``error``);
    ``version`` may list every version this build reads."""
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object at top level, got {type(obj).__name__}")
    if obj.get("format") != fmt:
        raise error(f"{path}: 'format' is {obj.get('format')!r}, expected {fmt!r}")
    readable = version if isinstance(version, tuple) else (version,)
    if obj.get("version") not in readable:
        raise error(f"{path}: {fmt} version {obj.get('version')!r} is not supported "
                    f"(this build reads {', '.join(map(str, readable))})")


def finite_or_none(x: float) -> float | None:
    """JSON has no NaN; metrics that are undefined (e.g. AUC with one class) are stored as null."""
    x = float(x)
    return x if math.isfinite(x) else None


def none_to_nan(x: Any) -> float:
    return float("nan") if x is None else float(x)
