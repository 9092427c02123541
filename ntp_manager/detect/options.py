"""Knobs of the fail-slow detectors, validated so that an invalid set cannot exist.

Options are frozen; an operator's change (REST / ntpctl) builds a new object with
`opts.updated({"enter_margin": 0.15})`, which validates the result and names the first bad field,
and hands it to the running detector's `set_options`. The detector keeps its state (fits, windows,
verdicts); only the rules change from the next step on.

Hysteresis: a GPU is flagged when at least `enter_count` of its last `enter_window` step factors are
>= 1 + enter_margin, and cleared when at least `exit_count` of its last `exit_window` factors are
<= 1 + exit_margin. With exit_margin < enter_margin a GPU sitting at the threshold is flagged once
and stays flagged; it does not flap. Transient stalls shorter than `enter_count` steps never count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

MAX_WINDOW = 256  # per-rank memory is a fixed ring of this many steps at most


class OptionsError(ValueError):
    """An invalid option; the message names the field, the value and the rule."""


def _check_windows(o: Any) -> None:
    for name in ("enter_window", "exit_window"):
        v = getattr(o, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WINDOW:
            raise OptionsError(f"{name} must be an integer in 1..{MAX_WINDOW}, got {v!r}")
    for name, window in (("enter_count", "enter_window"), ("exit_count", "exit_window")):
        v = getattr(o, name)
        w = getattr(o, window)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= w:
            raise OptionsError(f"{name} must be an integer in 1..{window} ({w}), got {v!r}")
    if not isinstance(o.dry_run, bool):
        raise OptionsError(f"dry_run must be true or false, got {o.dry_run!r}")


def _check_float(o: Any, name: str, lo: float, hi: float, *, lo_open: bool = True) -> None:
    v = getattr(o, name)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise OptionsError(f"{name} must be a finite number, got {v!r}")
    if (v <= lo if lo_open else v < lo) or v > hi:
        bound = "(" if lo_open else "["
        raise OptionsError(f"{name} must be in {bound}{lo:g}, {hi:g}], got {v!r}")


def _check_int(o: Any, name: str, lo: int, hi: int) -> None:
    v = getattr(o, name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise OptionsError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")


class _Updatable:
    """Shared helpers: partial updates from a mapping (REST body) and a plain dict view."""

    __slots__ = ()

    def updated(self, changes: Mapping[str, object]) -> Self:
        """A validated copy with `changes` applied; unknown names raise OptionsError."""
        names = {f.name for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        unknown = sorted(set(changes) - names)
        if unknown:
            raise OptionsError(f"unknown option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        try:
            return dataclasses.replace(self, **changes)  # type: ignore[type-var]
        except TypeError as e:  # pragma: no cover - replace() only raises this for bad names
            raise OptionsError(str(e)) from None

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)  # type: ignore[call-overload, no-any-return]


@dataclass(frozen=True, slots=True)
class DetectorOptions(_Updatable):
    """Options of the workload-aware detector (`WorkloadDetector`).

    Factors are ratios of observed to predicted compute time, relative to the stage's peers:
    1.0 is a healthy GPU, 1.25 one that takes 25% longer for the same work.
    """

    enter_margin: float = 0.10  # flag at factor >= 1.10 (ResiHP uses 0.25; see docs/failslow.md)
    exit_margin: float = 0.05  # clear at factor <= 1.05
    enter_window: int = 6
    enter_count: int = 4  # 4 of the last 6 steps above: 1-3 step stalls never flag
    exit_window: int = 10
    exit_count: int = 8
    imbalance_margin: float = 0.12  # a TP group given >= 12% more work than its stage's median...
    imbalance_window: int = 20  # ...in most of the last 20 steps is reported as data imbalance
    network_margin: float = 0.30  # a group whose own transfer time is >= 1.3x its prediction...
    network_exit_margin: float = 0.15
    baseline_window: int = 64  # healthy steps a GPU's own usual pace is the median of...
    baseline_min: int = 16  # ...once it has this many (until then: 1.0)
    baseline_limit: float = 0.05  # ...clamped to 1 +- this, so it never excuses a real slowdown
    min_peers: int = 4  # ranks a job needs for peer comparison; fewer: the model alone
    fit_window: int = 512  # rows per stage in the robust fit (bounded memory)
    warmup_rows: int = 24  # rows a stage's fit needs before any verdict
    huber_k: float = 2.0  # residuals beyond k robust sigmas get down-weighted (Huber)
    factor_update: float = 0.05  # re-issue Slow when a flagged GPU's factor moves this much
    idle_expiry_steps: int = 1000  # forget a GPU not seen for this many steps (bounded memory)
    max_ranks: int = 1_000_000  # a step with more ranks is refused
    dry_run: bool = False  # verdicts are marked dry_run: report only, act on nothing

    def __post_init__(self) -> None:
        _check_float(self, "enter_margin", 0.0, 10.0)
        _check_float(self, "exit_margin", 0.0, 10.0, lo_open=False)
        if self.exit_margin >= self.enter_margin:
            raise OptionsError(
                f"exit_margin ({self.exit_margin}) must be below enter_margin ({self.enter_margin}) "
                "so that a GPU at the threshold does not flap"
            )
        _check_windows(self)
        _check_float(self, "imbalance_margin", 0.0, 10.0)
        _check_int(self, "imbalance_window", 1, MAX_WINDOW)
        _check_float(self, "network_margin", 0.0, 100.0)
        _check_float(self, "network_exit_margin", 0.0, 100.0, lo_open=False)
        if self.network_exit_margin >= self.network_margin:
            raise OptionsError(
                f"network_exit_margin ({self.network_exit_margin}) must be below network_margin "
                f"({self.network_margin})"
            )
        _check_int(self, "baseline_window", 1, 4 * MAX_WINDOW)
        _check_int(self, "baseline_min", 1, self.baseline_window)
        _check_float(self, "baseline_limit", 0.0, 0.5, lo_open=False)
        _check_int(self, "min_peers", 2, 1_000_000)
        _check_int(self, "fit_window", 8, 65_536)
        _check_int(self, "warmup_rows", 4, self.fit_window)
        _check_float(self, "huber_k", 0.5, 100.0, lo_open=False)
        _check_float(self, "factor_update", 0.0, 10.0)
        _check_int(self, "idle_expiry_steps", 1, 10**9)
        _check_int(self, "max_ranks", 1, 100_000_000)


@dataclass(frozen=True, slots=True)
class ZScoreOptions(_Updatable):
    """Options of the time-only baseline (`ZScoreDetector`): a rank is flagged when its compute
    time's robust z-score among its stage's ranks is >= z_enter in `enter_count` of the last
    `enter_window` steps, cleared when it is <= z_exit in `exit_count` of the last `exit_window`."""

    z_enter: float = 3.0
    z_exit: float = 1.5
    enter_window: int = 6
    enter_count: int = 4
    exit_window: int = 10
    exit_count: int = 8
    mad_floor: float = 0.01  # the spread is at least this fraction of the median (no divide by ~0)
    min_peers: int = 4
    factor_update: float = 0.05
    idle_expiry_steps: int = 1000
    max_ranks: int = 1_000_000
    dry_run: bool = False

    def __post_init__(self) -> None:
        _check_float(self, "z_enter", 0.0, 1000.0)
        _check_float(self, "z_exit", -1000.0, 1000.0)
        if self.z_exit >= self.z_enter:
            raise OptionsError(f"z_exit ({self.z_exit}) must be below z_enter ({self.z_enter})")
        _check_windows(self)
        _check_float(self, "mad_floor", 0.0, 1.0)
        _check_int(self, "min_peers", 2, 1_000_000)
        _check_float(self, "factor_update", 0.0, 10.0)
        _check_int(self, "idle_expiry_steps", 1, 10**9)
        _check_int(self, "max_ranks", 1, 100_000_000)
