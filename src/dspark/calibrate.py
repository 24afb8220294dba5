"""`dspark calibrate`: fit Sequential Temperature Scaling on held-out rollouts and save it with the drafter.

Rollouts run through the batched engine at full block (fixed-γ: every draft verified), recording each round's
raw confidence logits [γ] and how many drafts the target accepted. Requests are split in two halves (rounds of
one request are correlated, so the split is by request): STS is fitted on one half and every metric — ECE,
ROC-AUC, Brier per position, before and after — is measured on the other. The temperatures go into the
drafter's calibration.json, which the drafter then applies; the report (metrics table, reliability diagram,
static-threshold sweep), the calibrated acceptance traces (the simulator's input) and the raw rollouts
(rollouts.npz: refit later with --from-rollouts, without running the models) go to --out.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .decoding import SamplingParams
from .engine.engine import Engine, EngineConfig
from .generate import prompt_ids
from .models import load_model
from .scheduling.calibration import Calibration, evaluate, fit_sts
from .scheduling.registry import make_policy


@dataclass(frozen=True)
class CalibrateConfig:
    drafter: str
    prompts: str
    model: str = "smollm2-135m-instruct"
    limit: int = 200
    skip: int = 0  # leave the first N prompts out (e.g. those the drafter was trained on)
    temperature: float = 1.0
    max_new_tokens: int = 256
    batch: int = 16
    seed: int = 0
    out: Path = Path("results/calibration")
    shift: bool = True  # also fit a per-position shift (False: the paper's temperature-only STS)
    from_rollouts: Path | None = None  # refit from a saved rollouts.npz instead of running the models
    skip_bad: bool = False  # skip malformed prompt lines instead of failing


def read_turns(path: str, skip: int, limit: int, skip_bad: bool = False) -> list[str]:
    """First user turns of a prompt file ({"turns": [...]}, {"messages": [...]} or {"prompt": ...}); malformed
    lines are an error naming them unless ``skip_bad`` (as in `dspark datagen`)."""
    from .training.conversations import read_prompts

    records, _ = read_prompts(path, skip_bad=skip_bad, limit=skip + limit)
    return [r.turns[0] for r in records[skip:]]


def rollouts(loaded, drafter, texts: list[str], cfg: CalibrateConfig):
    """-> per request: (raw logits [rounds, γ], n_acc [rounds]) over full-length rounds only."""
    gamma = drafter.gamma
    engine = Engine(loaded.model, loaded.tokenizer, drafter, make_policy(f"fixed-{gamma}"), loaded.eos_ids,
                    EngineConfig(gamma=gamma, max_running=cfg.batch, record_confidences=True))
    reqs = [engine.add_request(prompt_ids(loaded.tokenizer, t, True),
                               SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                              seed=cfg.seed + i)) for i, t in enumerate(texts)]
    from tqdm import tqdm  # a dependency of transformers

    with tqdm(total=len(reqs), unit="req", desc="calibration rollouts", dynamic_ncols=True) as bar:
        while any(not r.finished for r in reqs):
            engine.step()
            bar.update(sum(r.finished for r in reqs) - bar.n)
    out = []
    for r in reqs:
        full = [(c, a) for c, v, a in zip(r.confidence_hist, r.verified_hist, r.accepted_hist) if v == gamma]
        logits = np.array([c for c, _ in full], dtype=np.float64).reshape(-1, gamma)
        out.append((logits, np.array([a for _, a in full], dtype=np.int64)))
    return out


def split_halves(per_request):
    """Requests alternate between the fitting half and the held-out half."""
    def cat(part):
        gamma = per_request[0][0].shape[1]
        return (np.concatenate([p[0] for p in part]) if part else np.zeros((0, gamma)),
                np.concatenate([p[1] for p in part]) if part else np.zeros(0, dtype=np.int64))
    return cat(per_request[0::2]), cat(per_request[1::2])


ROLLOUTS_VERSION = 1


def save_rollouts(path: Path, fit, held, requests: int) -> None:
    """Raw confidence logits and accepted counts of both halves (written atomically)."""
    from .scheduling._jsonio import write_npz_atomic

    write_npz_atomic(path, version=ROLLOUTS_VERSION, fit_logits=fit[0], fit_n_acc=fit[1], held_logits=held[0],
                     held_n_acc=held[1], requests=requests)


def load_rollouts(path: Path):
    """-> (fit_logits, fit_n_acc), (held_logits, held_n_acc), requests; a clear error for anything else."""
    keys = ("fit_logits", "fit_n_acc", "held_logits", "held_n_acc", "requests")
    try:
        with np.load(path) as z:
            if int(z["version"]) != ROLLOUTS_VERSION:
                raise ValueError(f"{path}: rollouts version {int(z['version'])}, this build reads {ROLLOUTS_VERSION}")
            fit_l, fit_n, held_l, held_n, requests = (z[k] for k in keys)
    except (OSError, KeyError, ValueError, EOFError) as e:
        raise ValueError(f"{path}: not a rollouts.npz written by `dspark calibrate` (needs {', '.join(keys)}): "
                         f"{e}") from e
    return (fit_l, fit_n), (held_l, held_n), int(requests)


def _roll_out(cfg: CalibrateConfig):
    from .drafters import make_drafter
    from .drafters.base import unknown_options

    texts = read_turns(cfg.prompts, cfg.skip, cfg.limit, cfg.skip_bad)  # reported before the model loads
    if len(texts) < 4:
        raise ValueError(f"{cfg.prompts}: {len(texts)} usable prompts after --skip {cfg.skip}; need at least 4")
    loaded = load_model(cfg.model)
    # Raw confidences, and no calibration.json read at all (calibrate is how a stale or broken one is replaced);
    # a drafter that takes no such option (n-gram) has no confidence head, refused just below.
    skip_saved = {} if unknown_options(cfg.drafter, ["calibration"]) else {"calibration": False}
    drafter = make_drafter(cfg.drafter, target=loaded.model, **skip_saved)
    if drafter is None or not drafter.has_confidence:
        raise ValueError(f"{cfg.drafter} has no confidence head: nothing to calibrate (DFlash/n-gram drafters "
                         f"work with the fixed-K policies only)")
    fit, held = split_halves(rollouts(loaded, drafter, texts, cfg))
    save_rollouts(cfg.out / "rollouts.npz", fit, held, len(texts))
    return fit, held, len(texts)


def run(cfg: CalibrateConfig) -> dict:
    from .scheduling.calibration_report import metrics_table, write_calibration_report
    from .scheduling.traces import from_rollouts

    t0 = time.perf_counter()
    if cfg.from_rollouts is not None:
        (fit_l, fit_n), (held_l, held_n), requests = load_rollouts(cfg.from_rollouts)
    else:
        (fit_l, fit_n), (held_l, held_n), requests = _roll_out(cfg)
    seconds = time.perf_counter() - t0
    if len(fit_l) == 0 or len(held_l) == 0:
        raise ValueError("the rollouts produced no full-length rounds; use more prompts or --max-new-tokens")
    fitted = fit_sts(fit_l, fit_n, shift=cfg.shift)
    gamma = fit_l.shape[1]
    held = replace(fitted, before=evaluate(Calibration.identity(gamma), held_l, held_n),
                   after=evaluate(fitted, held_l, held_n), n_rounds=len(held_l))
    paths = write_calibration_report(held, held_l, held_n, cfg.out)
    held.save(Path(cfg.drafter) / "calibration.json")  # the drafter applies it from now on
    all_l, all_n = np.concatenate([fit_l, held_l]), np.concatenate([fit_n, held_n])
    from_rollouts(all_l, all_n, fitted).save(cfg.out / "traces.npz")
    summary = {"drafter": cfg.drafter, "prompts": cfg.prompts, "requests": requests, "shift": cfg.shift,
               "from_rollouts": None if cfg.from_rollouts is None else str(cfg.from_rollouts),
               "fit_rounds": int(len(fit_l)), "heldout_rounds": int(len(held_l)),
               "temperature": cfg.temperature, "seconds": round(seconds, 1),
               "tau_full_block": float(all_n.mean() + 1), "temperatures": list(fitted.temperatures),
               "shifts": list(fitted.shifts),
               "max_ece_before": max(m.ece for m in held.before), "max_ece_after": max(m.ece for m in held.after),
               "files": {k: str(v) for k, v in paths.items()}}
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(metrics_table(held))
    print(json.dumps({k: v for k, v in summary.items() if k != "files"}))
    return summary
