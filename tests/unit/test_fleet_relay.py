"""service/feed/ pieces that need no database: the `ntp_layouts` payload, and the telemetry
relay of a manager that does not lead (what it stores for the leader, and what it leaves out)."""

from __future__ import annotations

import asyncio
from typing import Any

from ntp_manager.contract.proto.ntp.v1 import agent_pb2
from ntp_manager.service.feed.layouts import notify_payload, parse_payload
from ntp_manager.service.feed.relay import TELEMETRY, TELEMETRY_REFRESH_S, TelemetryRelay
from ntp_manager.service.ingest.telemetry import GpuTelemetry, TelemetryStore
from ntp_manager.store import outbox


def test_the_layout_notification_payload_round_trips() -> None:
    assert parse_payload(notify_payload("llm:a", 3, 17)) == ("llm:a", 3, 17)  # a job name may hold ':'
    assert parse_payload("") is None
    assert parse_payload("x:y:llm") is None


def sample(uuid: str, **kw: Any) -> agent_pb2.GpuTelemetry:
    base = {"clock_event_reasons": 0, "sm_clock_mhz": 1800, "sm_clock_max_mhz": 1980, "usage_mw": 400_000,
            "limit_mw": 700_000, "temperature_c": 60}
    return agent_pb2.GpuTelemetry(uuid=uuid, **{**base, **kw})


def relay() -> tuple[TelemetryRelay, list[outbox.Entry]]:
    stored: list[outbox.Entry] = []

    def submit(e: outbox.Entry) -> asyncio.Future[None]:
        stored.append(e)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    return TelemetryRelay(submit, "m1"), stored


async def test_the_relay_stores_what_changed_and_what_is_old() -> None:
    r, stored = relay()
    r.record("n0", ["G0", "G1"], [sample("G0"), sample("G1"), sample("G-other")], at=100.0)
    assert r.flush() is not None
    assert stored[-1].kind == TELEMETRY and sorted(s[-1] for s in stored[-1].payload["samples"]) == ["G0", "G1"]
    # the next period: G0 throttles (a material change), G1 drifts a little (not relayed)
    r.record("n0", ["G0", "G1"], [sample("G0", clock_event_reasons=0x20), sample("G1", temperature_c=61)], at=102.0)
    r.flush()
    assert [s[-1] for s in stored[-1].payload["samples"]] == ["G0"] and r.skipped == 1
    # nothing new: nothing stored; a steady sample is relayed again once it is TELEMETRY_REFRESH_S old
    assert r.flush() is None
    r.record("n0", ["G0", "G1"], [sample("G1", temperature_c=61)], at=100.0 + TELEMETRY_REFRESH_S)
    r.flush()
    assert [s[-1] for s in stored[-1].payload["samples"]] == ["G1"]
    # what the leader rebuilds from a row is the sample the agent sent
    *fields, gpu = stored[-1].payload["samples"][0]
    t = GpuTelemetry(*fields)
    assert (gpu, t.node, t.temperature_c, t.at) == ("G1", "n0", 61, 100.0 + TELEMETRY_REFRESH_S)


async def test_an_agent_that_moves_away_is_relayed_in_full_when_it_comes_back() -> None:
    r, stored = relay()
    r.record("n0", ["G0"], [sample("G0")], at=1.0)
    r.flush()
    r.forget(["G0"])
    r.record("n0", ["G0"], [sample("G0")], at=2.0)
    assert r.flush() is not None and len(stored) == 2


def test_the_leader_keeps_the_newest_sample_of_a_gpu() -> None:
    store = TelemetryStore()
    old = GpuTelemetry("n0", 5.0, 0, 1800, 1980, 1, 2, 60, None, 0, None, None, None, 0)
    new = GpuTelemetry("n0", 6.0, 0x20, 1200, 1980, 1, 2, 80, None, 0, None, None, None, 0)
    store.put("G0", new)
    store.put("G0", old)  # relayed late (another manager's row after this one): not kept
    got = store.get("G0")
    assert got is not None and got.at == 6.0 and "G0" in store.by_node["n0"]
