"""rpc/tally.py: a storm of connections is logged as one line per period with a count; an event
that comes alone is logged at once with its fields. Time comes from a fake clock."""

from __future__ import annotations

from typing import Any

from ntp_manager.rpc.tally import Tally


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


async def test_a_storm_is_one_line_per_period_and_a_lone_event_is_logged_at_once() -> None:
    now = [100.0]
    out = Lines()
    t = Tally(out, "agent connected", period_s=1.0, names=3, clock=lambda: now[0])
    t.add("n0", last_seq=4, gpus=8)  # alone: logged at once, with its fields
    assert out.lines == [("agent connected", {"node": "n0", "last_seq": 4, "gpus": 8})]
    for i in range(1, 1000):  # the rest of the fleet within the period: counted
        t.add(f"n{i}", last_seq=0, gpus=8)
    assert len(out.lines) == 1
    t.flush()  # the end of the period (the loop's timer calls it)
    assert out.lines[1] == ("agent connected", {"count": 999, "first": ["n1", "n2", "n3"], "coalesced_s": 1.0})
    now[0] += 0.5  # still inside the new period: counted again
    t.add("late")
    assert len(out.lines) == 2
    t.flush()
    assert out.lines[2][1]["count"] == 1 and out.lines[2][1]["first"] == ["late"]
    now[0] += 5  # quiet for longer than a period: the next one is alone again
    t.add("n7", last_seq=1, gpus=8)
    assert out.lines[3] == ("agent connected", {"node": "n7", "last_seq": 1, "gpus": 8})
    t.flush()  # nothing counted: no line
    assert len(out.lines) == 4
