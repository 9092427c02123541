"""The liveness pass that does not walk the cluster (service/ingest/liveness.py `SilenceWatch`) finds
exactly the GPUs the full walk finds, on random worlds driven through random histories: time
passing, heartbeats, registrations that move `last_seen` back (takeover grace), health changes
made as a transaction would (reported with `touched`), the pass's own decisions carried out or
failed (reported, as `Liveness.check` does), nodes added, the world reloaded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core import policy
from ntp_manager.service.core.state import GpuRec, NodeRec, World
from ntp_manager.service.ingest.liveness import SilenceWatch, walk

HEALTH = [GpuState.HEALTHY, GpuState.SUSPECT, GpuState.DEGRADED, GpuState.FAILED]


def world(nodes: int, per_node: int, seen: float) -> World:
    w = World()
    for i in range(nodes):
        add_node(w, i, per_node, seen)
    return w


def add_node(w: World, i: int, per_node: int, seen: float) -> None:
    name = f"n{i}"
    w.nodes[name] = NodeRec(name, "d", [], last_seen=seen)
    for j in range(per_node):
        u = f"GPU-{i}-{j}"
        w.gpus[u] = GpuRec(u, name, "d", j, 1000, 100, 1300)
        w.nodes[name].gpus.append(u)


step = st.one_of(
    st.tuples(st.just("advance"), st.floats(0.0, 40.0)),
    st.tuples(st.just("heartbeat"), st.integers(0, 30)),
    st.tuples(st.just("register"), st.integers(0, 30), st.floats(0.0, 30.0)),  # last_seen moves back
    st.tuples(st.just("health"), st.integers(0, 30), st.integers(0, 3), st.sampled_from(HEALTH)),
    st.tuples(st.just("add node"), st.integers(1, 3)),
    st.tuples(st.just("reload"), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(nodes=st.integers(0, 12), per_node=st.integers(1, 3), suspect=st.floats(0.5, 20.0),
       fail_extra=st.floats(0.0, 40.0), steps=st.lists(step, max_size=40), carry_out=st.lists(st.booleans()))
def test_the_watch_finds_what_the_walk_finds(nodes: int, per_node: int, suspect: float, fail_extra: float,
                                             steps: list[tuple[object, ...]], carry_out: list[bool]) -> None:
    options = policy.LivenessOptions(suspect, suspect + fail_extra)
    now = 1000.0
    w = world(nodes, per_node, now + 5.0)  # loaded as seen at the end of a takeover grace
    watch = SilenceWatch(options)
    last: list[tuple[str, str, float]] = []
    for s in steps:
        kind = s[0]
        names = list(w.nodes)
        if kind == "advance":
            now += float(s[1])  # type: ignore[arg-type]
        elif kind == "heartbeat" and names:
            n = w.nodes[names[int(s[1]) % len(names)]]  # type: ignore[call-overload]
            if now < n.last_seen:
                watch.touched([n.name])
            n.last_seen = now
        elif kind == "register" and names:
            n = w.nodes[names[int(s[1]) % len(names)]]  # type: ignore[call-overload]
            n.last_seen = now - float(s[2])  # type: ignore[arg-type]  # back in time: reported
            watch.touched([n.name])
        elif kind == "health" and names:
            n = w.nodes[names[int(s[1]) % len(names)]]  # type: ignore[call-overload]
            w.gpus[n.gpus[int(s[2]) % len(n.gpus)]].health = s[3]  # type: ignore[call-overload, assignment]
            watch.touched([n.name])
        elif kind == "add node":
            for _ in range(int(s[1])):  # type: ignore[call-overload]
                add_node(w, len(w.nodes) + 100, per_node, now)
        elif kind == "reload":
            w = World(gpus={u: g.copy() for u, g in w.gpus.items()},
                      nodes={k: n.copy() for k, n in w.nodes.items()})
            for n in w.nodes.values():
                n.gpus = list(n.gpus)
        last = watch.due(w, now)
        assert sorted(last) == sorted(walk(w, now, options)), (kind, now)
        assert len(set(last)) == len(last)
        if carry_out.pop(0) if carry_out else True:  # the pass's decisions committed, as check() does
            for u, node, seen in last:
                d = policy.liveness(now, seen, node, w.gpus[u].health, options)
                if d.health is not None:
                    w.gpus[u].health = d.health
        watch.touched({node for _, node, _ in last})  # by the commit, or by check() when it failed


def test_a_pass_looks_at_the_nodes_near_their_deadline_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1,000 nodes heard from at t = 0..999; suspect after 100 s. At t = 1,050 the nodes seen before
    # t = 950 are silent (950 of them); later passes ask only about what changed.
    options = policy.LivenessOptions(100.0, 10_000.0)
    w = world(1000, 2, 0.0)
    for i, n in enumerate(w.nodes.values()):
        n.last_seen = float(i)
    watch = SilenceWatch(options)
    asked: list[str] = []
    real = policy.liveness

    def counting(now: float, seen: float, node: str, health: GpuState,
                 o: policy.LivenessOptions) -> policy.HealthDecision:
        asked.append(node)
        return real(now, seen, node, health, o)

    monkeypatch.setattr(policy, "liveness", counting)
    first = watch.due(w, 1050.0)
    assert len(first) == 2 * 950 and len(asked) == 2 * 950  # each silent node's GPUs, once
    for u, _, _ in first:
        w.gpus[u].health = GpuState.SUSPECT
    watch.touched({n for _, n, _ in first})
    asked.clear()
    assert watch.due(w, 1050.0) == [] and len(asked) == 2 * 950  # the changed nodes, asked again
    asked.clear()
    assert watch.due(w, 1050.0) == [] and asked == []  # nothing changed: nobody asked
    # node 950 (seen at 950) is silent from t > 1,050
    assert [u for u, _, _ in watch.due(w, 1050.5)] == ["GPU-950-0", "GPU-950-1"] and len(asked) == 2
    asked.clear()
    w.nodes["n3"].last_seen = 1050.5  # heard from: leaves the silent nodes, not asked
    watch.touched(["n950"])  # node 950's decision was not carried out: asked again, and only it
    assert [u for u, _, _ in watch.due(w, 1050.5)] == ["GPU-950-0", "GPU-950-1"] and asked == ["n950", "n950"]


@settings(max_examples=100, deadline=None)
@given(placed=st.lists(st.integers(0, 4), max_size=60), later=st.lists(st.integers(0, 5), max_size=10))
def test_a_domains_gpus_come_from_an_index_that_follows_new_gpus(placed: list[int], later: list[int]) -> None:
    # the maintenance listing of a domain window (every monitor tick): the index gives what a walk of
    # every GPU gives, in the same order, also after GPUs were added (a shape change)
    w = World()

    def add(i: int, d: int) -> None:
        w.gpus[f"GPU-{i}"] = GpuRec(f"GPU-{i}", "n", f"d{d}", i, 1000, 100, 1300)

    for i, d in enumerate(placed):
        add(i, d)
    for d in range(6):
        assert w.gpus_of_domain(f"d{d}") == [u for u, g in w.gpus.items() if g.domain == f"d{d}"]
    for k, d in enumerate(later):
        add(1000 + k, d)
    w.invalidate()  # what the kernel does when a transaction adds GPUs
    for d in range(6):
        assert w.gpus_of_domain(f"d{d}") == [u for u, g in w.gpus.items() if g.domain == f"d{d}"]
