"""Scheduling: hardware speed profile, verification-length policies, STS calibration, serving simulator.

Pure numpy; no torch needed at import time (torch tensors are accepted where documented). Dependency direction:
profile <- policies <- policy_objects, async_policy <- registry <- simulator; calibration <- traces <- simulator.
"""

from .calibration import Calibration, CalibrationFormatError, evaluate, fit_sts, prefix_events
from .calibration_report import (
    ThresholdPoint,
    metrics_table,
    threshold_sweep,
    write_calibration_report,
    write_reliability_diagram,
)
from .metrics import PositionMetrics, brier, ece, reliability_bins, roc_auc
from .policies import (
    as_confidences,
    async_capacity,
    async_schedule,
    bench_policy_latency,
    fixed_k,
    static_threshold,
    survival,
    sync_prefix_schedule,
    sync_prefix_schedule_unsafe_no_early_stop,
)
from .profile import ProfileKey, SpeedProfile, current_machine
from .profile_measure import measure_profile
from .profile_io import ProfileFormatError, load_cached_profile, load_or_measure, load_profile_table, save_profile
from .registry import (
    CONFIDENCE_FREE,
    POLICIES,
    AsyncPolicy,
    ConfidenceRequiredError,
    FixedPolicy,
    SyncPolicy,
    ThresholdPolicy,
    make_policy,
)
from .simulator import (
    ClosedLoop,
    Poisson,
    SimResult,
    default_policies,
    format_sweep,
    gpu_like_profile,
    simulate,
    sweep,
    write_sweep_plot,
)
from .traces import AcceptanceTraces, from_rollouts, synthetic_traces

__all__ = [
    "AcceptanceTraces", "AsyncPolicy", "CONFIDENCE_FREE", "Calibration", "CalibrationFormatError", "ClosedLoop",
    "ConfidenceRequiredError", "FixedPolicy", "POLICIES", "Poisson", "PositionMetrics", "ProfileFormatError",
    "ProfileKey", "SimResult", "SpeedProfile", "SyncPolicy", "ThresholdPoint", "ThresholdPolicy", "as_confidences",
    "async_capacity", "async_schedule", "bench_policy_latency", "brier", "current_machine", "default_policies",
    "ece", "evaluate", "fit_sts", "fixed_k", "format_sweep", "from_rollouts", "gpu_like_profile",
    "load_cached_profile", "load_or_measure", "load_profile_table", "make_policy", "measure_profile",
    "metrics_table", "prefix_events",
    "reliability_bins", "roc_auc", "save_profile", "simulate", "static_threshold", "survival", "sweep",
    "sync_prefix_schedule", "sync_prefix_schedule_unsafe_no_early_stop", "threshold_sweep",
    "write_calibration_report", "write_reliability_diagram", "write_sweep_plot",
]
