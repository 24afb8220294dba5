"""Reports built on calibration data: the static-threshold sweep (paper Figure 5), reliability diagrams (PNG)
and a Markdown table of per-position metrics. Kept apart from calibration.py so the engine's import path (which
only needs ``Calibration.apply``) never touches plotting code.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ._jsonio import finite_or_none, write_json_atomic
from .calibration import Calibration, prefix_events
from .metrics import reliability_bins
from .policies import static_threshold


@dataclass(frozen=True)
class ThresholdPoint:
    threshold: float
    mean_verified: float  # mean drafts verified per request-step (ℓ)
    acceptance_rate: float  # accepted drafts / verified drafts (NaN when nothing is verified)
    tau: float  # mean tokens emitted per request-step = mean(min(n_acc, ℓ)) + 1


def threshold_sweep(conf, n_acc, thresholds: Sequence[float] | None = None, *,
                    cumulative: bool = False) -> list[ThresholdPoint]:
    """For each threshold, what the static per-slot threshold policy would verify and accept on recorded rounds.

    ``conf`` [N, γ] calibrated per-slot confidences, ``n_acc`` [N] accepted drafts when the full block was
    verified; verifying only ℓ drafts accepts min(n_acc, ℓ) of them, because acceptance is left to right.
    """
    conf = np.asarray(conf, dtype=np.float64)
    n_acc = np.asarray(n_acc)
    prefix_events(n_acc, conf.shape[1])  # validates n_acc against γ
    grid = np.linspace(0.0, 1.0, 21) if thresholds is None else np.asarray(thresholds, dtype=np.float64)
    out = []
    for thr in grid:
        ell = static_threshold(conf, float(thr), cumulative=cumulative)
        acc = np.minimum(n_acc, ell)
        rate = float(acc.sum() / ell.sum()) if ell.sum() else float("nan")
        out.append(ThresholdPoint(float(thr), float(ell.mean()), rate, float(acc.mean() + 1.0)))
    return out


def metrics_table(cal: Calibration) -> str:
    """Markdown table: per position k, ECE / ROC-AUC / Brier before -> after, the fitted temperature and shift, the
    ECE floor: what a perfectly calibrated predictor would show with the same confidences and number of rounds."""
    lines = ["| k | T_k | b_k | ECE before | ECE after | ECE floor | AUC before | AUC after | Brier before "
             "| Brier after |",
             "|---|-----|-----|-----------|----------|----------|-----------|----------|-------------|------------|"]
    for k, (t, shift) in enumerate(zip(cal.temperatures, cal.shifts)):
        b = cal.before[k] if k < len(cal.before) else None
        a = cal.after[k] if k < len(cal.after) else None

        def f(m, attr: str, pct: bool = False) -> str:
            if m is None:
                return "–"
            v = getattr(m, attr)
            return f"{100 * v:.2f}%" if pct else f"{v:.4f}"

        lines.append(f"| {k + 1} | {t:.3f} | {shift:+.2f} | {f(b, 'ece', True)} | {f(a, 'ece', True)} | "
                     f"{f(a, 'ece_floor', True)} | "
                     f"{f(b, 'auc')} | "
                     f"{f(a, 'auc')} | {f(b, 'brier')} | {f(a, 'brier')} |")
    return "\n".join(lines)


def write_reliability_diagram(cal: Calibration, logits, n_acc, path: str | os.PathLike, *, title: str = "") -> Path:
    """One panel per block position: observed frequency of "slots 1..k accepted" against the predicted cumulative
    confidence, raw (T = 1) and after STS. Needs matplotlib (imported here so the package does not)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # object API: no global pyplot state, safe in servers and threads

    L = np.asarray(logits, dtype=np.float64)
    y = prefix_events(n_acc, L.shape[1])
    raw = np.cumprod(Calibration.identity(L.shape[1]).apply(L), axis=1)
    fitted = np.cumprod(cal.apply(L), axis=1)
    gamma = L.shape[1]
    cols = min(gamma, 4)
    rows = -(-gamma // cols)
    fig = Figure(figsize=(3.2 * cols, 3.2 * rows))
    FigureCanvasAgg(fig)
    for k in range(gamma):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
        for pred, label, color in ((raw[:, k], "raw", "tab:red"), (fitted[:, k], "STS", "tab:blue")):
            mp, fr, cnt = reliability_bins(pred, y[:, k], cal.n_bins)
            keep = cnt >= 20  # a bin of a handful of rounds is noise, not miscalibration; don't draw it
            ax.plot(mp[keep], fr[keep], marker="o", ms=3, color=color, label=label)
        ax.set_title(f"position {k + 1} (T={cal.temperatures[k]:.2f})", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        if k % cols == 0:
            ax.set_ylabel("observed P(slots 1..k accepted)", fontsize=8)
        if k >= gamma - cols:
            ax.set_xlabel("predicted cumulative confidence", fontsize=8)
        if k == 0:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def write_calibration_report(cal: Calibration, logits, n_acc, out_dir: str | os.PathLike, *,
                             thresholds: Sequence[float] | None = None) -> dict[str, Path]:
    """Everything ``dspark calibrate`` reports, in ``out_dir``: calibration.json, calibration_metrics.md,
    threshold_sweep.json (Figure 5, on the calibrated confidences of these rounds) and reliability.png
    (skipped, with no error, when matplotlib is not installed). Returns name -> path."""
    out = Path(out_dir)
    paths = {"calibration": cal.save(out / "calibration.json")}
    md = out / "calibration_metrics.md"
    md.write_text(metrics_table(cal) + "\n", encoding="utf-8")
    paths["metrics"] = md
    sweep = threshold_sweep(cal.apply(np.asarray(logits, dtype=np.float64)), n_acc, thresholds)
    rows = [{k: finite_or_none(v) for k, v in asdict(p).items()} for p in sweep]
    paths["threshold_sweep"] = write_json_atomic(out / "threshold_sweep.json", {"points": rows})
    try:
        paths["reliability"] = write_reliability_diagram(cal, logits, n_acc, out / "reliability.png")
    except ImportError:
        pass
    return paths
