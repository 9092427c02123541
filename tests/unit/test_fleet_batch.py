"""How the fleet leader cuts the outbox rows it read into transactions (service/ingest/consumer.py): at most
WEIGHT rows written per transaction, so its fence (which the lease renewal waits for) is short."""

from __future__ import annotations

import random

import pytest

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.inputs import GpuInventory
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.service.core.state import GpuRec, HealthSource, NodeRec, World
from ntp_manager.service.ingest.agents import Agents
from ntp_manager.service.ingest.consumer import WEIGHT, batch_end, unchanged_hello, weight
from ntp_manager.settings import Settings
from ntp_manager.store import outbox
from tests.fakes.clock import FakeClock


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


# ---- re-hellos that change nothing: weighed by what the apply really writes -------------------

def _inventory(node: str, gpus: int, tweak: int = -1) -> list[list[object]]:
    return [[f"{node}-G{k}", k, "H100", 80 << 30, 700_000 - (1000 if k == tweak else 0), 200_000, 700_000]
            for k in range(gpus)]


def _world_with(nodes: int, gpus: int) -> World:
    w = World()
    for n in range(nodes):
        name = f"n{n}"
        w.domains[f"d{n % 3}"] = None
        w.nodes[name] = NodeRec(name, f"d{n % 3}", [f"{name}-G{k}" for k in range(gpus)], 0, "boot-1")
        for k in range(gpus):
            u = f"{name}-G{k}"
            w.gpus[u] = GpuRec(u, name, f"d{n % 3}", k, 700_000, 200_000, 700_000, model="H100",
                               memory_bytes=80 << 30, pos=w.take_pos())
            w.by_pos[w.gpus[u].pos] = u
    return w


def _rows_written(w: World, r: outbox.Stored) -> int:
    """What applying `r` to `w` writes, by the real apply (service/ingest/agents.py) in a kernel
    transaction that is never committed."""
    kernel = Kernel(None, FakeClock(), w)  # type: ignore[arg-type]  # no store: nothing commits
    tx = Tx(kernel, None, "outbox")  # type: ignore[arg-type]
    agents = Agents(kernel, Settings(), Metrics())
    inv = [GpuInventory(str(u), int(i), str(mo), int(mem), int(d), int(lo), int(hi))
           for u, i, mo, mem, d, lo, hi in r.payload["gpus"]]
    agents.write_hello(tx, r.node, str(r.payload["domain"]), inv, str(r.payload["boot_id"]), "v1", None, "")
    return tx.rows_written()


@pytest.mark.parametrize("seed", range(40))
def test_a_rehello_weighs_what_its_apply_writes(seed: int) -> None:
    """Random worlds and hellos: an unchanged re-hello weighs 2 and its apply writes at most that
    (its audit row, its node's boot id); any difference the apply acts on (a GPU to bring back
    from silence, an inventory change, a GPU added or missing, an unknown node) weighs as before."""
    rng = random.Random(seed)
    w = _world_with(6, 8)
    silenced = rng.random() < 0.3
    if silenced:  # the liveness check had called a GPU suspect: the re-hello brings it back
        g = w.gpus[f"n1-G{rng.randrange(8)}"]
        g.health, g.health_source = GpuState.SUSPECT, HealthSource.HEARTBEAT
    agent_failed = rng.random() < 0.3
    if agent_failed:  # the agent's own verdict stands: nothing written for it
        g = w.gpus[f"n1-G{rng.randrange(8)}"]
        if g.health == GpuState.HEALTHY:
            g.health, g.health_source = GpuState.FAILED, HealthSource.AGENT
    change = rng.choice(["none", "none", "tweak", "extra", "missing", "unknown", "boot"])
    node = "n9" if change == "unknown" else "n1"
    gpus = {"none": 8, "boot": 8, "tweak": 8, "extra": 9, "missing": 7, "unknown": 8}[change]
    inv = _inventory(node, gpus, tweak=rng.randrange(8) if change == "tweak" else -1)
    rng.shuffle(inv)  # the order of a hello's GPUs does not matter
    domain = "d1" if node == "n1" else "d0"
    r = outbox.Stored(1, outbox.HELLO, node, None, {"gpus": inv, "domain": domain,
                                                      "boot_id": "boot-2" if change == "boot" else "boot-1"}, "m0")
    quiet = change in ("none", "boot") and not silenced
    assert unchanged_hello(node, inv, w) == quiet
    assert weight(r, w) == (2 if quiet else gpus + 2)
    assert weight(r) == gpus + 2  # without the world: as before
    if quiet:
        assert _rows_written(w, r) <= 2
    else:
        assert _rows_written(w, r) > 2 or change == "missing"


def test_unreadable_inventories_are_not_called_unchanged() -> None:
    w = _world_with(1, 2)
    for bad in ([["n0-G0", "x", "H100", 1, 1, 1, 1]], [["n0-G0"]], None, [None, None], "ab"):
        assert not unchanged_hello("n0", bad, w)


def test_a_replay_of_unchanged_rehellos_goes_in_one_transaction() -> None:
    w = _world_with(600, 8)
    rows = [outbox.Stored(i + 1, outbox.HELLO, f"n{i}", None,
                          {"gpus": _inventory(f"n{i}", 8), "domain": f"d{i % 3}", "boot_id": "boot-1"}, "m0")
            for i in range(600)]
    assert batch_end(rows, WEIGHT, w) == 600  # 1,200 rows written at most
    assert batch_end(rows, WEIGHT) == WEIGHT // 10  # weighed without the world: 204 a transaction
