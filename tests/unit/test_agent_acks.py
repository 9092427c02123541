"""The agent stream's acks (rpc/agents.py `_Stream`): cumulative, in order, never past a failure.

The stream is driven by a door whose report futures this test resolves itself, in the orders a
group commit, a replay and a failed store produce; what the session's outbox receives is checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ntp_manager.contract.proto.ntp.v1 import agent_pb2, common_pb2
from ntp_manager.rpc.agents import PIPELINE, _Stream
from ntp_manager.service.core.errors import InvalidArgument, Unavailable
from ntp_manager.service.core.inputs import GpuReport
from ntp_manager.service.ingest.agents import Ack, AgentSession, EndStream


class Door:
    """An `AgentDoor` whose reports wait for the test: `futs[seq]` is the future of report `seq`;
    `done_at_once` seqs are answered at once (a replay of a durable report)."""

    def __init__(self, done_at_once: frozenset[int] = frozenset()) -> None:
        self.futs: dict[int, asyncio.Future[int]] = {}
        self.done_at_once = done_at_once
        self.reported = asyncio.Event()

    def report(self, session: AgentSession, seq: int, gpus: list[GpuReport]) -> asyncio.Future[int]:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if seq in self.done_at_once:
            fut.set_result(seq)
        self.futs[seq] = fut
        self.reported.set()
        return fut

    def heartbeat(self, node: str, gpus: Any) -> None:
        pass


def _report(seq: int) -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(report=agent_pb2.HealthReport(seq=seq, gpus=[agent_pb2.GpuHealth(
        uuid="GPU-0", state=common_pb2.GPU_STATE_DEGRADED)]))


class Messages:
    """The agent's side of the stream: messages put by the test, ended by `end()`."""

    def __init__(self) -> None:
        self.q: asyncio.Queue[agent_pb2.AgentMessage | None] = asyncio.Queue()

    def send(self, *seqs: int) -> None:
        for s in seqs:
            self.q.put_nowait(_report(s))

    def end(self) -> None:
        self.q.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[agent_pb2.AgentMessage]:
        while (m := await self.q.get()) is not None:
            yield m


async def _until(cond: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.001)


def _drain(session: AgentSession) -> list[Any]:
    out = []
    while not session.outbox.empty():
        out.append(session.outbox.get_nowait())
    return out


def _start(door: Door) -> tuple[_Stream, AgentSession, Messages]:
    session, msgs = AgentSession("node-0"), Messages()
    return _Stream(door, session, msgs.__aiter__()), session, msgs  # type: ignore[arg-type]


async def test_reports_durable_together_get_one_ack_and_the_stream_end_comes_after_them() -> None:
    door = Door()
    stream, session, msgs = _start(door)
    msgs.send(1, 2, 3)
    await _until(lambda: len(door.futs) == 3)
    assert _drain(session) == []  # nothing durable yet
    for s in (1, 2, 3):  # one group commit: resolved one after another in the same loop turn
        door.futs[s].set_result(s)
    await _until(lambda: not session.outbox.empty())
    await asyncio.sleep(0.01)
    assert _drain(session) == [Ack(3)]
    msgs.send(4)
    msgs.end()  # the agent ends its stream with report 4 still in the commit
    await _until(lambda: 4 in door.futs)
    await asyncio.sleep(0.01)
    assert _drain(session) == []
    door.futs[4].set_result(4)
    await _until(lambda: stream.reader.done())
    assert _drain(session) == [Ack(4), None]
    await stream.close()


async def test_a_report_done_before_an_earlier_one_waits_for_it() -> None:
    door = Door(done_at_once=frozenset({2}))  # 2 is answered at once, 1 is still in the commit
    stream, session, msgs = _start(door)
    msgs.send(1, 2)
    await _until(lambda: len(door.futs) == 2)
    await asyncio.sleep(0.01)
    assert _drain(session) == []  # never "2" while 1 is not durable
    door.futs[1].set_result(1)
    await _until(lambda: not session.outbox.empty())
    assert _drain(session) == [Ack(2)]
    await stream.close()


@pytest.mark.parametrize("error, status", [(Unavailable("the store is away"), "UNAVAILABLE"),
                                           (InvalidArgument("report.seq: bad"), "INVALID_ARGUMENT"),
                                           (RuntimeError("a bug"), "INTERNAL")])
async def test_a_failed_report_acks_those_before_it_then_ends_the_stream(error: Exception, status: str) -> None:
    door = Door()
    stream, session, msgs = _start(door)
    msgs.send(1, 2, 3)
    await _until(lambda: len(door.futs) == 3)
    door.futs[1].set_result(1)
    door.futs[2].set_exception(error)
    door.futs[3].set_result(3)  # after the failure: never acked
    await _until(lambda: session.outbox.qsize() >= 2)
    await asyncio.sleep(0.01)
    out = _drain(session)
    assert out[0] == Ack(1)
    assert isinstance(out[1], EndStream) and out[1].status == status
    if status == "INTERNAL":
        assert "a bug" not in out[1].message  # the error's text stays in the log
    else:
        assert out[1].message == str(error)
    assert all(not isinstance(o, Ack) for o in out[2:])
    msgs.send(4)  # the reader reads no report after the failure
    await _until(lambda: stream.reader.done())
    assert 4 not in door.futs
    await stream.close()


async def test_a_cancelled_report_ends_the_stream_as_unavailable() -> None:
    door = Door()
    stream, session, msgs = _start(door)
    msgs.send(1)
    await _until(lambda: 1 in door.futs)
    door.futs[1].cancel()
    await _until(lambda: not session.outbox.empty())
    (end,) = _drain(session)[:1]
    assert isinstance(end, EndStream) and end.status == "UNAVAILABLE"
    await stream.close()


async def test_no_more_than_pipeline_reports_of_a_stream_are_in_flight() -> None:
    door = Door()
    stream, session, msgs = _start(door)
    msgs.send(*range(1, PIPELINE + 3))
    await _until(lambda: len(door.futs) == PIPELINE)
    await asyncio.sleep(0.05)
    assert len(door.futs) == PIPELINE  # the reader waits for room
    door.futs[1].set_result(1)
    await _until(lambda: len(door.futs) == PIPELINE + 1)
    await asyncio.sleep(0.05)
    assert len(door.futs) == PIPELINE + 1
    for s in range(2, PIPELINE + 2):
        door.futs[s].set_result(s)
    await _until(lambda: len(door.futs) == PIPELINE + 2)
    door.futs[PIPELINE + 2].set_result(PIPELINE + 2)
    await _until(lambda: Ack(PIPELINE + 2) in list(session.outbox._queue))  # type: ignore[attr-defined]
    acks = [o.seq for o in _drain(session) if isinstance(o, Ack)]
    assert acks == sorted(acks) and acks[0] == 1 and acks[-1] == PIPELINE + 2
    await stream.close()
