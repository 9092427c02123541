"""The ResiHP rule for a TP group with slow members: keep, boost or exclude, by degree x pace."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.detect import AdaptError, adapt
from ntp_manager.detect.adapt import Action


def group(*speeds: float) -> dict[str, float]:
    return {f"g{i}": s for i, s in enumerate(speeds)}


@pytest.mark.parametrize(
    ("speeds", "min_tp", "kw", "action", "degree", "throughput"),
    [
        # healthy TP8: nothing to gain
        (group(*[1.0] * 8), 6, {}, Action.KEEP, 8, 1.0),
        # one GPU 10% slow (speed 1/1.1): keep = 8 x 0.909 = 7.27 beats drop = 7 x 1 = 7
        (group(*[1.0] * 7, 1 / 1.1), 6, {}, Action.KEEP, 8, 1 / 1.1),
        # 20% slow: keep = 8 / 1.2 = 6.67 < 7: exclude it, TP 7 at full speed = 7/8
        (group(*[1.0] * 7, 1 / 1.2), 6, {}, Action.EXCLUDE, 7, 7 / 8),
        # 40% slow: 8 / 1.4 = 5.71 < 7
        (group(1 / 1.4, *[1.0] * 7), 6, {}, Action.EXCLUDE, 7, 7 / 8),
        # 15% slow: keep 6.96 vs drop 7.00 is +0.6%, under the 2% a reshard must earn
        (group(*[1.0] * 7, 1 / 1.15), 6, {}, Action.KEEP, 8, 1 / 1.15),
        # ...unless the operator asks for any gain
        (group(*[1.0] * 7, 1 / 1.15), 6, {"min_gain": 0.0}, Action.EXCLUDE, 7, 7 / 8),
        # two at 1/1.3: keep 8 x 0.769 = 6.15, drop one 7 x 0.769 = 5.38, drop both 6 x 1 = 6: keep
        (group(*[1.0] * 6, 1 / 1.3, 1 / 1.3), 6, {}, Action.KEEP, 8, 1 / 1.3),
        # two at 1/1.5: keep 5.33 < drop both 6
        (group(*[1.0] * 6, 1 / 1.5, 1 / 1.5), 6, {}, Action.EXCLUDE, 6, 6 / 8),
        # min_tp = 8: exclusion is not allowed
        (group(*[1.0] * 7, 1 / 1.4), 8, {}, Action.KEEP, 8, 1 / 1.4),
        # 20% slow with a 1.2x power boost available: 8 x 1.0 beats 7
        (group(*[1.0] * 7, 1 / 1.2), 6, {"boost": 1.2}, Action.BOOST, 8, 1.0),
        # 40% slow, boost 1.2: 8 x 0.857 = 6.86 < 7 x 1 (+2.1%): exclude
        (group(*[1.0] * 7, 1 / 1.4), 6, {"boost": 1.2}, Action.EXCLUDE, 7, 7 / 8),
        # a whole group slow alike: nothing to drop that helps (6 x 0.8 < 8 x 0.8); boost it
        (group(*[0.8] * 8), 6, {"boost": 1.1}, Action.BOOST, 8, 0.88),
        # TP2 with min_tp 1: one at half speed: 1 x 1.0 = 2 x 0.5: a tie keeps it
        (group(1.0, 0.5), 1, {}, Action.KEEP, 2, 0.5),
    ],
)
def test_adapt_table(
    speeds: dict[str, float], min_tp: int, kw: dict[str, float], action: Action, degree: int, throughput: float,
) -> None:
    d = adapt(speeds, min_tp, **kw)
    assert (d.action, d.degree) == (action, degree), d.reason
    assert d.throughput == pytest.approx(throughput)
    assert d.keep_throughput == pytest.approx(min(speeds.values()))
    assert len(d.keep) == degree and set(d.keep) | set(d.exclude) == set(speeds)
    assert d.reason.startswith(action.value)


def test_exclusion_drops_the_slowest_and_names_them() -> None:
    d = adapt(group(1.0, 0.6, 1.0, 1.0, 0.95, 1.0, 1.0, 1.0), 6)
    # drop g1 only: 7 x 0.95 = 6.65; drop g1 and g4: 6 x 1.0 = 6; keep: 8 x 0.6 = 4.8
    assert d.action is Action.EXCLUDE and d.exclude == ("g1",) and d.degree == 7
    assert d.keep == ("g0", "g2", "g3", "g4", "g5", "g6", "g7")
    assert "dropping g1 runs at 7 x 0.95 = 6.65" in d.reason


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.3, 1.0), min_size=1, max_size=8), st.data())
def test_adapt_is_the_best_subset_by_brute_force(speeds: list[float], data: st.DataObject) -> None:
    n = len(speeds)
    min_tp = data.draw(st.integers(1, n))
    d = adapt(group(*speeds), min_tp, min_gain=0.0)
    best = max(
        k * min(speeds[i] for i in sub) / n
        for k in range(min_tp, n + 1)
        for sub in itertools.combinations(range(n), k)
    )
    assert d.throughput == pytest.approx(best)


@pytest.mark.parametrize(
    ("speeds", "min_tp", "kw", "fragment"),
    [
        ({}, 1, {}, "at least one member"),
        (group(1.0, 0.0), 1, {}, "speed of g1 must be a number in (0, 10]"),
        (group(1.0, float("nan")), 1, {}, "speed of g1"),
        (group(1.0, 1.0), 0, {}, "min_tp must be an integer in 1..2"),
        (group(1.0, 1.0), 3, {}, "min_tp must be an integer in 1..2"),
        (group(1.0, 1.0), 1, {"boost": 0.9}, "boost must be a speed-up >= 1"),
        (group(1.0, 1.0), 1, {"min_gain": -0.1}, "min_gain must be >= 0"),
    ],
)
def test_adapt_refuses_bad_input(speeds: dict[str, float], min_tp: int, kw: dict[str, float], fragment: str) -> None:
    with pytest.raises(AdaptError) as e:
        adapt(speeds, min_tp, **kw)
    assert fragment in str(e.value)
