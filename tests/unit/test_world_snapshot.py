"""service/core/state.py: the planner's snapshot of the world follows the GPUs' states. State
changes are applied to it lazily (all of them in one copy when it is next asked for), never lost:
the snapshot always agrees with the records, whenever and however it is asked for."""

from __future__ import annotations

import asyncio
import random

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.state import INLINE_STATES, GpuRec, NodeRec, World
from ntp_manager.topology import Cluster


def world(domains: int = 6, per: int = 4) -> World:
    w = World()
    for d in range(domains):
        node = NodeRec(f"n{d}", f"d{d}", [])
        w.nodes[node.name] = node
        w.domains[node.domain] = None
        for i in range(per):
            u = f"G{d}-{i}"
            w.gpus[u] = GpuRec(u, node.name, node.domain, i, 700_000, 100_000, 800_000, pos=w.take_pos())
            w.by_pos[w.gpus[u].pos] = u
            node.gpus.append(u)
    return w


def agrees(w: World, c: Cluster) -> bool:
    states = {g.uuid: (g.state, g.speed) for d in c.domains for g in d.gpus}
    return states == {u: (g.state, g.planned_speed) for u, g in w.gpus.items()}


def test_state_changes_reach_the_snapshot_when_it_is_next_asked_for() -> None:
    w = world()
    first = w.cluster()
    assert w.cluster() is first  # cached
    w.gpus["G1-2"].health = GpuState.FAILED
    w.apply_states(["G1-2"])
    w.gpus["G3-0"].health = GpuState.DEGRADED
    w.gpus["G3-0"].speed = 0.5
    w.apply_states(iter(["G3-0"]))  # any iterable
    now = w.cluster()
    assert now is not first and agrees(w, now)
    assert now.domains[0] is first.domains[0]  # untouched domains are shared, not copied
    assert w.cluster() is now  # nothing more to apply


def test_random_changes_and_reads_keep_the_snapshot_equal_to_the_records() -> None:
    rng = random.Random(7)
    w = world()
    states = [GpuState.HEALTHY, GpuState.FAILED, GpuState.SUSPECT, GpuState.DEGRADED]

    async def main() -> None:
        for step in range(300):
            u = rng.choice(list(w.gpus))
            w.gpus[u].health = rng.choice(states)
            w.gpus[u].speed = rng.choice([None, 0.5])
            w.apply_states([u])
            if step % 37 == 0:
                w.invalidate()  # as after a registration: rebuilt from the records
            if rng.random() < 0.3:
                c = await w.cluster_async() if rng.random() < 0.5 else w.cluster()
                assert agrees(w, c)
        assert agrees(w, await w.cluster_async())

    asyncio.run(main())


def test_changes_made_while_the_snapshot_is_built_off_the_loop_are_in_it() -> None:
    w = world()

    async def main() -> None:
        building = asyncio.ensure_future(w.cluster_async())
        await asyncio.sleep(0)  # the build has started in its thread
        w.gpus["G2-1"].health = GpuState.FAILED
        w.apply_states(["G2-1"])
        c = await building
        assert agrees(w, c) and agrees(w, await w.cluster_async())

    asyncio.run(main())


def test_a_backlog_of_changes_is_applied_off_the_loop_and_nothing_is_lost_meanwhile() -> None:
    """More than INLINE_STATES changes at once (a silent rack): applied in a worker thread, while
    other callers wait for it and the records keep changing; every caller gets a snapshot that
    agrees with the records as they were when it asked, and the last agrees with them now."""
    w = world(domains=100, per=8)
    rng = random.Random(3)

    async def main() -> None:
        await w.cluster_async()
        for step in range(6):
            many = rng.sample(list(w.gpus), INLINE_STATES + 100)
            for u in many:
                w.gpus[u].health = GpuState.SUSPECT if step % 2 == 0 else GpuState.HEALTHY
            w.apply_states(many)

            async def change_meanwhile() -> None:
                await asyncio.sleep(0)
                u = rng.choice(list(w.gpus))
                w.gpus[u].health = GpuState.FAILED
                w.apply_states([u])

            first, second, _ = await asyncio.gather(w.cluster_async(), w.cluster_async(), change_meanwhile())
            assert agrees(w, await w.cluster_async())
            assert first is not None and second is not None
        assert agrees(w, await w.cluster_async())

    asyncio.run(main())
