"""The detector's parts: the robust workload fit, the medians, and the k-of-n hysteresis tracker."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.detect.model import RobustFit, group_median, group_min, median, row_nanmedian
from ntp_manager.detect.window import Rule, Tracker

# ---- the robust fit ------------------------------------------------------------------------------


def _rows(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = rng.uniform(40_000, 65_000, n)
    sumsq = rng.uniform(5e6, 1.5e8, n)
    x = np.column_stack([tokens, sumsq, np.ones(n)])
    y = (2e-6 * tokens + 3e-10 * sumsq + 0.01) * rng.lognormal(0, 0.02, n)
    return x, y


def test_fit_recovers_the_cost_model_despite_outliers() -> None:
    rng = np.random.default_rng(3)
    x, y = _rows(rng, 400)
    y[::10] *= 3.0  # 10% stalled steps
    fit = RobustFit(3, 512)
    fit.add(x, y)
    fit.refit(huber_k=2.0, iterations=4)
    xt, _ = _rows(rng, 200)
    clean = (2e-6 * xt[:, 0] + 3e-10 * xt[:, 1] + 0.01)
    err = np.abs(fit.predict(xt) / clean - 1)
    assert float(np.median(err)) < 0.01 and float(err.max()) < 0.04
    assert 0.01 < fit.sigma < 0.04  # the robust spread is the 2% jitter, not the stalls
    # plain least squares on the same rows is dragged up by the stalls
    theta, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert float(np.median(np.abs(xt @ theta / clean - 1))) > 0.05


def test_fit_ring_keeps_the_newest_rows_and_ignores_empty_ones() -> None:
    fit = RobustFit(2, 8)
    x = np.column_stack([np.arange(1, 13, dtype=float), np.ones(12)])
    fit.add(x, 2 * x[:, 0])  # y = 2 * x
    fit.add(x[:2], np.array([0.0, -1.0]))  # y <= 0: ignored
    assert fit.rows == 8
    fit.refit(2.0)
    assert fit.predict(np.array([[100.0, 1.0]]))[0] == pytest.approx(200, rel=1e-3)
    fit.resize(4)
    assert fit.rows == 4
    fit.add(x[:4], 3 * x[:4, 0])  # a new regime fills the ring
    fit.refit(2.0)
    assert fit.predict(np.array([[10.0, 1.0]]))[0] == pytest.approx(30, rel=1e-3)
    assert math.isnan(RobustFit(2, 4).predict(np.array([[1.0, 1.0]]))[0])


def test_fit_refits_only_after_enough_new_rows() -> None:
    rng = np.random.default_rng(0)
    fit = RobustFit(3, 512)
    x, y = _rows(rng, 256)
    fit.add(x, y)
    fit.maybe_refit(2.0)
    first = fit.theta.copy()  # type: ignore[union-attr]
    fit.add(x[:4], y[:4] * 2)
    fit.maybe_refit(2.0)  # 4 new rows < 256 // 16: kept
    assert np.array_equal(fit.theta, first)  # type: ignore[arg-type]
    fit.add(x[:16], y[:16] * 2)
    fit.maybe_refit(2.0)
    assert not np.array_equal(fit.theta, first)  # type: ignore[arg-type]


# ---- medians ---------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.integers(1, 5))
def test_medians_agree_with_numpy(values: list[float], groups: int) -> None:
    a = np.array(values)
    assert median(a) == pytest.approx(float(np.median(a)))
    g = np.arange(len(a), dtype=np.int64) % groups
    got = group_median(a, g, groups + 1)
    for k in range(groups + 1):
        sel = a[g == k]
        if len(sel):
            assert got[k] == pytest.approx(float(np.median(sel)))
            assert group_min(a, g, groups + 1)[k] == sel.min()
        else:
            assert math.isnan(got[k])
    m = np.full((3, len(a)), np.nan)
    m[0] = a
    m[1, ::2] = a[::2]
    rows = row_nanmedian(m)
    assert rows[0] == pytest.approx(float(np.median(a)))
    assert rows[1] == pytest.approx(float(np.median(a[::2])))
    assert math.isnan(rows[2])


# ---- the tracker ------------------------------------------------------------------------------------------

RULE = Rule(enter_level=1.1, enter_window=4, enter_count=3, exit_level=1.05, exit_window=5, exit_count=4)


def _feed(values: list[float], rule: Rule = RULE) -> list[tuple[int, str, int]]:
    tr = Tracker(5)
    slot = tr.slots_for(["a"])
    out = []
    for step, v in enumerate(values):
        tr.push(slot, np.array([v]), step)
        entered, exited = tr.decide(slot, rule)
        if len(entered):
            out.append((step, "enter", int(tr.since[0])))
        if len(exited):
            out.append((step, "exit", step))
    return out


@pytest.mark.parametrize(
    ("values", "events"),
    [
        ([1.0] * 8, []),
        ([1.0, 1.2, 1.2, 1.0, 1.0, 1.0], []),  # 2 of 4: not enough
        ([1.0, 1.2, 1.0, 1.2, 1.2, 1.0], [(4, "enter", 1)]),  # 3 of 4 (steps 1, 3, 4); onset = first above
        ([1.2, 1.2, 1.2] + [1.08] * 20, [(2, "enter", 0)]),  # between the levels: stays flagged
        ([1.2, 1.2, 1.2, 1.0, 1.0, 1.0, 1.0], [(2, "enter", 0), (6, "exit", 6)]),  # 4 of 5 <= 1.05
        ([1.2, 1.2, 1.2, 1.0, 1.2, 1.0, 1.0, 1.0], [(2, "enter", 0), (7, "exit", 7)]),  # steps 3, 5, 6, 7
        ([float("nan"), 1.2, 1.2, 1.2], [(3, "enter", 1)]),  # a NaN counts as neither
    ],
)
def test_k_of_n_rule(values: list[float], events: list[tuple[int, str, int]]) -> None:
    assert _feed(values) == events


def test_tracker_resize_forget_expire_and_slot_reuse() -> None:
    tr = Tracker(4, initial_slots=1)
    slots = tr.slots_for(["a", "b", "c"])  # grows past its initial size
    assert sorted(slots.tolist()) == [0, 1, 2] and len(tr) == 3
    for step in range(6):
        tr.push(slots, np.array([step, 10 + step, 20 + step], dtype=float), step)
    vals, steps = tr.last(slots[:1], 4)
    assert vals.tolist() == [[2, 3, 4, 5]] and steps.tolist() == [[2, 3, 4, 5]]
    tr.resize(6)
    vals, _ = tr.last(slots[:1], 6)
    assert np.isnan(vals[0, :2]).all()  # only the 4 newest survived
    assert vals[0, 2:].tolist() == [2, 3, 4, 5]
    tr.push(slots, np.array([6.0, 16.0, 26.0]), 6)
    assert tr.last(slots[:1], 6)[0][0, 1:].tolist() == [2, 3, 4, 5, 6]
    tr.resize(2)
    assert tr.last(slots[1:2], 2)[0].tolist() == [[15, 16]]
    with pytest.raises(ValueError, match="exceeds the ring capacity"):
        tr.last(slots, 3)
    # "c" goes quiet; expire drops it, and its slot is reused cleanly
    tr.push(slots[:2], np.array([7.0, 17.0]), 100)
    assert tr.expire(150, idle_steps=60) == ["c"]
    assert tr.slot_of("c") is None
    d = tr.slots_for(["d"])
    assert int(d[0]) == int(slots[2]) and np.isnan(tr.last(d, 2)[0]).all() and not tr.flag[d[0]]
    assert tr.forget(["a", "zz"]) == ["a"] and sorted(tr.keys()) == ["b", "d"]
