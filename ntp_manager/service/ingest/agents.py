"""Agents and their reports: owns the node agents' sessions (one open stream per node, with its
outbox of typed commands), registration (hello), health reports, heartbeats and power read-backs.

Agents' streams reach the leader through the outbox and its consumer (service/ingest/outbox.py,
consumer.py), which apply hellos and reports with `write_hello` / `write_report` here. The
XX
simulations and tests) take the kernel's group commit directly:

Registrations, reports and power read-backs are group-committed (service/core/kernel.py): each one is
checked against memory first (bounds, the token's node, GPUs of this node), then submitted with a
function that checks again against the transaction's view (another item of the same batch may have
registered the GPU, or applied the previous report) before it writes. A report's seq is applied
once: a replay is acknowledged and ignored, a gap is refused. Heartbeats touch memory only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

import structlog

from ntp_manager.auth import Principal
from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core import policy
from ntp_manager.service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
)
from ntp_manager.service.core.inputs import GpuInventory, GpuReport, check_hello, check_power_readings, check_report
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.service.core.state import (
    HEALTH_STATES,
    GpuChange,
    GpuRec,
    HealthSource,
    NodeChange,
    NodeRec,
    differing,
    health_to,
)
from ntp_manager.settings import Settings

log = structlog.get_logger("ntp.agents")


# ---- commands to an agent (rpc/ turns them into ntp.v1.ManagerMessage) ----------------------------
@dataclass(frozen=True, slots=True)
class Ack:
    seq: int


@dataclass(frozen=True, slots=True)
class SetPower:
    gpu: str
    limit_mw: int
    reason: str


@dataclass(frozen=True, slots=True)
class ReleasePower:
    gpu: str


@dataclass(frozen=True, slots=True)
class Drain:
    deadline: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class EndStream:
    """End the agent's stream with a gRPC status (its name, e.g. "UNAUTHENTICATED"); `move_to`: the
    manager (host:port) the agent should go to (service/leadership/balance.py)."""

    status: str
    message: str
    move_to: str | None = None


AgentCommand = Ack | SetPower | ReleasePower | Drain
Outgoing = AgentCommand | EndStream | None  # None: the stream ends without an error


@dataclass
class AgentSession:
    node: str
    outbox: asyncio.Queue[Outgoing] = field(default_factory=asyncio.Queue)
    closed: bool = False
    # when its stream last brought a message (the event loop's clock; None: no stream, in process)
    heard: float | None = None

    def close(self) -> None:
        self.closed = True
        self.outbox.put_nowait(None)


GONE = "absent from the node's inventory at its last hello"


class Agents:
    def __init__(self, kernel: Kernel, settings: Settings, metrics: Metrics) -> None:
        self.kernel = kernel
        self.settings = settings
        self.metrics = metrics
        self.sessions: dict[str, AgentSession] = {}
        # told of a node whose last_seen moves back (service/ingest/liveness.py's precondition)
        self.seen_earlier: Callable[[str], None] = lambda node: None
        # several managers: sends a command to an agent whose stream another one holds (leadership/shared.py)
        self.remote: Callable[[str, AgentCommand], None] | None = None

    def send(self, node: str, cmd: AgentCommand) -> bool:
        """Queue a command for a node's agent; False when it is not connected (sent on reconnect)."""
        sess = self.sessions.get(node)
        if sess is None:
            if self.remote is not None:
                self.remote(node, cmd)
                return True
            return False
        sess.outbox.put_nowait(cmd)
        return True

    def close_all(self) -> None:
        for sess in list(self.sessions.values()):
            sess.close()

    # ---- identity ---------------------------------------------------------------------------
    async def check_identity(self, principal: Principal, node: str, peer_fingerprint: str | None,
                             peer: str = "") -> None:
        """An agent token speaks for the one node it names, over the certificate it names if any.
        A mismatch is audited and raises PermissionDenied."""
        problem = identity_problem(principal, node, peer_fingerprint)
        if problem is None:
            return
        log.warning("agent identity refused", token=principal.token_id, node=node[:64], problem=problem)
        async with self.kernel.exclusive(f"token:{principal.token_id}") as tx:
            tx.audit(tx.now, "agent.denied", node[:256], reason=problem,
                     after={"token": principal.token_id, "token_node": principal.node, "peer": peer[:200],
                            "peer_fingerprint": peer_fingerprint})
        raise PermissionDenied(problem)

    # ---- registration -------------------------------------------------------------------------
    async def register(
        self, node: str, domain: str, gpus: list[GpuInventory], boot_id: str, agent_version: str,
        principal: Principal | None = None, peer_fingerprint: str | None = None, peer: str = "",
    ) -> tuple[AgentSession, int]:
        """Register (or re-register) a node; returns its session and the last applied report seq.

        With a `principal` (always, from the gRPC edge) the hello must come from the node its token
        names (PermissionDenied, audited, otherwise). Raises InvalidArgument for a malformed
        inventory and ResourceExhausted past `max_cluster_gpus`; nothing is written then. Every
        registration is audited (`node.register`, then `node.rehello` with what changed)."""
        check_hello(node, domain, gpus, boot_id, agent_version)
        if principal is not None:
            await self.check_identity(principal, node, peer_fingerprint, peer)
        token = principal.token_id if principal else None

        async def write(tx: Tx) -> int:
            return self._write_hello(tx, node, domain, gpus, boot_id, agent_version, token, peer)

        self._check_hello_against(None, node, domain, gpus)  # fail fast, before queueing
        last_seq = await self.kernel.submit(f"agent:{node}", write)

        rec = self.kernel.world.nodes[node]
        self._seen(rec)
        rec.connected = True
        old = self.sessions.get(node)
        if old is not None:
            old.close()
        session = AgentSession(node)
        self.sessions[node] = session
        self.metrics.agents.set(len(self.sessions))
        for u in rec.gpus:  # every cap it should hold right now
            mw = self.kernel.world.gpus[u].desired_mw
            if mw is not None:
                session.outbox.put_nowait(SetPower(u, mw, "current layout"))
        return session, last_seq

    def _check_hello_against(self, tx: Tx | None, node: str, domain: str, gpus: list[GpuInventory]) -> int:
        """Refuse a GPU of another node, a node in another domain, or a cluster past its size (in
        memory, or in a transaction's view). Returns how many GPUs the hello adds."""
        w = self.kernel.world
        known = tx.node(node) if tx is not None else w.nodes.get(node)
        if known is not None and known.domain != domain:
            raise InvalidArgument(f"hello.domain: node {node!r} is registered in domain {known.domain!r}, "
                                  f"not {domain!r}")
        adding = 0
        for g in gpus:
            has = tx.has_gpu(g.uuid) if tx is not None else g.uuid in w.gpus
            if not has:
                adding += 1
                continue
            other = tx.gpu(g.uuid) if tx is not None else w.gpus[g.uuid]
            if other.node != node:
                raise InvalidArgument(f"hello.gpus: GPU {g.uuid} is already registered on node {other.node!r}")
        registered = len(w.gpus) + (tx.new_gpu_count if tx is not None else 0)
        if registered + adding > self.settings.max_cluster_gpus:
            raise ResourceExhausted(
                f"hello.gpus: registering {adding} more GPUs would pass max_cluster_gpus="
                f"{self.settings.max_cluster_gpus} ({registered} registered)"
            )
        return adding

    def write_hello(self, tx: Tx, node: str, domain: str, gpus: list[GpuInventory], boot_id: str,
                    agent_version: str, token: str | None, peer: str) -> int:
        """A hello stored by some manager (fleet mode), applied in `tx`: checked against the
        transaction's view first (nothing is written when it raises)."""
        check_hello(node, domain, gpus, boot_id, agent_version)
        return self._write_hello(tx, node, domain, gpus, boot_id, agent_version, token, peer)

    def _write_hello(self, tx: Tx, node: str, domain: str, gpus: list[GpuInventory], boot_id: str,
                     agent_version: str, token: str | None, peer: str) -> int:
        self._check_hello_against(tx, node, domain, gpus)
        now = tx.now
        known = tx.node(node)
        uuids = [g.uuid for g in gpus]
        added = [u for u in uuids if not tx.has_gpu(u)]
        listed = set(uuids)
        absent = [u for u in (known.gpus if known else []) if u not in listed]
        if known is None:
            tx.add_node(NodeRec(node, domain, [], 0, boot_id, agent_version=agent_version))
            tx.audit(now, "node.register", node, after={"domain": domain, "gpus": uuids})
        else:
            tx.audit(now, "node.rehello", node,
                     before={"boot_id": known.boot_id, "agent_version": known.agent_version},
                     after={"boot_id": boot_id, "agent_version": agent_version, "token": token, "peer": peer[:200],
                            "added": added, "absent": absent})
            # an unchanged re-hello (the fleet after a failover) writes its audit row and nothing else
            changed = NodeChange()
            if boot_id != known.boot_id:
                changed["boot_id"] = boot_id
            if agent_version != known.agent_version:
                changed["agent_version"] = agent_version
            tx.change_node(node, changed)
        for g in gpus:
            if g.uuid in added:
                tx.add_gpu(GpuRec(g.uuid, node, domain, g.index, g.default_mw, g.min_mw, g.max_mw,
                                  health=GpuState.HEALTHY, health_reason="registered", health_since=now,
                                  model=g.model, memory_bytes=g.memory_bytes))
                continue
            rec = tx.gpu(g.uuid)
            if (rec.idx, rec.tdp_mw, rec.min_mw, rec.max_mw, rec.model, rec.memory_bytes) != (
                    g.index, g.default_mw, g.min_mw, g.max_mw, g.model, g.memory_bytes):  # else: as it was
                inventory = GpuChange(idx=g.index, tdp_mw=g.default_mw, min_mw=g.min_mw, max_mw=g.max_mw,
                                      model=g.model, memory_bytes=g.memory_bytes)
                tx.change_gpu(g.uuid, differing(inventory, rec))
            back = policy.reconnect(rec.health, rec.health_source)
            if back.health is not None:
                tx.event(rec, back.health, [back.reason], source="heartbeat")
                tx.change_gpu(g.uuid, health_to(back.health, back.reason, HealthSource.AGENT, now))
        for u in absent:
            rec = tx.gpu(u)
            if rec.health != GpuState.FAILED:
                tx.event(rec, GpuState.FAILED, [GONE], source="agent")
                tx.change_gpu(u, health_to(GpuState.FAILED, GONE, HealthSource.INVENTORY, now))
        n = tx.node(node)
        assert n is not None
        return n.last_seq

    def disconnect(self, session: AgentSession) -> None:
        session.closed = True
        if self.sessions.get(session.node) is session:
            del self.sessions[session.node]
            rec = self.kernel.world.nodes.get(session.node)
            if rec is not None:
                rec.connected = False
        self.metrics.agents.set(len(self.sessions))

    def heartbeat(self, node: str) -> None:
        rec = self.kernel.world.nodes.get(node)
        if rec is not None:
            self._seen(rec)
            self.metrics.heartbeats.inc()

    def mark_open(self, nodes: Iterable[str]) -> None:
        """Count these nodes as heard from now: their streams are open, here or on the manager
        whose liveness row names them (their connections answer the transport's pings:
        rpc/server.py keepalive)."""
        now = self.kernel.clock.monotonic()
        recs = self.kernel.world.nodes
        for node in nodes:
            rec = recs.get(node)
            if rec is not None:
                self._seen(rec, now)

    def _seen(self, rec: NodeRec, now: float | None = None) -> None:
        now = self.kernel.clock.monotonic() if now is None else now
        if now < rec.last_seen:  # loaded as seen at the end of the takeover grace, heard from before it
            self.seen_earlier(rec.name)
        rec.last_seen = now

    # ---- reports ------------------------------------------------------------------------------
    async def apply_report(self, node: str, seq: int, gpus: list[GpuReport]) -> int:
        """Apply one health report. Returns the seq to acknowledge.

        seq <= last applied: a replay, acknowledged and ignored. seq > last + 1: a gap, rejected.
        Unknown GPUs or states, or values past the limits, reject the whole report (InvalidArgument
        naming the field). Rejections write nothing. Reports of one node may be submitted before the
        previous one has committed: the seq is checked in the transaction."""
        return await self.submit_report(node, seq, gpus)

    def submit_report(self, node: str, seq: int, gpus: list[GpuReport]) -> asyncio.Future[int]:
        """`apply_report` without waiting (and without a task of its own): the future resolves to
        the seq to acknowledge once the report is durable, or fails with the refusal."""
        try:
            return self._submit_report(node, seq, gpus)
        except ServiceError as e:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            fut.set_exception(e)
            return fut

    def _submit_report(self, node: str, seq: int, gpus: list[GpuReport]) -> asyncio.Future[int]:
        check_report(seq, gpus)
        rec = self.kernel.world.nodes.get(node)
        if rec is None:
            raise FailedPrecondition(f"node {node!r} has not registered (send hello first)")
        if seq <= rec.last_seq:
            done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            done.set_result(seq)
            return done
        for g in gpus:
            gr = self.kernel.world.gpus.get(g.uuid)
            if gr is None or gr.node != node:
                raise InvalidArgument(f"report.gpus: report from {node!r} names unknown GPU {g.uuid!r}")
            if g.state not in HEALTH_STATES:
                raise InvalidArgument(
                    f"report.gpus.state: GPU {g.uuid}: agents may report {sorted(HEALTH_STATES)}, not {g.state!r}"
                )
        if len({g.uuid for g in gpus}) != len(gpus):
            raise InvalidArgument("report.gpus: a report names the same GPU twice")

        async def write(tx: Tx) -> int:
            return self.write_report(tx, node, seq, gpus)

        fut = self.kernel.enqueue(f"agent:{node}", write)
        fut.add_done_callback(self._counted)
        return fut

    def write_report(self, tx: Tx, node: str, seq: int, gpus: list[GpuReport]) -> int:
        """Apply a report in `tx`, checked against the transaction's view first (nothing is written
        when it raises): seq <= last applied is a replay (ignored); a gap, a GPU of another node
        or an unknown state raise. The seq to acknowledge."""
        n = tx.node(node)
        if n is None:
            raise FailedPrecondition(f"node {node!r} has not registered (send hello first)")
        if seq <= n.last_seq:  # raced with a replay on another stream
            return seq
        if seq != n.last_seq + 1:
            raise InvalidArgument(f"bad sequence number: expected {n.last_seq + 1}, got {seq}")
        for g in gpus:
            if not tx.has_gpu(g.uuid) or tx.gpu(g.uuid).node != node:
                raise InvalidArgument(f"report.gpus: report from {node!r} names unknown GPU {g.uuid!r}")
            if g.state not in HEALTH_STATES:
                raise InvalidArgument(
                    f"report.gpus.state: GPU {g.uuid}: agents may report {sorted(HEALTH_STATES)}, not {g.state!r}")
        tx.change_node(node, NodeChange(last_seq=seq))
        for g in gpus:
            gr = tx.gpu(g.uuid)
            state = GpuState(g.state)  # one of HEALTH_STATES (checked above)
            tx.event(gr, state, g.reasons, source="agent", seq=seq, xids=g.xids)
            change = GpuChange()
            if g.enforced_mw is not None and g.enforced_mw != gr.enforced_mw:
                change["enforced_mw"] = g.enforced_mw
            if state != gr.health and not _detector_stands(gr, state):
                change.update(health_to(state, "; ".join(g.reasons), HealthSource.AGENT, tx.now))
            tx.change_gpu(g.uuid, change)
        tx.after.append(lambda: self.heartbeat(node))
        return seq

    def _counted(self, fut: asyncio.Future[int]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.metrics.reports.inc()

    async def record_power_result(self, node: str, readings: list[tuple[str, int]]) -> None:
        """The caps an agent read back after applying a command."""
        check_power_readings(readings)
        w = self.kernel.world
        known = [(u, mw) for u, mw in readings if u in w.gpus and w.gpus[u].node == node]
        if not known:
            return

        async def write(tx: Tx) -> None:
            for u, mw in known:
                tx.change_gpu(u, GpuChange(enforced_mw=mw))

        await self.kernel.submit(f"agent:{node}", write)


def identity_problem(principal: Principal, node: str, peer_fingerprint: str | None) -> str | None:
    """Why this agent token may not speak for `node` over this connection (None: it may)."""
    if principal.node is None:
        return "this agent token is bound to no node; create one per node (token create --node)"
    if principal.node != node:
        return f"this agent token speaks for node {principal.node!r}, not {node!r}"
    if principal.fingerprint is not None and principal.fingerprint != peer_fingerprint:
        return (f"this agent token needs the client certificate {principal.fingerprint[:16]}...; "
                f"the connection presented {'none' if peer_fingerprint is None else peer_fingerprint[:16]}")
    return None


def _detector_stands(rec: GpuRec, reported: GpuState) -> bool:
    """An agent's "healthy" does not undo the fail-slow detector's verdict: the agent sees counters,
    the detector saw the GPU run slow (its own `Recovered`, or an operator, clears it)."""
    return (reported == GpuState.HEALTHY and rec.health == GpuState.DEGRADED
            and rec.health_source == HealthSource.DETECTOR)
