"""Liveness: owns turning a node's silence into its GPUs' health (suspect, then failed).

Each monitor pass asks `policy.liveness` about every GPU of every node not heard from within
`suspect_after_s`, and submits the transitions as one group-committed transaction (a report that
lands in the same batch is taken into account: the decision is made again on the transaction's
view). A returning agent's GPUs are healed at registration (`policy.reconnect`, service/ingest/agents.py).

A manager that has just become the leader (a start, a failover) loads every node as seen
`takeover_grace_s` from now: agents are reconnecting to it then, and their silence says nothing
about their GPUs. So a failover fails no GPU by silence, and never trips the breaker, before
`takeover_grace_s + fail_after_s`, nor makes one suspect before `takeover_grace_s +
suspect_after_s`; an agent that registers with the new leader is judged from then on, as always.

A pass runs on the event loop every monitor tick, so it does not walk the cluster
(`SilenceWatch`): nodes wait in a heap ordered by when they were last heard from, and a pass looks
only at the nodes that went silent since the last one, the silent ones that crossed `fail_after_s`,
and the silent ones whose GPUs changed meanwhile. At 12,500 nodes x 8 GPUs all silent, the full walk
asked the policy 100,000 times per tick (bench/loop_costs.py); the result is the same
(`SilenceWatch.due` == `walk`, checked on random worlds in tests/unit/test_liveness_watch.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Awaitable, Callable, Iterable

from ntp_manager.service.core import offloop, policy
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.state import HealthSource, World, health_to
from ntp_manager.settings import Settings

Due = tuple[str, str, float]  # (GPU, its node, when the node was last heard from)
SLICE = 100  # more silent nodes than this at once: their GPUs are asked about in a worker thread
CHUNK = 500  # GPU transitions per transaction (its records are made and applied on the loop)


def walk(world: World, now: float, options: policy.LivenessOptions) -> list[Due]:
    """Every GPU whose health silence changes now: the whole cluster, looked at. The reference
    `SilenceWatch.due` gives the same as (O(nodes + GPUs of silent nodes))."""
    todo = []
    for node in world.nodes.values():
        if now - node.last_seen <= options.suspect_after_s:
            continue
        todo.extend(_decide(world, node.name, now, options))
    return todo


def _decide(world: World, name: str, now: float, options: policy.LivenessOptions) -> list[Due]:
    node = world.nodes[name]
    return [(u, name, node.last_seen) for u in node.gpus
            if policy.liveness(now, node.last_seen, name, world.gpus[u].health, options).health is not None]


class SilenceWatch:
    """The GPUs `walk` would give, found by looking at the few nodes whose answer can have changed.

    A node's answer changes only when (a) it goes silent (`now - last_seen` passes
    `suspect_after_s`), (b) a silent node passes `fail_after_s`, (c) it is heard from (`last_seen`
    moves: it is not silent any more), (d) one of its GPUs' health changes (`touched`, from every
    committed transaction), or (e) the world is reloaded or gains nodes (all rebuilt). Nodes not
    silent wait in a heap by the `last_seen` they had when pushed; a heartbeat does not touch the
    heap (an entry whose node was heard from since is pushed again with the new time when it comes
    up), so each node comes up at most once per `suspect_after_s`. Silent nodes are checked each
    pass for having been heard from (one comparison each); their GPUs are asked about only on (a),
    (b) and (d).

    Preconditions: a `last_seen` that moves *back* (a node loaded as seen at the end of the takeover
    grace registers before it) is reported with `touched(node)` before the next pass (one that moves
    forward needs nothing); and the decisions of a pass are either carried out (their GPUs change:
    touched by the commit) or their nodes are reported with `touched`, else they are not given again."""

    def __init__(self, options: policy.LivenessOptions) -> None:
        self.options = options
        self._world: World | None = None
        self._nodes = 0
        self._quiet: list[tuple[float, str]] = []  # (last_seen when pushed, node): nodes not silent
        self._key: dict[str, float] = {}  # node -> the last_seen of its live entry in `_quiet`
        self._silent: dict[str, float] = {}  # silent node -> its last_seen
        self._failing: list[tuple[float, str]] = []  # silent nodes by last_seen, until past fail_after_s
        self._touched: set[str] = set()  # nodes whose GPUs changed since the last pass

    def touched(self, nodes: Iterable[str]) -> None:
        self._touched.update(nodes)

    def _rebuild(self, world: World) -> None:
        self._world, self._nodes = world, len(world.nodes)
        self._quiet = [(n.last_seen, name) for name, n in world.nodes.items()]
        heapq.heapify(self._quiet)
        self._key = {name: n.last_seen for name, n in world.nodes.items()}
        self._silent, self._failing, self._touched = {}, [], set()

    def _push(self, name: str, seen: float) -> None:
        self._key[name] = seen
        heapq.heappush(self._quiet, (seen, name))

    def due(self, world: World, now: float) -> list[Due]:
        """What `walk(world, now, options)` gives (order aside)."""
        todo: list[Due] = []
        for name in self.nodes_to_ask(world, now):
            todo.extend(_decide(world, name, now, self.options))
        return todo

    def nodes_to_ask(self, world: World, now: float) -> list[str]:
        """The silent nodes whose GPUs' decisions may have changed since the last pass (`due`
        asks the policy about each of their GPUs; O(silent nodes + the nodes that came up))."""
        if world is not self._world or len(world.nodes) != self._nodes:
            self._rebuild(world)
        o = self.options
        ask = {n for n in self._touched if n in self._silent}
        for name in self._touched - self._silent.keys():  # seen earlier than its entry says: enter anew
            node = world.nodes.get(name)
            if node is not None and node.last_seen < self._key.get(name, node.last_seen + 1.0):
                self._push(name, node.last_seen)
        self._touched = set()
        for name, seen in list(self._silent.items()):  # (c) heard from again
            node = world.nodes.get(name)
            if node is None or node.last_seen != seen:
                del self._silent[name]
                ask.discard(name)
                if node is not None:
                    self._push(name, node.last_seen)
        quiet = self._quiet
        while quiet and now - quiet[0][0] > o.suspect_after_s:  # (a) gone silent
            seen, name = heapq.heappop(quiet)
            if self._key.get(name) != seen:  # an entry replaced by a newer one
                continue
            del self._key[name]
            node = world.nodes.get(name)
            if node is None:
                continue
            if node.last_seen != seen:  # heard from since it was pushed
                self._push(name, node.last_seen)
                continue
            self._silent[name] = seen
            heapq.heappush(self._failing, (seen, name))
            ask.add(name)
        failing = self._failing
        while failing and now - failing[0][0] > o.fail_after_s:  # (b) past fail_after_s
            seen, name = heapq.heappop(failing)
            if self._silent.get(name) == seen:
                ask.add(name)
        return sorted(ask)


class Liveness:
    def __init__(self, kernel: Kernel, settings: Settings) -> None:
        self.kernel = kernel
        self.options = policy.LivenessOptions(settings.suspect_after_s, settings.fail_after_s)
        self.quiet_until = 0.0  # monotonic; nodes loaded at a takeover count as seen at this time
        self.watch = SilenceWatch(self.options)
        kernel.after_commit.append(self._react)

    def _react(self, tx: Tx) -> None:
        gpus = self.kernel.world.gpus
        self.watch.touched({gpus[u].node for u in tx.gpus_written if u in gpus})

    def due(self, now: float) -> list[Due]:
        """The GPUs whose health silence changes at `now` (service/ingest/liveness.py: not a walk)."""
        return self.watch.due(self.kernel.world, now)

    async def check(self) -> int:
        """One monitor pass; returns how many GPUs changed health.

        When many nodes went silent at once (at 12,500 nodes, all of them: 100,000 GPUs), the
        policy is asked about their GPUs in a worker thread (it reads the records; each GPU is
        decided again in its transaction) and the transitions are written CHUNK GPUs per
        transaction, the loop free between them."""
        now = self.kernel.clock.monotonic()
        w = self.kernel.world
        ask = [name for name in self.watch.nodes_to_ask(w, now) if name in w.nodes]
        if not ask:
            return 0
        if len(ask) <= SLICE:
            todo = [d for name in ask for d in _decide(w, name, now, self.options)]
        else:
            todo = await offloop.run(lambda: [d for name in ask for d in _decide(w, name, now, self.options)])
        changed = 0
        for i in range(0, len(todo), CHUNK):
            part = todo[i : i + CHUNK]
            try:
                changed += await self.kernel.submit("heartbeat-monitor", self._writer(now, part))
            except BaseException:
                self.watch.touched({node for _, node, _ in todo[i:]})  # not carried out: asked again
                raise
        return changed

    def _writer(self, now: float, todo: list[Due]) -> Callable[[Tx], Awaitable[int]]:
        async def write(tx: Tx) -> int:
            changed = 0
            for u, node, seen in todo:
                g = tx.gpu(u)
                d = policy.liveness(now, seen, node, g.health, self.options)
                if d.health is None:
                    continue
                tx.event(g, d.health, [d.reason], source="heartbeat")
                tx.change_gpu(u, health_to(d.health, d.reason, HealthSource.HEARTBEAT, tx.now))
                changed += 1
            return changed

        return write
