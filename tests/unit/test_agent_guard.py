"""A GPU whose driver calls hang: failed on its own, within the call deadline; the rest goes on.

The fake backend's `hang` fault blocks every call about that GPU until a repair, as a hung driver
does. Before the guard, one such call on the agent's loop silenced the whole node (no heartbeats),
so the manager failed all its GPUs after the heartbeat timeout instead of the one that hung.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from ntp_agent.backends.fake import FakeBackend, parse_scenario
from ntp_agent.core import Agent, AgentConfig
from ntp_agent.guard import GpuHung, GuardedBackend

TIMEOUT_S = 0.3


def _backend(now: list[float]) -> FakeBackend:
    sc = parse_scenario({"gpus": 3, "faults": [{"at": 1, "gpu": 1, "kind": "hang"},
                                               {"at": 5, "gpu": 1, "kind": "repair"}]})
    return FakeBackend(sc, clock=lambda: now[0])


def test_guard_bounds_a_hung_call_and_fails_later_calls_at_once() -> None:
    now = [0.0]
    be = _backend(now)
    g = GuardedBackend(be, TIMEOUT_S)
    hung, other = be.gpus()[1].uuid, be.gpus()[0].uuid
    assert g.sample(hung).uuid == hung  # before the fault: answers
    now[0] = 1.5
    with pytest.raises(GpuHung, match="did not answer a sample"):
        g.sample(hung)
    assert g.stuck(hung) is not None and g.stuck(hung)[0] == "a sample"  # type: ignore[index]
    # fails at once, naming the call still stuck: no second call is parked behind it
    with pytest.raises(GpuHung, match="did not answer a sample"):
        g.get_limit_mw(hung)
    assert g.sample(other).uuid == other and g.stuck(other) is None  # its own thread: unaffected
    now[0] = 5.5  # repaired: the stuck call returns, and the GPU answers again
    for _ in range(200):
        if g.stuck(hung) is None:
            break
        time.sleep(0.01)
    assert g.stuck(hung) is None
    assert g.sample(hung).uuid == hung
    g.close()


def test_agent_fails_only_the_hung_gpu_and_keeps_heartbeating() -> None:
    now = [0.0]
    be = _backend(now)
    a = Agent(be, AgentConfig(manager="x", token="t", node="n", domain="d", gpu_call_timeout_s=TIMEOUT_S))
    a.sample_all()
    assert {v.state for v in a.verdicts.values()} == {"healthy"}
    now[0] = 1.5
    a.sample_all()
    hung = be.gpus()[1].uuid
    states = {u: v.state for u, v in a.verdicts.items()}
    assert states[hung] == "failed" and sorted(states.values()) == ["failed", "healthy", "healthy"]
    assert a.verdicts[hung].reasons == (f"GPU not answering: a sample took over {TIMEOUT_S:g}s",)
    assert [r.gpus for r in a.pending][-1] == {hung: a.verdicts[hung]}  # reported at once
    beat = a.heartbeat_msg().heartbeat
    assert {t.uuid for t in beat.gpus} == {g.uuid for g in be.gpus()} - {hung}  # no stale telemetry
    # a power command for the hung GPU answers at once (the stuck sample is named), it does not block
    st = a.power.set(hung, 900_000)
    assert st.error is not None and "did not answer a sample" in st.error
    now[0] = 3.0  # still hung: the verdict stays, nothing new is reported
    n = len(a.pending)
    a.sample_all()
    assert a.verdicts[hung].state == "failed" and len(a.pending) == n
    a.guarded.close()


async def test_the_event_loop_keeps_turning_while_a_gpu_hangs() -> None:
    """The agent reads counters on a worker thread: while a read hangs, the event loop (heartbeats,
    the manager's commands) keeps running, and the hung GPU is failed when the deadline passes."""
    now = [0.0]
    be = _backend(now)
    now[0] = 1.5  # the hang is in force from the start
    a = Agent(be, AgentConfig(manager="127.0.0.1:9", token="t", node="n", domain="d", sample_interval_s=0.05,
                              gpu_call_timeout_s=1.0, backoff_initial_s=5.0))
    turns = 0

    async def ticker() -> None:  # stands in for the heartbeat task
        nonlocal turns
        while True:
            await asyncio.sleep(0.02)
            turns += 1

    tick = asyncio.create_task(ticker())
    task = asyncio.create_task(a.run())
    hung = be.gpus()[1].uuid
    for _ in range(1000):
        if a.verdicts[hung].state == "failed":
            break
        await asyncio.sleep(0.01)
    turns_while_hung = turns  # from the start to the verdict
    a.stopping.set()
    tick.cancel()
    await asyncio.wait_for(task, 10)
    assert a.verdicts[hung].state == "failed"
    assert sum(v.state == "healthy" for v in a.verdicts.values()) == 2
    # the first read waited out its 1 s deadline; a read made on the loop would have held the loop
    # (and this ticker) for that whole second
    assert turns_while_hung >= 10


def test_a_heartbeat_is_sent_when_its_counters_say_something_new_or_the_quiet_is_over() -> None:
    """agent/ntp_agent/core.py `beat_due`: liveness is the stream's (the manager pings it), so a
    heartbeat carries news: sent at once when a GPU's counters change materially (a throttle, an
    error counter; contract/telemetry.py), else after `quiet_s`; small drifts wait."""
    now = [0.0]
    sc = parse_scenario({"gpus": 2, "faults": [{"at": 5, "gpu": 1, "kind": "thermal_throttle"}]})
    be = FakeBackend(sc, clock=lambda: now[0])
    a = Agent(be, AgentConfig(manager="x", token="t", node="n", domain="d"))
    a.quiet_s = 10.0
    a.sample_all()
    assert a.beat_due(a.heartbeat_msg(), 0.0)  # the first one of a stream
    assert not a.beat_due(a.heartbeat_msg(), 2.0)  # nothing new
    now[0] = 3.0
    a.sample_all()
    msg = a.heartbeat_msg()
    msg.heartbeat.gpus[0].usage_mw = int(a.sent[msg.heartbeat.gpus[0].uuid].usage_mw * 1.05)  # a 5 % drift
    assert not a.beat_due(msg, 4.0)
    now[0] = 6.0  # GPU 1 throttles: clock-event reasons, SM clock, temperature change
    a.sample_all()
    assert a.beat_due(a.heartbeat_msg(), 6.0)
    assert not a.beat_due(a.heartbeat_msg(), 8.0)
    assert a.beat_due(a.heartbeat_msg(), 16.0)  # the longest quiet since the last one sent
    msg = a.heartbeat_msg()
    del msg.heartbeat.gpus[1]  # a GPU no longer read: news
    assert a.beat_due(msg, 17.0)
    a.guarded.close()
