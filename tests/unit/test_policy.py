"""The service's pure policies, called like functions with made-up times (no clock, no sleeps)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ntp_manager.contract.gpu import GpuState as S
from ntp_manager.service.core import policy
from ntp_manager.service.core.policy import WindowAction

LIVE = policy.LivenessOptions(suspect_after_s=6, fail_after_s=20)


@pytest.mark.parametrize("silent, health, expect", [
    (0.0, S.HEALTHY, None),
    (6.0, S.HEALTHY, None),  # exactly suspect_after_s: still within grace
    (6.1, S.HEALTHY, S.SUSPECT),
    (6.1, S.DEGRADED, None),  # silence alone does not make a degraded GPU suspect...
    (20.0, S.SUSPECT, None),  # exactly fail_after_s: not yet failed
    (20.1, S.SUSPECT, S.FAILED),
    (20.1, S.HEALTHY, S.FAILED),  # a monitor pass that missed the suspect window fails it at once
    (20.1, S.DEGRADED, S.FAILED),  # ...but silence past fail_after_s does
    (500.0, S.FAILED, None),  # already failed: nothing to write
])
def test_liveness(silent: float, health: S, expect: S | None) -> None:
    d = policy.liveness(1000.0 + silent, 1000.0, "n7", health, LIVE)
    assert d.health == expect
    if expect is not None:
        assert d.reason == f"no heartbeat from n7 for {silent:.1f}s"


@pytest.mark.parametrize("health, source, expect", [
    (S.FAILED, "heartbeat", S.HEALTHY),  # silence was the only evidence
    (S.SUSPECT, "heartbeat", S.HEALTHY),
    (S.FAILED, "inventory", S.HEALTHY),  # it is in the inventory again
    (S.FAILED, "agent", None),  # the agent's own verdict stands
    (S.HEALTHY, "heartbeat", None),
])
def test_reconnect(health: S, source: str, expect: S | None) -> None:
    assert policy.reconnect(health, source).health == expect


BRK = policy.BreakerOptions(window_s=60, share=0.2, min_gpus=4)


@pytest.mark.parametrize("recent, more, gpus, opens", [
    (0, 4, 10, False),  # limit max(4, 0.2 x 10 = 2) = 4: four failures do not open it
    (0, 5, 10, True),  # five do
    (2, 3, 10, True),  # 2 in the window + 3 now = 5 > 4
    (0, 20, 100, False),  # limit max(4, 20) = 20
    (0, 21, 100, True),
    (10, 0, 10, False),  # no new failures decide nothing
])
def test_breaker(recent: int, more: int, gpus: int, opens: bool) -> None:
    d = policy.breaker(False, recent, more, gpus, BRK)
    assert d.open is opens
    if opens:
        assert "a systemic fault is likely" in d.reason


def test_an_open_breaker_stays_open_without_deciding_again() -> None:
    d = policy.breaker(True, 0, 100, 10, BRK)
    assert not d.open and d.reason == ""


T0 = datetime(2030, 1, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize("now, deadline, done", [
    (T0, None, False),
    (T0, T0 + timedelta(seconds=1), False),
    (T0, T0, True),  # the deadline itself counts as passed
    (T0 + timedelta(hours=1), T0, True),
])
def test_drain_due(now: datetime, deadline: datetime | None, done: bool) -> None:
    d = policy.drain_due(now, deadline, "kernel update")
    assert d.done is done
    assert d.reason == ("drain deadline passed: kernel update" if done else "")


GPUS = [("a", None), ("b", S.CORDONED), ("c", S.MAINTENANCE), ("d", None)]


@pytest.mark.parametrize("offset_s, action, gpus, reason", [
    (-1, WindowAction.NONE, (), ""),  # before the window
    (0, WindowAction.START, ("a", "d"), "bios update"),  # a cordon (b) is left alone
    (3599, WindowAction.START, ("a", "d"), "bios update"),
    (3600, WindowAction.END, ("c",), "window 7 ended"),  # [starts, ends): the end is outside
    (7200, WindowAction.END, ("c",), "window 7 ended"),
])
def test_maintenance(offset_s: int, action: WindowAction, gpus: tuple[str, ...], reason: str) -> None:
    d = policy.maintenance(T0 + timedelta(seconds=offset_s), T0, T0 + timedelta(hours=1), 7, "bios update", GPUS)
    assert (d.action, d.gpus, d.reason) == (action, gpus, reason)


def test_maintenance_with_nothing_to_start_and_no_reason() -> None:
    assert policy.maintenance(T0, T0, T0 + timedelta(hours=1), 7, "", [("x", S.CORDONED)]).action is WindowAction.NONE
    assert policy.maintenance(T0, T0, T0 + timedelta(hours=1), 7, "", [("x", None)]).reason == "window 7"
