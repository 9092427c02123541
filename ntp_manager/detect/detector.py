"""The workload-aware fail-slow detector: one step's observations in, verdicts with evidence out.

Per step, for every rank with work:
1. *Predict.* The robust fit (detect/model.py) of its stage at its group's TP degree gives the
   healthy compute time of the group's work, `pred = a*tokens/tp + b*sumsq/tp + c`, divided by
   the speed the plan expects of the GPU. The rank's ratio is observed / predicted. Each degree
   has its own fit because time does not scale exactly as 1/tp (unsharded parts, smaller and less
   efficient matmuls): a replica resharded to TP1 with half the batch may well take twice what
   TP2's rows predict, and that is the model's error, not the GPU's.
2. *Compare with peers.* Ratios are divided by their median over the job's ranks that are not
   flagged already, which removes whatever slows everyone alike this step (and the fit's drift).
   The result is the rank's step factor f: about 1 for a healthy GPU whatever its data, 1.2 for
   a GPU 20% slow. It is then divided by the GPU's own usual pace among its peers (the median of
   its recent healthy factors, clamped to 1 +- baseline_limit), since healthy GPUs differ by a few
   percent.
3. *Decide with hysteresis.* Slow when >= enter_count of its last enter_window factors are
   >= 1 + enter_margin; recovered when >= exit_count of the last exit_window are
   <= 1 + exit_margin (detect/window.py). Stalls shorter than enter_count steps never count.
   Verdicts report the factor against healthy peers (own pace included).
4. *Classify.* A slow GPU is compared with its TP peers, who ran the very same micro-batches: if it
   stands out among them the scope is `gpu`, if they are all as slow it is `group` (node-level).
   Separately, per TP group: its predicted work relative to its stage's groups (`Imbalance` when
   persistently high: long time explained by the data), and its own transfer time, the least
   collective wait among its members (a slow member waits least, so this is the links' time, not
   the waiting), against a second fit `transfer = d*tokens*(tp-1)/tp + e` (`NetworkSlow` when
   persistently high while compute is normal).
5. *Learn.* Each group adds one row to its stage's fit: the median effective compute of its
   members that are neither flagged nor above the enter threshold this step, so a slow GPU never
   teaches the model that slow is normal; the same healthy steps feed each GPU's own pace.

No verdict is made for a group before its stage's fit at its TP degree has `warmup_rows` rows
(after a reshard to a new degree: that many steps' rows of the groups at the new degree). The
cost of learning per degree: a group alone at its degree, all of whose members are already slow
when it first runs there, teaches its fit that pace; a GPU flagged before the change stays flagged
and teaches nothing, and in a group of three or more a member slower than the others is still
found (a row is the members' median). Memory is bounded: fixed
rings per GPU and per group, a fixed number of rows per stage, idle GPUs forgotten.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ntp_manager.detect.model import FloatArray, IntArray, RobustFit, group_median, group_min, median, row_nanmedian
from ntp_manager.detect.options import DetectorOptions, OptionsError
from ntp_manager.detect.types import Columns, DetectError, RankObservation, StepObservation
from ntp_manager.detect.verdicts import (
    Cleared,
    Imbalance,
    NetworkSlow,
    Recovered,
    Scope,
    Slow,
    SlowEvidence,
    Verdict,
)
from ntp_manager.detect.window import Rule, Tracker

_EXPIRE_EVERY = 64  # steps between sweeps for idle GPUs and groups
_BASELINE_EVERY = 8  # steps between recomputations of the GPUs' own paces


@dataclass(frozen=True, slots=True)
class RankStatus:
    """A GPU's current standing, for dashboards and the API."""

    gpu: str
    stage: int
    group: str
    factor: float | None  # median step factor over the exit window (None before the model is ready)
    slow: bool
    since_step: int | None
    last_step: int
    compute_s: float
    predicted_s: float | None


@dataclass(frozen=True, slots=True)
class DetectorSnapshot:
    step: int | None
    ranks: tuple[RankStatus, ...]
    imbalanced_groups: tuple[str, ...]
    network_slow_groups: tuple[str, ...]
    ready_stages: tuple[int, ...]  # stages with at least one TP degree's fit warm
    ready_degrees: tuple[tuple[int, int], ...] = ()  # (stage, tp) pairs whose fit is warm


def _rule_slow(o: DetectorOptions) -> Rule:
    return Rule(1 + o.enter_margin, o.enter_window, o.enter_count, 1 + o.exit_margin, o.exit_window, o.exit_count)


