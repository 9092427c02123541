"""service/core/changes.py: a transaction's records encoded as a world-log body and applied to
another world give the same records; a body that cannot be applied changes nothing."""

from __future__ import annotations

import json
from dataclasses import fields
from datetime import UTC, datetime

import pytest

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.changes import GPU_FIELDS, NODE_FIELDS, Applied, BadRow, apply_body, encode
from ntp_manager.service.core.state import GpuRec, HealthSource, NodeRec, World

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def node(name: str, domain: str, **kw: object) -> NodeRec:
    return NodeRec(name, domain, [], **kw)  # type: ignore[arg-type]


def gpu(uuid: str, node: str, domain: str, pos: int, **kw: object) -> GpuRec:
    return GpuRec(uuid, node, domain, pos % 4, 700_000, 100_000, 800_000, pos=pos, **kw)  # type: ignore[arg-type]


def records(w: World) -> tuple[dict[str, tuple[object, ...]], dict[str, tuple[object, ...]]]:
    return ({u: tuple(getattr(g, f) for f in GPU_FIELDS) for u, g in w.gpus.items()},
            {n: (*(getattr(r, f) for f in NODE_FIELDS), tuple(r.gpus)) for n, r in w.nodes.items()})


def test_a_body_applied_gives_the_records_it_was_encoded_from() -> None:
    nodes = [node("n0", "d0", last_seq=4, boot_id="b", drain_deadline=NOW, drain_reason="r", agent_version="v")]
    gpus = [gpu("G0", "n0", "d0", 0), gpu("G1", "n0", "d0", 1, health=GpuState.FAILED, health_reason="XID 79",
                                          health_source=HealthSource.AGENT, health_since=NOW, admin=GpuState.CORDONED,
                                          admin_owner="op", admin_reason="cable", desired_mw=750_000, speed=0.5)]
    body = encode(["d0"], nodes, gpus, ["j"])
    assert body is not None
    w, done = World(), Applied()
    apply_body(w, json.loads(body), 5.0, done)
    want = World()
    want.nodes["n0"] = node("n0", "d0", last_seq=4, boot_id="b", drain_deadline=NOW, drain_reason="r",
                            agent_version="v")
    want.nodes["n0"].gpus = ["G0", "G1"]
    for g in gpus:
        want.gpus[g.uuid] = g
    assert records(w) == records(want)
    assert w.by_pos == {0: "G0", 1: "G1"} and w.next_pos == 2 and w.domains == {"d0": None}
    assert done.shape and done.jobs == {"j"} and w.nodes["n0"].last_seen == 5.0

    # a later row changes G0's health and n0's seq: the records are overwritten, not duplicated
    g0 = gpu("G0", "n0", "d0", 0, health=GpuState.SUSPECT, health_reason="silent", health_since=NOW)
    later = encode([], [node("n0", "d0", last_seq=5, boot_id="b", agent_version="v")], [g0], [])
    assert later is not None
    done = Applied()
    apply_body(w, json.loads(later), 6.0, done)
    assert not done.shape and done.states == {"G0"} and w.gpus["G0"].health == GpuState.SUSPECT
    assert w.nodes["n0"].last_seq == 5 and w.nodes["n0"].drain_reason is None and w.nodes["n0"].gpus == ["G0", "G1"]
    assert w.nodes["n0"].last_seen == 5.0  # memory-only fields are this manager's own


def test_nothing_to_say_is_no_row() -> None:
    assert encode([], [], [], []) is None


@pytest.mark.parametrize(("body", "reason"), [
    ({"v": 2}, "version 2"),
    ({"v": 1, "gpus": [["G", "n9", "d0"]]}, "cannot be read"),
    ({"v": 1, "gpus": [[*json.loads(encode([], [], [gpu("G", "n9", "d0", 0)], []) or "")["gpus"][0]]]},
     "unknown node 'n9'"),
    ({"v": 1, "nodes": [["n0", "d0", "x", "b", "not a date", None, "v"]]}, "cannot be read"),
])
def test_a_body_that_cannot_be_applied_changes_nothing(body: dict[str, object], reason: str) -> None:
    w = World()
    w.nodes["n0"] = node("n0", "d0")
    before = records(w)
    with pytest.raises(BadRow, match=reason):
        apply_body(w, body, 0.0, Applied())
    assert records(w) == before and w.gpus == {}


def test_the_fields_are_the_records_own_order() -> None:
    """A GPU record is rebuilt positionally from its row: GPU_FIELDS must be GpuRec's fields, in order."""
    assert tuple(f.name for f in fields(GpuRec)) == GPU_FIELDS
    assert set(NODE_FIELDS) <= {f.name for f in fields(NodeRec)}


