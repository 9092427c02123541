"""How the fleet leader cuts the outbox rows it read into transactions (service/ingest/consumer.py): at most
WEIGHT rows written per transaction, so its fence (which the lease renewal waits for) is short."""

from __future__ import annotations

from ntp_manager.service.ingest.consumer import WEIGHT, batch_end, weight
from ntp_manager.store import outbox


def _hello(seq: int, gpus: int = 8) -> outbox.Stored:
    return outbox.Stored(seq, outbox.HELLO, f"n{seq}", None,
                         {"gpus": [[f"G{seq}-{k}", k, "m", 1, 1, 1, 1] for k in range(gpus)]}, "m0")


def _report(seq: int) -> outbox.Stored:
    return outbox.Stored(seq, outbox.REPORT, f"n{seq}", 1, {"gpus": [[f"G{seq}-0", "healthy", [], [], None]]}, "m0")


def test_hellos_are_cut_by_the_rows_they_write() -> None:
    rows = [_hello(i) for i in range(1, 2049)]
    assert weight(rows[0]) == 10
    n = batch_end(rows)
    assert n == WEIGHT // 10  # 204 hellos: 2,040 rows written, the next would pass 2,048
    assert sum(weight(r) for r in rows[:n]) <= WEIGHT < sum(weight(r) for r in rows[:n + 1])


def test_light_rows_fill_a_batch_and_one_heavy_row_still_goes_alone() -> None:
    reports = [_report(i) for i in range(1, 1001)]
    assert batch_end(reports) == 1000  # 2,000 rows written: all of them
    seen = [outbox.Stored(i, outbox.SEEN, "", None, {"nodes": ["a"] * 50}, "m0") for i in range(1, 2049)]
    assert batch_end(seen) == 2048
    huge = [_hello(1, gpus=5000), _report(2)]
    assert batch_end(huge) == 1  # over the budget alone: applied alone, never zero rows
    assert batch_end([]) == 0