def _rule_network(o: DetectorOptions) -> Rule:
    return Rule(
        1 + o.network_margin, o.enter_window, o.enter_count,
        1 + o.network_exit_margin, o.exit_window, o.exit_count,
    )


def _rule_imbalance(o: DetectorOptions) -> Rule:
    # a majority of the window: the window's median work is above (below) the level
    w = o.imbalance_window
    k = w // 2 + 1
    return Rule(1 + o.imbalance_margin, w, k, 1 + o.imbalance_margin / 2, w, k)


def _fmt(x: float) -> str:
    return f"{x:.2f}"


class WorkloadDetector:
    """Stateful detector; feed it steps in increasing order. Not thread-safe (one caller)."""

    def __init__(self, options: DetectorOptions | None = None) -> None:
        self._opts = options or DetectorOptions()
        o = self._opts
        # per GPU: main ring = step factor relative to the GPU's own healthy pace; channels: the
        # factor against its TP peers (evidence, scope) and its healthy factors (its own pace)
        self._slow = Tracker(max(o.enter_window, o.exit_window))
        self._slow.add_channel("peers", max(o.enter_window, o.exit_window))
        self._slow.add_channel("base", o.baseline_window)
        self._net = Tracker(max(o.enter_window, o.exit_window))  # per group: transfer factor
        self._imb = Tracker(o.imbalance_window)  # per group: work factor
        # one fit per (stage, TP degree): time does not scale exactly as 1/tp (parts of a layer are
        # not sharded, small matmuls run less efficiently), so a degree is only judged by its own rows
        self._fits: dict[tuple[int, int], RobustFit] = {}
        self._net_fits: dict[tuple[int, int], RobustFit] = {}
        self._meta: dict[str, RankObservation] = {}
        self._pred: dict[str, float] = {}
        self._last_step: int | None = None

    # ---- configuration ------------------------------------------------------------------------------

    @property
    def options(self) -> DetectorOptions:
        return self._opts

    def set_options(self, options: DetectorOptions) -> None:
        """Swap the options; state (fits, windows, flags) is kept and the new rules apply from the
        next step. Windows shrink to their newest values or grow empty at the old end."""
        if not isinstance(options, DetectorOptions):
            raise OptionsError(f"expected DetectorOptions, got {type(options).__name__}")
        cap = max(options.enter_window, options.exit_window)
        self._slow.resize(cap)
        self._slow.channels["peers"].resize(cap)
        self._slow.channels["base"].resize(options.baseline_window)
        self._net.resize(cap)
        self._imb.resize(options.imbalance_window)
        for fit in (*self._fits.values(), *self._net_fits.values()):
            fit.resize(options.fit_window)
        self._opts = options

    def forget(self, gpus: Iterable[str]) -> list[str]:
        """Drop GPUs (left the job, replaced, repaired); returns those that were flagged slow."""
        gpus = list(gpus)
        flagged = set(self._slow.flagged())
        self._slow.forget(gpus)
        for g in gpus:
            self._meta.pop(g, None)
            self._pred.pop(g, None)
        return [g for g in gpus if g in flagged]

    def reset_models(self, stages: Iterable[int] | None = None) -> None:
        """Throw away stage fits, every TP degree's (all stages, or the given ones): call when a
        stage's layers change (pipeline repartition). They warm up again before the next verdict on
        those stages."""
        drop = None if stages is None else set(stages)
        for table in (self._fits, self._net_fits):
            for key in list(table):
                if drop is None or key[0] in drop:
                    del table[key]

    # ---- reading ----------------------------------------------------------------------------------------

    def flagged(self) -> list[str]:
        return self._slow.flagged()

    def snapshot(self) -> DetectorSnapshot:
        """Every known GPU's standing; its factor is relative to healthy peers (own pace included)."""
        o = self._opts
        keys = self._slow.keys()
        slots = self._slow.slots_for(keys)
        med = self._slow.median_last(slots, o.exit_window) * self._slow.aux[slots] if len(slots) else np.empty(0)
        ranks = []
        for k, s, m in zip(keys, slots.tolist(), med.tolist(), strict=True):
            r = self._meta.get(k)
            if r is None:
                continue
            ranks.append(
                RankStatus(
                    gpu=k, stage=r.stage, group=r.group, factor=None if math.isnan(m) else m,
                    slow=bool(self._slow.flag[s]),
                    since_step=int(self._slow.since[s]) if self._slow.flag[s] else None,
                    last_step=int(self._slow.last_seen[s]), compute_s=r.compute_s, predicted_s=self._pred.get(k),
                )
            )
        ready = tuple(sorted(k for k, f in self._fits.items() if self._ready(f)))
        return DetectorSnapshot(
            step=self._last_step, ranks=tuple(ranks), imbalanced_groups=tuple(self._imb.flagged()),
            network_slow_groups=tuple(self._net.flagged()), ready_stages=tuple(sorted({s for s, _ in ready})),
            ready_degrees=ready,
        )

    def _ready(self, fit: RobustFit) -> bool:
        return fit.theta is not None and fit.rows >= self._opts.warmup_rows

    # ---- the step --------------------------------------------------------------------------------------

    def observe(self, obs: StepObservation) -> list[Verdict]:
        """Take one step; return the verdicts it causes (often none).

        Raises DetectError (and changes nothing) on a bad observation or a step that is not after
        the previous one."""
        cols = obs.columns(self._opts.max_ranks)
        if self._last_step is not None and obs.step <= self._last_step:
            raise DetectError(f"step {obs.step} is not after the last observed step {self._last_step}")
        self._last_step = obs.step
        verdicts: list[Verdict] = self._step(cols) if cols.ranks else []
        if obs.step % _EXPIRE_EVERY == 0:
            self._expire(obs.step)
        return verdicts

    def _expire(self, step: int) -> None:
        idle = self._opts.idle_expiry_steps
        for g in self._slow.expire(step, idle):
            self._meta.pop(g, None)
            self._pred.pop(g, None)
        self._net.expire(step, idle)
        self._imb.expire(step, idle)

    def _step(self, cols: Columns) -> list[Verdict]:
        o = self._opts
        step, ranks, gpus = cols.step, list(cols.ranks), cols.gpus
        compute, wait, speed, gidx = cols.compute, cols.wait, cols.speed, cols.gidx
        gnames, g_stage, g_tp, g_tok, g_sq = cols.groups, cols.g_stage, cols.g_tp, cols.g_tokens, cols.g_sumsq
        g_members = cols.g_members
        ng = len(gnames)
        x = np.column_stack([g_tok / g_tp, g_sq / g_tp, np.ones(ng)])
        stages = sorted(set(g_stage.tolist()))
        g_deg = g_tp.astype(np.int64)
        kinds = sorted(set(zip(g_stage.tolist(), g_deg.tolist(), strict=True)))
        in_kind = {k: (g_stage == k[0]) & (g_deg == k[1]) for k in kinds}

        # 1. predict per group from its stage's fit at its TP degree
        pred_g = np.full(ng, np.nan)
        for k in kinds:
            fit = self._fits.get(k)
            if fit is not None and self._ready(fit):
                m = in_kind[k]
                pred_g[m] = fit.predict(x[m])
        pred_g[~(pred_g > 0)] = np.nan  # a fit that predicts <= 0 for this work has no say
        pred = pred_g[gidx] / speed
        ratio = compute / pred
        valid = ~np.isnan(ratio)
        # 2. peers: the median ratio of the job's GPUs not already flagged is what "healthy" means
        # this step (leaving out the flagged ones keeps a second slow group from hiding behind a first)
        slots = self._slow.slots_for(gpus)
        peers = valid & ~self._slow.flag[slots]
        if int(peers.sum()) < o.min_peers:
            peers = valid
        norm = median(ratio[peers]) if int(peers.sum()) >= o.min_peers else 1.0
        f = ratio / norm
        eff = compute * speed
        g_eff = group_median(eff, gidx, ng)
        vs_peers = np.where((g_tp[gidx] > 1) & (g_members[gidx] >= 2), eff / g_eff[gidx], np.nan)
        r_stage = g_stage[gidx]
        stage_raw = compute / group_median(compute, r_stage, int(r_stage.max()) + 1)[r_stage]
        for gpu, r, p in zip(gpus, ranks, (pred * norm).tolist(), strict=True):
            self._meta[gpu] = r
            if not math.isnan(p):
                self._pred[gpu] = p

        # ... and the GPU's own healthy pace among them (clamped: it cannot excuse a real slowdown)
        base = self._baselines(slots, step)
        rel = f / base

        # 3. per-GPU hysteresis on the factor relative to its own pace
        verdicts: list[Verdict] = []
        vidx = np.nonzero(valid)[0]
        vslots = slots[vidx]
        self._slow.push(vslots, rel[vidx], step)
        self._slow.channels["peers"].push(vslots, vs_peers[vidx], step)
        entered, exited = self._slow.decide(vslots, _rule_slow(o))
        flagged = self._slow.flag[slots]
        if len(entered) or len(exited) or flagged.any():
            verdicts += self._slow_verdicts(
                step, ranks, vidx, vslots, entered, exited, compute, pred * norm, stage_raw, wait, gidx,
            )
            flagged = self._slow.flag[slots]

        # 5. learn: the GPU's own pace from its healthy steps, and one row per group for the fit
        healthy = ~flagged & ~(rel >= 1 + o.enter_margin)  # NaN (no model yet) counts as healthy
        hv = vidx[healthy[vidx]]
        self._slow.channels["base"].push(slots[hv], f[hv], step)
        y = group_median(np.where(healthy, eff, np.nan), gidx, ng)
        for k in kinds:
            m = in_kind[k] & ~np.isnan(y)
            fit = self._fits.get(k)
            if fit is None:
                fit = self._fits[k] = RobustFit(3, o.fit_window)
            if m.any():
                fit.add(x[m], y[m])
                fit.maybe_refit(o.huber_k)

        # 4. groups: network and data imbalance
        verdicts += self._network(step, gnames, g_stage, g_tp, g_tok, g_members, wait, gidx, ng, kinds, in_kind)
        verdicts += self._imbalance(step, gnames, g_stage, pred_g, f, gidx, ng, stages, stage_raw)
        return verdicts

    def _baselines(self, slots: IntArray, step: int) -> FloatArray:
        """Each GPU's own healthy pace relative to its peers: the median of its last
        `baseline_window` healthy factors, clamped to 1 +- baseline_limit. Until it has
        `baseline_min` of them it is taken at the slow end, 1 + baseline_limit, so a GPU whose pace
        is not known yet is held to the bar every GPU is finally held to. Recomputed every few
        steps (it moves slowly) and kept in `aux`."""
        o = self._opts
        if step % _BASELINE_EVERY == 0 or np.isnan(self._slow.aux[slots]).any():
            ring = self._slow.channels["base"]
            vals, _ = ring.last(slots, ring.capacity)
            count = (~np.isnan(vals)).sum(axis=1)
            b = np.where(count >= o.baseline_min, row_nanmedian(vals), 1 + o.baseline_limit)
            b = np.clip(b, 1 - o.baseline_limit, 1 + o.baseline_limit)
            # a flagged GPU keeps the pace it had when it was flagged
            keep = self._slow.flag[slots]
            self._slow.aux[slots] = np.where(keep, self._slow.aux[slots], b)
        out: FloatArray = self._slow.aux[slots]
        return out

    def _slow_verdicts(
        self, step: int, ranks: list[RankObservation], vidx: IntArray, slots: IntArray,
        entered: IntArray, exited: IntArray, compute: FloatArray, pred: FloatArray, stage_raw: FloatArray,
        wait: FloatArray, gidx: IntArray,
    ) -> list[Verdict]:
        o = self._opts
        out: list[Verdict] = []
        pos = {int(s): int(i) for s, i in zip(slots.tolist(), vidx.tolist(), strict=True)}
        peers = self._slow.channels["peers"]
        entered_set = set(entered.tolist())

        def evidence(s: int, window: int) -> tuple[float, tuple[float, ...], float | None, Scope, SlowEvidence]:
            i = pos[s]
            r = ranks[i]
            one = np.array([s])
            base = float(self._slow.aux[s])
            vals, _ = self._slow.last(one, window)
            factors = tuple(float(v) * base for v in vals[0] if not math.isnan(v))
            factor = float(self._slow.median_since_onset(one, window)[0]) * base
            pw = float(peers.median(one, window)[0])
            vs_peers = None if math.isnan(pw) else pw
            members = np.nonzero(gidx == gidx[i])[0]
            others = [int(j) for j in members.tolist() if j != i]
            peers_wait = float(np.median(wait[others])) if others else None
            scope = Scope.GPU if vs_peers is None or vs_peers >= 1 + o.enter_margin / 2 else Scope.GROUP
            notes = r.signals.notes() if r.signals is not None else ()
            ev = SlowEvidence(
                observed_s=float(compute[i]), predicted_s=float(pred[i]), factors=factors, baseline=base,
                vs_tp_peers=vs_peers, vs_stage_raw=float(stage_raw[i]), comm_wait_s=float(wait[i]),
                peers_comm_wait_s=peers_wait, tokens=r.tokens, sumsq=r.sumsq, signals=r.signals, notes=notes,
            )
            return factor, factors, vs_peers, scope, ev

        for s in entered.tolist():
            r = ranks[pos[s]]
            factor, factors, vs_peers, scope, ev = evidence(s, o.enter_window)
            self._slow.reported[s] = factor
            above = sum(v >= (1 + o.enter_margin) * ev.baseline for v in factors)
            why = (
                f"{r.gpu} (stage {r.stage}, group {r.group}) took {_fmt(factor)}x the compute time a healthy GPU "
                f"needs for the same work; {above} of the last {len(factors)} steps were at least "
                f"{_fmt(1 + o.enter_margin)}x its own usual pace ({_fmt(ev.baseline)}x)"
            )
            if scope is Scope.GPU and vs_peers is not None:
                why += f"; {_fmt(vs_peers)}x its TP peers on the same micro-batches"
                if ev.peers_comm_wait_s is not None:
                    why += f", who wait {ev.peers_comm_wait_s:.3g} s for it (it waits {ev.comm_wait_s:.3g} s)"
            elif scope is Scope.GROUP:
                why += f"; its TP peers are as slow ({_fmt(vs_peers or 1.0)}x): the whole group, a node-level cause"
            if ev.notes:
                why += "; " + "; ".join(ev.notes)
            out.append(
                Slow(
                    gpu=r.gpu, stage=r.stage, group=r.group, factor=factor, since_step=int(self._slow.since[s]),
                    step=step, scope=scope, update=False, dry_run=o.dry_run, reason=why, evidence=ev,
                )
            )
        for s in exited.tolist():
            r = ranks[pos[s]]
            factor = float(self._slow.median_last(np.array([s]), o.exit_window)[0]) * float(self._slow.aux[s])
            out.append(
                Recovered(
                    gpu=r.gpu, stage=r.stage, group=r.group, factor=factor, since_step=int(self._slow.since[s]),
                    step=step, dry_run=o.dry_run,
                    reason=(
                        f"{r.gpu} back to {_fmt(factor)}x a healthy GPU's time: at most {_fmt(1 + o.exit_margin)}x "
                        f"its own usual pace in {o.exit_count} or more of the last {o.exit_window} steps"
                    ),
                )
            )
        # factor updates of GPUs that stay flagged
        still = np.array([s for s in slots[self._slow.flag[slots]].tolist() if s not in entered_set], dtype=np.int64)
        if len(still):
            med = self._slow.median_since_onset(still, o.exit_window) * self._slow.aux[still]
            moved = np.abs(med - self._slow.reported[still]) >= o.factor_update
            for s in still[moved].tolist():
                r = ranks[pos[s]]
                factor, factors, vs_peers, scope, ev = evidence(s, o.exit_window)
                self._slow.reported[s] = factor
                out.append(
                    Slow(
                        gpu=r.gpu, stage=r.stage, group=r.group, factor=factor, since_step=int(self._slow.since[s]),
                        step=step, scope=scope, update=True, dry_run=o.dry_run,
                        reason=f"{r.gpu} still slow, now {_fmt(factor)}x (median since step {self._slow.since[s]})",
                        evidence=ev,
                    )
                )
        return out

    def _network(
        self, step: int, gnames: list[str], g_stage: IntArray, g_tp: FloatArray, g_tok: FloatArray,
        g_members: IntArray, wait: FloatArray, gidx: IntArray, ng: int, kinds: list[tuple[int, int]],
        in_kind: dict[tuple[int, int], npt.NDArray[np.bool_]],
    ) -> list[Verdict]:
        o = self._opts
        transfer = group_min(wait, gidx, ng)
        usable = (g_tp > 1) & (g_members >= 2) & (transfer > 0)
        if not usable.any():
            return []
        xn = np.column_stack([g_tok * (g_tp - 1) / g_tp, np.ones(ng)])
        pred = np.full(ng, np.nan)
        for k in kinds:
            fit = self._net_fits.get(k)
            if fit is not None and self._ready(fit):
                m = in_kind[k] & usable
                pred[m] = fit.predict(xn[m])
        pred[~(pred > 0)] = np.nan
        ratio = transfer / pred
        ok = ~np.isnan(ratio)
        norm = median(ratio[ok]) if ok.sum() >= 3 else 1.0
        factor = ratio / norm
        idx = np.nonzero(ok)[0]
        slots = self._net.slots_for([gnames[i] for i in idx.tolist()])
        self._net.push(slots, factor[idx], step)
        entered, exited = self._net.decide(slots, _rule_network(o))
        # learn from groups that are not flagged and not above the threshold now
        flagged = np.zeros(ng, dtype=np.bool_)
        flagged[idx] = self._net.flag[slots]
        learn = usable & ~flagged & ~(factor >= 1 + o.network_margin)
        for k in kinds:
            if k[1] < 2:
                continue  # a group of one has no collectives
            m = learn & in_kind[k]
            fit = self._net_fits.get(k)
            if fit is None:
                fit = self._net_fits[k] = RobustFit(2, o.fit_window)
            if m.any():
                fit.add(xn[m], transfer[m])
                fit.maybe_refit(o.huber_k)
        out: list[Verdict] = []
        where = {int(s): int(i) for s, i in zip(slots.tolist(), idx.tolist(), strict=True)}
        for s in entered.tolist():
            i = where[s]
            fac = float(self._net.median_since_onset(np.array([s]), o.enter_window)[0])
            self._net.reported[s] = fac
            out.append(
                NetworkSlow(
                    group=gnames[i], stage=int(g_stage[i]), factor=fac, since_step=int(self._net.since[s]), step=step,
                    comm_s=float(transfer[i]), predicted_s=float(pred[i] * norm), dry_run=o.dry_run,
                    reason=(
                        f"group {gnames[i]}'s collectives took {_fmt(fac)}x the predicted transfer time "
                        f"({transfer[i]:.3g} s vs {pred[i] * norm:.3g} s) in {o.enter_count} or more of the last "
                        f"{o.enter_window} steps, counting only the member that waited least: the links, not a GPU"
                    ),
                )
            )
        for s in exited.tolist():
            i = where[s]
            fac = float(self._net.median_last(np.array([s]), o.exit_window)[0])
            out.append(
                Cleared(
                    what="network", group=gnames[i], stage=int(g_stage[i]), factor=fac,
                    since_step=int(self._net.since[s]), step=step, dry_run=o.dry_run,
                    reason=f"group {gnames[i]}'s transfer time back to {_fmt(fac)}x predicted",
                )
            )
        return out

    def _imbalance(
        self, step: int, gnames: list[str], g_stage: IntArray, pred_g: FloatArray, f: FloatArray, gidx: IntArray,
        ng: int, stages: list[int], stage_raw: FloatArray,
    ) -> list[Verdict]:
        o = self._opts
        work = np.full(ng, np.nan)
        for s in stages:
            m = (g_stage == s) & ~np.isnan(pred_g)
            if m.sum() >= 2:
                work[m] = pred_g[m] / median(pred_g[m])
        idx = np.nonzero(~np.isnan(work))[0]
        if len(idx) == 0:
            return []
        slots = self._imb.slots_for([gnames[i] for i in idx.tolist()])
        self._imb.push(slots, work[idx], step)
        entered, exited = self._imb.decide(slots, _rule_imbalance(o))
        if not len(entered) and not len(exited):
            return []
        out: list[Verdict] = []
        where = {int(s): int(i) for s, i in zip(slots.tolist(), idx.tolist(), strict=True)}
        time_factor = group_median(stage_raw, gidx, ng)
        model_factor = group_median(f, gidx, ng)
        w = o.imbalance_window
        for s in entered.tolist():
            i = where[s]
            wf = float(self._imb.median_since_onset(np.array([s]), w)[0])
            out.append(
                Imbalance(
                    group=gnames[i], stage=int(g_stage[i]), work_factor=wf, time_factor=float(time_factor[i]),
                    model_factor=float(model_factor[i]), since_step=int(self._imb.since[s]), step=step,
                    dry_run=o.dry_run,
                    reason=(
                        f"group {gnames[i]} (stage {int(g_stage[i])}) was given {_fmt(wf)}x its stage's median work "
                        f"in most of the last {w} steps; its GPUs ran at {_fmt(float(model_factor[i]))}x "
                        f"the time predicted for that work: the data, not the GPUs"
                    ),
                )
            )
        for s in exited.tolist():
            i = where[s]
            wf = float(self._imb.median_last(np.array([s]), w)[0])
            out.append(
                Cleared(
                    what="imbalance", group=gnames[i], stage=int(g_stage[i]), factor=wf,
                    since_step=int(self._imb.since[s]), step=step, dry_run=o.dry_run,
                    reason=f"group {gnames[i]}'s work back to {_fmt(wf)}x its stage's median",
                )
            )
        return out