# ---- the encoding: orjson where it is exact, the standard library where it would not be -------------


def test_the_body_is_the_json_the_standard_library_writes() -> None:
    # non-ASCII, every field set, and an integer beyond 64 bits (orjson cannot write it: json.dumps does)
    from ntp_manager.service.core.changes import _gpu_row, _node_row

    nodes = [node("n0", "d0", boot_id="b", drain_deadline=NOW)]
    gpus = [gpu("G0", "n0", "d0", 0, health_reason="Überhitzt ✗", speed=0.8, health_since=NOW, desired_mw=1),
            gpu("G1", "n0", "d0", 1, memory_bytes=2**70)]
    for gs in (gpus[:1], gpus):
        body = encode(["d0"], nodes, gs, ["j"])
        assert body is not None
        want = json.dumps({"v": 1, "domains": ["d0"], "nodes": [_node_row(n) for n in nodes],
                           "gpus": [_gpu_row(g) for g in gs], "jobs": ["j"]}, separators=(",", ":"))
        assert json.loads(body) == json.loads(want)
    assert body is not None and json.loads(body)["gpus"][1][GPU_FIELDS.index("memory_bytes")] == 2**70


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_speed_is_refused_not_written_as_null(bad: float) -> None:
    # orjson would write null (and the followers would read "no speed"); json.dumps wrote NaN, which
    # PostgreSQL refused: the transaction failed. Refused here, loudly, naming the GPU.
    with pytest.raises(ValueError, match=r"GPU G1: speed .* is not a finite number"):
        encode([], [], [gpu("G0", "n0", "d0", 0, speed=0.5), gpu("G1", "n0", "d0", 1, speed=bad)], [])


def test_parse_is_the_standard_librarys_loads() -> None:
    from ntp_manager.jsontext import parse

    texts = ['{"a":[1,2.5,null,true,"x"]}', '"\\u00fc"', '"Überhitzt ✗"', "[NaN, Infinity]", "[]", "[1e19]",
             # orjson reads these as floats: the parse must not
             "[" + str(2**70) + "]", str(-(2**63) - 1), '{"k": [0, ' + str(10**25) + "]}", str(2**64 - 1)]
    for text in texts:
        got, want = parse(text), json.loads(text)
        assert repr(got) == repr(want), text  # NaN != NaN: compare the spelling
    with pytest.raises(ValueError):
        parse("{not json")


def test_a_row_overwrites_every_stored_field_of_a_gpu_and_a_node() -> None:
    """The follower copies the fields one by one (changes.py `_overwrite_gpu`, `_overwrite_node`):
    a record whose every field differs from the row's ends equal to the row's, none missed."""
    later = datetime(2026, 2, 3, 4, 5, 6, tzinfo=UTC)
    old_g = gpu("G0", "n0", "d0", 0)
    new_g = GpuRec("G0", "n1", "d1", 3, 710_000, 110_000, 810_000, GpuState.DEGRADED, "slow", HealthSource.DETECTOR,
                   later, GpuState.CORDONED, "op", "cable", 720_000, 700_000, "H200", 141 << 30, 9, 0.75)
    assert all(getattr(old_g, f) != getattr(new_g, f) for f in GPU_FIELDS[1:])
    old_n = node("n0", "d0", last_seq=1, boot_id="a", agent_version="1")
    new_n = node("n0", "d9", last_seq=2, boot_id="b", drain_deadline=later, drain_reason="r", agent_version="2")
    assert all(getattr(old_n, f) != getattr(new_n, f) for f in NODE_FIELDS[1:])
    w = World()
    w.nodes["n0"], w.nodes["n1"] = old_n, node("n1", "d1")
    w.nodes["n0"].gpus = ["G0"]
    w.gpus["G0"], w.by_pos[0] = old_g, "G0"
    body = encode([], [new_n], [new_g], [])
    assert body is not None
    done = Applied()
    apply_body(w, json.loads(body), 1.0, done)
    assert w.gpus["G0"] is old_g and w.nodes["n0"] is old_n  # overwritten in place
    assert tuple(getattr(old_g, f) for f in GPU_FIELDS) == tuple(getattr(new_g, f) for f in GPU_FIELDS)
    assert tuple(getattr(old_n, f) for f in NODE_FIELDS) == tuple(getattr(new_n, f) for f in NODE_FIELDS)
    assert done.shape and done.states == {"G0"} and w.nodes["n1"].gpus == ["G0"] and w.nodes["n0"].gpus == []
