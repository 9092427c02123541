"""The time-only baseline: a rank is slow when its compute time is an outlier among its stage's ranks.

In the spirit of Greyhound / Falcon and of nvidia-resiliency-ext's straggler score: no model of
the work, only the peers' times. Per step and stage, a robust z-score
    z = (t - median) / max(1.4826 * MAD, mad_floor * median)
and the same k-of-n hysteresis as the workload-aware detector (detect/window.py). Its factor is
the time over the stage's median. It sees what every time-only detector sees: a rank given longer
sequences looks exactly like a slow GPU, and a GPU slowed by 20% hides in the spread that
variable sequence lengths put between the replicas. It shares the `observe` interface and the
verdict types, so the evaluation runs both on the same traces.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from ntp_manager.detect.model import group_median
from ntp_manager.detect.options import OptionsError, ZScoreOptions
from ntp_manager.detect.types import DetectError, StepObservation
from ntp_manager.detect.verdicts import Recovered, Scope, Slow, Verdict, ZScoreEvidence
from ntp_manager.detect.window import Rule, Tracker

_MAD_TO_SIGMA = 1.4826


class ZScoreDetector:
    """Stateful baseline; feed it steps in increasing order."""

    def __init__(self, options: ZScoreOptions | None = None) -> None:
        self._opts = options or ZScoreOptions()
        cap = max(self._opts.enter_window, self._opts.exit_window)
        self._z = Tracker(cap)
        self._factor = Tracker(cap)
        self._last_step: int | None = None

    @property
    def options(self) -> ZScoreOptions:
        return self._opts

    def set_options(self, options: ZScoreOptions) -> None:
        if not isinstance(options, ZScoreOptions):
            raise OptionsError(f"expected ZScoreOptions, got {type(options).__name__}")
        cap = max(options.enter_window, options.exit_window)
        self._z.resize(cap)
        self._factor.resize(cap)
        self._opts = options

    def forget(self, gpus: Iterable[str]) -> list[str]:
        gpus = list(gpus)
        flagged = set(self._z.flagged())
        self._z.forget(gpus)
        self._factor.forget(gpus)
        return [g for g in gpus if g in flagged]

    def flagged(self) -> list[str]:
        return self._z.flagged()

    def observe(self, obs: StepObservation) -> list[Verdict]:
        o = self._opts
        cols = obs.columns(o.max_ranks)
        if self._last_step is not None and obs.step <= self._last_step:
            raise DetectError(f"step {obs.step} is not after the last observed step {self._last_step}")
        self._last_step = step = obs.step
        ranks = cols.ranks
        if step % 64 == 0:
            self._z.expire(step, o.idle_expiry_steps)
            self._factor.expire(step, o.idle_expiry_steps)
        if not ranks:
            return []
        t = cols.compute * cols.speed
        stage_of = cols.g_stage[cols.gidx]
        stages, sidx = np.unique(stage_of, return_inverse=True)
        ns = len(stages)
        med = group_median(t, sidx, ns)
        mad = group_median(np.abs(t - med[sidx]), sidx, ns)
        sigma = np.maximum(_MAD_TO_SIGMA * mad, o.mad_floor * med)
        count = np.bincount(sidx, minlength=ns)
        z = (t - med[sidx]) / sigma[sidx]
        factor = t / med[sidx]
        ok = count[sidx] >= o.min_peers
        idx = np.nonzero(ok)[0]
        keys = [ranks[i].gpu for i in idx.tolist()]
        slots = self._z.slots_for(keys)
        fslots = self._factor.slots_for(keys)
        self._z.push(slots, z[idx], step)
        self._factor.push(fslots, factor[idx], step)
        rule = Rule(o.z_enter, o.enter_window, o.enter_count, o.z_exit, o.exit_window, o.exit_count)
        entered, exited = self._z.decide(slots, rule)
        out: list[Verdict] = []
        pos = {int(s): int(i) for s, i in zip(slots.tolist(), idx.tolist(), strict=True)}
        fpos = {int(s): int(f) for s, f in zip(slots.tolist(), fslots.tolist(), strict=True)}
        for s in entered.tolist():
            i = pos[s]
            r = ranks[i]
            zs, _ = self._z.last(np.array([s]), o.enter_window)
            self._factor.since[fpos[s]] = self._z.since[s]
            fac = float(self._factor.median_since_onset(np.array([fpos[s]]), o.enter_window)[0])
            self._z.reported[s] = fac
            zt = tuple(float(v) for v in zs[0] if not math.isnan(v))
            out.append(
                Slow(
                    gpu=r.gpu, stage=r.stage, group=r.group, factor=fac, since_step=int(self._z.since[s]), step=step,
                    scope=Scope.GPU, update=False, dry_run=o.dry_run,
                    reason=(
                        f"{r.gpu}: compute time z-score >= {o.z_enter:g} among stage {r.stage}'s ranks in "
                        f"{o.enter_count} or more of the last {o.enter_window} steps ({fac:.2f}x the median)"
                    ),
                    evidence=ZScoreEvidence(observed_s=float(t[i]), stage_median_s=float(med[sidx[i]]), z=zt),
                )
            )
        for s in exited.tolist():
            r = ranks[pos[s]]
            fac = float(self._factor.median_last(np.array([fpos[s]]), o.exit_window)[0])
            out.append(
                Recovered(
                    gpu=r.gpu, stage=r.stage, group=r.group, factor=fac, since_step=int(self._z.since[s]), step=step,
                    dry_run=o.dry_run, reason=f"{r.gpu}: z-score back under {o.z_exit:g}",
                )
            )
        return out
