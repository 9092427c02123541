"""The fail-slow demo's injected slowdown (worker/launch.py `SlowRank`) and the demo batches'
sequence lengths (what the fail-slow detector measures work by)."""

from __future__ import annotations

import time

import pytest

from ntp_manager.worker.launch import DEMO_MODEL, SLOW_ENV, SlowRank, batch
from ntp_manager.worker.sources import StepWork


def test_demo_batches_name_their_sequence_lengths() -> None:
    b = batch(DEMO_MODEL, 3, 4, 5)
    x, y = b  # still unpacks as (inputs, targets)
    assert x.shape == (5, DEMO_MODEL.seq) and y.shape == (5, DEMO_MODEL.seq)
    lengths = StepWork.lengths_of(b)
    assert lengths == (DEMO_MODEL.seq,) * 5


@pytest.mark.parametrize(("text", "want"), [
    ("GPU-1:3", SlowRank("GPU-1", 3.0, 0)),
    ("GPU-a:b:c:2.5@7", SlowRank("GPU-a:b:c", 2.5, 7)),
    (" w0:1 ", SlowRank("w0", 1.0, 0)),
])
def test_parse(text: str, want: SlowRank) -> None:
    assert SlowRank.parse(text) == want


@pytest.mark.parametrize(("text", "says"), [
    ("GPU-1", "expected <worker id>:<factor>"),
    (":3", "expected <worker id>:<factor>"),
    ("GPU-1:fast", "factor must be a number"),
    ("GPU-1:3@soon", "factor must be a number and the step an integer"),
    ("GPU-1:0.5", "factor must be in [1, 100]"),
    ("GPU-1:nan", "factor must be in [1, 100]"),
    ("GPU-1:2@-1", "from step must be >= 0"),
])
def test_parse_refuses_bad_values_naming_the_variable(text: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        SlowRank.parse(text)
    assert SLOW_ENV in str(e.value) and says in str(e.value)


def test_from_env_picks_only_the_named_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SLOW_ENV, raising=False)
    assert SlowRank.from_env("GPU-1") is None
    monkeypatch.setenv(SLOW_ENV, "GPU-1:2@4")
    assert SlowRank.from_env("GPU-1") == SlowRank("GPU-1", 2.0, 4)
    assert SlowRank.from_env("GPU-2") is None
    monkeypatch.setenv(SLOW_ENV, "GPU-1:x")
    with pytest.raises(ValueError):
        SlowRank.from_env("GPU-2")  # a bad value is refused on every rank, not only the named one


def test_run_sleeps_in_proportion_to_the_forward_from_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    clock = iter([10.0, 10.2, 20.0, 20.5])  # two forwards: 0.2 s, then 0.5 s of which 0.1 s a TP wait
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    from ntp_manager.worker import tp as tp_mod

    s = SlowRank("w", 3.0, from_step=5)
    assert s.run(4, lambda: "before") == "before" and slept == []  # before its step: untouched
    assert s.run(5, lambda: "fwd") == "fwd"
    assert slept == [pytest.approx(2.0 * 3.0 * 0.2)]  # (factor - 1) x (forward + backward)

    def forward_with_wait() -> str:
        tp_mod.TP_WAIT.seconds += 0.1
        return "fwd"

    before = tp_mod.TP_WAIT.seconds
    try:
        s.run(6, forward_with_wait)
    finally:
        tp_mod.TP_WAIT.seconds = before
    assert slept[1] == pytest.approx(2.0 * 3.0 * 0.4)  # the TP wait is not the rank's own compute
