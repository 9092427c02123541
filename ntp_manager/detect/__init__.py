"""Fail-slow detection: find the slow GPU without mistaking long sequences for it (pure, layer 1).

Step observations (per rank: compute time, communication wait, tokens, sum of squared sequence
lengths, optional agent signals) in; verdicts with evidence out. See docs/failslow.md.

- `WorkloadDetector` (detector.py): a per-stage robust model of healthy compute time from the work,
  peer comparison, k-of-n hysteresis; separates slow GPUs from data imbalance and slow links.
- `ZScoreDetector` (baseline.py): the time-only baseline with the same interface.
- `adapt` (adapt.py): the ResiHP rule for a TP group with a slow member: keep, boost or exclude.
- `simulate` / `evaluate`: synthetic traces with ground truth and their scoring (tests, bench).
"""

from ntp_manager.detect.adapt import AdaptDecision, AdaptError, adapt
from ntp_manager.detect.baseline import ZScoreDetector
from ntp_manager.detect.detector import DetectorSnapshot, RankStatus, WorkloadDetector
from ntp_manager.detect.options import DetectorOptions, OptionsError, ZScoreOptions
from ntp_manager.detect.types import (
    DetectError,
    GpuSignals,
    RankObservation,
    StepObservation,
    throttle_names,
)
from ntp_manager.detect.verdicts import (
    Cleared,
    Imbalance,
    NetworkSlow,
    Recovered,
    Scope,
    Slow,
    SlowEvidence,
    Verdict,
    ZScoreEvidence,
    verdict_dict,
)

__all__ = [
    "AdaptDecision",
    "AdaptError",
    "Cleared",
    "DetectError",
    "DetectorOptions",
    "DetectorSnapshot",
    "GpuSignals",
    "Imbalance",
    "NetworkSlow",
    "OptionsError",
    "RankObservation",
    "RankStatus",
    "Recovered",
    "Scope",
    "Slow",
    "SlowEvidence",
    "StepObservation",
    "Verdict",
    "WorkloadDetector",
    "ZScoreDetector",
    "ZScoreEvidence",
    "ZScoreOptions",
    "adapt",
    "throttle_names",
    "verdict_dict",
]
