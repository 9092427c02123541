"""The node agent: GPU evidence -> health verdicts -> sequenced reports to the manager; power caps back.

- XID events are read on a dedicated thread (`backend.wait_xids` with a short timeout) and handed to
  the event loop; counters are sampled every `sample_interval_s`.
- A report is made whenever a GPU's verdict changes (an XID that fails a GPU is reported at once,
  not at the next heartbeat). Reports carry consecutive sequence numbers. Unacknowledged reports
  stay in a bounded buffer: after a reconnect, the manager's `Welcome.last_applied_seq` drops what it
  already applied and the rest is renumbered from there (none of it was applied, so renumbering is
  safe) and resent. When the buffer is full, unsent reports are merged (latest state per GPU wins),
  so nothing is lost in effect and nothing is applied twice.
- Every per-GPU backend call is bounded in time (agent/ntp_agent/guard.py): a GPU that stops answering is
  failed with that reason within `gpu_call_timeout_s`, and the loop, heartbeats and the other GPUs
  carry on. Counters are read on a worker thread, so a hung read never stops the loop.
- Several managers (`manager` = "host:port,host:port", one leads: docs/operations.md): the
  contract's manager client (contract/client.py, shared with the worker) keeps the addresses and
  follows a standby's leader hint or moves to the next address; the channel's keepalive and TLS
  are its too. Once every address has failed in a
  row, reconnects back off exponentially with full jitter (tenacity's wait strategy). A manager
  whose welcome carries an older leader epoch than one already seen is stale and is left. The
  buffered reports are re-sent to whichever manager welcomes the agent (idempotent by seq).
- Commands from the manager: set/release power caps (applied, read back, result sent), drain.
- Local state: with `state_file`, the agent keeps a small JSON file on the node (agent/ntp_agent/state.py:
  GPUs with their device numbers and verdicts, the connection, when written) for `ntp-run --slurm`
  and `ntp-agent health`; written off the loop, when something changes and every few seconds.
- Identity: the token speaks for this node only (the manager refuses it for any other); with
  `tls_ca` the channel is TLS, and with `tls_cert` + `tls_key` the agent presents its client
  certificate (mTLS; see docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import structlog
from tenacity import RetryCallState, wait_exponential_jitter

from ntp_agent.backends.base import (
    BackendError,
    BackendEvent,
    GpuBackend,
    GpuLost,
    GpuRepaired,
    GpuSample,
    NotSupported,
)
from ntp_agent.guard import GpuHung, GuardedBackend
from ntp_agent.policy import GpuEvidence, HealthPolicy, Verdict, XidAction
from ntp_agent.power import PowerController
from ntp_agent.state import STATE_EVERY_S, expand, write_state
from ntp_manager.contract.client import ManagerClient, code_of
from ntp_manager.contract.gpu import GpuState
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from ntp_manager.contract.telemetry import counters, material
from ntp_manager.contract.tls import TlsFiles

log = structlog.get_logger("ntp.agent")

STATE_PB = {
    GpuState.HEALTHY: common_pb2.GPU_STATE_HEALTHY,
    GpuState.DEGRADED: common_pb2.GPU_STATE_DEGRADED,
    GpuState.FAILED: common_pb2.GPU_STATE_FAILED,
}


@dataclass
class AgentConfig:
    manager: str
    token: str
    node: str
    domain: str
    heartbeat_interval_s: float = 2.0
    sample_interval_s: float = 1.0
    power_reconcile_s: float = 30.0
    xid_wait_s: float = 0.2
    gpu_call_timeout_s: float = 3.0  # a per-GPU backend call taking longer: the GPU is failed as hung
    max_buffer: int = 256
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    version: str = "0.1.0"
    tls_ca: Path | None = None  # CA of the manager's certificate: connect over TLS
    tls_cert: Path | None = None  # this node's client certificate and key: mTLS
    tls_key: Path | None = None
    state_file: Path | None = None  # the local state file (agent/ntp_agent/state.py); `{node}` is the node name

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_ca, self.tls_cert, self.tls_key, labels=("--tls-ca", "--tls-cert", "--tls-key"))

    def client(self) -> ManagerClient:
        """The manager client over these addresses ("a:1,b:2") and TLS files."""
        return ManagerClient(self.manager, self.tls)


@dataclass
class PendingReport:
    seq: int
    gpus: dict[str, Verdict]
    xids: dict[str, list[int]] = field(default_factory=dict)


class Agent:
    def __init__(self, backend: GpuBackend, config: AgentConfig, policy: HealthPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.cfg = config
        self.policy = policy or HealthPolicy()
        self.clock = clock
        # every per-GPU call goes through the guard: a hung GPU costs at most one timeout
        self.guarded = GuardedBackend(backend, config.gpu_call_timeout_s)
        self.power = PowerController(self.guarded)
        self.statics = backend.gpus()
        self.evidence = {g.uuid: GpuEvidence(g.uuid) for g in self.statics}
        self.samples: dict[str, GpuSample] = {}  # latest read-only sample per GPU, sent with heartbeats
        self.verdicts: dict[str, Verdict] = {g.uuid: Verdict(GpuState.HEALTHY, ()) for g in self.statics}
        self.pending: list[PendingReport] = []
        self.next_seq = 1
        self.last_acked = 0
        self.sent_upto = 0  # highest seq ever put on the wire (may have been applied)
        self.connected = asyncio.Event()
        self.registered = asyncio.Event()  # first welcome received (systemd READY)
        self.stopping = asyncio.Event()
        self.outbox: asyncio.Queue[agent_pb2.AgentMessage | None] | None = None
        self.drain_deadline: Any = None
        self.metrics: dict[str, float] = {"xids": 0, "nvml_errors": 0, "reports": 0, "last_report": 0.0}
        self.xid_counts: dict[int, int] = {}
        self._xid_thread: threading.Thread | None = None
        self._xid_q: asyncio.Queue[list[BackendEvent]] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.client = config.client()  # the managers' addresses, the one tried now, TLS, failover
        self.epoch_seen = 0  # the highest leader epoch a welcome carried
        # the heartbeat period in use: the configured one, or the manager's when its welcome asks
        # for a shorter one (it judges silence by its own period; a slower agent would look dead)
        self.beat_s = self.cfg.heartbeat_interval_s
        # the longest it goes without a heartbeat while no counter changes materially (the welcome's
        # heartbeat_max_quiet_ms; a manager that does not say: every period). Liveness is the
        # stream's own (the manager pings the connection), so a quiet agent is not a silent one.
        self.quiet_s = self.beat_s
        self.sent: dict[str, Any] = {}  # the counters of each GPU as last sent (contract/telemetry.py)
        self.sent_at = float("-inf")  # when the last heartbeat was sent (the event loop's clock)
        self._period_changed = asyncio.Event()
        # the local state file (agent/ntp_agent/state.py): rewritten when dirty, else every STATE_EVERY_S
        self.conn_since = time.time()  # wall time the connection last came or went (start: not connected)
        self._state_dirty = True
        self._state_written = -STATE_EVERY_S
        self._state_warned = False

    # ---- evidence ---------------------------------------------------------------------------
    def _start_xid_thread(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop

        def run() -> None:
            while not self.stopping.is_set():
                try:
                    events = self.backend.wait_xids(self.cfg.xid_wait_s)
                except BackendError as e:
                    self.metrics["nvml_errors"] += 1
                    log.warning("xid wait failed", error=str(e))
                    time.sleep(self.cfg.xid_wait_s)
                    continue
                if events:
                    loop.call_soon_threadsafe(self._xid_q.put_nowait, events)

        self._xid_thread = threading.Thread(target=run, name="xid-events", daemon=True)
        self._xid_thread.start()

    def handle_xids(self, events: list[BackendEvent]) -> None:
        now = self.clock()
        xids: dict[str, list[int]] = {}
        for ev in events:
            if ev.uuid not in self.evidence:
                continue
            if isinstance(ev, GpuRepaired):
                self.policy.clear(self.evidence[ev.uuid])
                for other in self.evidence.values():  # node-wide verdicts this GPU caused end too
                    other.sticky = [r for r in other.sticky if f"on {ev.uuid}:" not in r]
                continue
            self.metrics["xids"] += 1
            self.xid_counts[ev.xid] = self.xid_counts.get(ev.xid, 0) + 1
            action = self.policy.on_xid(self.evidence[ev.uuid], ev.xid, now)
            xids.setdefault(ev.uuid, []).append(ev.xid)
            if action is XidAction.FAIL_NODE:
                for other_uuid, evd in self.evidence.items():
                    if other_uuid != ev.uuid:
                        evd.sticky.append(f"XID {ev.xid} on {ev.uuid}: the node's GPUs are unreliable")
            log.info("xid", gpu=ev.uuid, xid=ev.xid, action=action.value)
        self.reevaluate(xids)

    def read_samples(self) -> dict[str, GpuSample | BackendError]:
        """One reading per GPU, or the error that took its place. Blocking (up to the guard's
        timeout per hung GPU): the main loop calls it on a worker thread."""
        out: dict[str, GpuSample | BackendError] = {}
        for g in self.statics:
            try:
                out[g.uuid] = self.guarded.sample(g.uuid)
            except BackendError as e:
                out[g.uuid] = e
        return out

    def apply_samples(self, readings: dict[str, GpuSample | BackendError]) -> None:
        now = self.clock()
        for u, s in readings.items():
            ev = self.evidence[u]
            if isinstance(s, GpuHung):
                reason = f"GPU not answering: {s.what} took over {self.cfg.gpu_call_timeout_s:g}s"
                if not any(r.startswith("GPU not answering") for r in ev.sticky):
                    ev.sticky.append(reason)  # a GPU that hung is not trusted again until repaired
                    log.warning("gpu hung", gpu=u, call=s.what, waited_s=round(s.waited_s, 1))
                continue
            if isinstance(s, GpuLost):
                ev.lost = True
                continue
            if isinstance(s, NotSupported):
                continue
            if isinstance(s, BackendError):
                self.metrics["nvml_errors"] += 1
                log.warning("sample failed", gpu=u, error=str(s))
                continue
            self.samples[u] = s
            self.policy.on_sample(ev, now, sbe_total=s.sbe_total, dbe_total=s.dbe_total, throttled=s.throttled,
                                  temp_c=s.temperature_c, nvlink_down=s.nvlink_down, remap_failure=s.remap_failure)
            ev.slow_reason = f"running at {100 * s.slow_factor:.0f}% speed" if s.slow_factor < 0.9 else None
        self.reevaluate({})

    def sample_all(self) -> None:
        """Read and apply in one go (blocking; tests and tools)."""
        self.apply_samples(self.read_samples())

    def reevaluate(self, xids: dict[str, list[int]]) -> None:
        now = self.clock()
        changed: dict[str, Verdict] = {}
        for u, ev in self.evidence.items():
            v = self.policy.verdict(ev, now)
            if v != self.verdicts[u] or u in xids:
                changed[u] = v
                self.verdicts[u] = v
        if changed:
            self._state_dirty = True
            self._enqueue(changed, xids)

    def _enqueue(self, gpus: dict[str, Verdict], xids: dict[str, list[int]]) -> None:
        rep = PendingReport(self.next_seq, dict(gpus), {k: list(v) for k, v in xids.items()})
        self.next_seq += 1
        self.pending.append(rep)
        if len(self.pending) > self.cfg.max_buffer and not self.connected.is_set():
            self._coalesce()
        if self.outbox is not None and self.connected.is_set():
            self.outbox.put_nowait(self._report_msg(rep))

    def _coalesce(self) -> None:
        """Merge the reports never put on the wire into one (latest verdict per GPU wins).

        Reports already sent may have been applied by the manager, so they keep their numbers and
        contents; only unsent ones are merged, numbered right after the last sent one."""
        sent = [r for r in self.pending if r.seq <= self.sent_upto]
        unsent = [r for r in self.pending if r.seq > self.sent_upto]
        if len(unsent) < 2:
            return
        merged = PendingReport(unsent[0].seq, {}, {})
        for r in unsent:
            merged.gpus.update(r.gpus)
            for u, xs in r.xids.items():
                merged.xids.setdefault(u, []).extend(xs)
        self.pending = [*sent, merged]
        self.next_seq = merged.seq + 1

    def _report_msg(self, rep: PendingReport) -> agent_pb2.AgentMessage:
        gpus = []
        for u, v in rep.gpus.items():
            st = self.power.caps.get(u)
            gpus.append(agent_pb2.GpuHealth(
                uuid=u, state=STATE_PB[v.state], reasons=list(v.reasons),
                xids=[agent_pb2.XidEvent(xid=x) for x in rep.xids.get(u, [])],
                power=agent_pb2.PowerReading(
                    desired_mw=(st.desired_mw or 0) if st else 0, enforced_mw=(st.enforced_mw or 0) if st else 0),
            ))
        self.metrics["reports"] += 1
        self.metrics["last_report"] = time.time()
        self.sent_upto = max(self.sent_upto, rep.seq)
        return agent_pb2.AgentMessage(report=agent_pb2.HealthReport(seq=rep.seq, gpus=gpus))

    # ---- connection ---------------------------------------------------------------------------
    def hello(self) -> agent_pb2.AgentMessage:
        return agent_pb2.AgentMessage(hello=agent_pb2.Hello(
            node=self.cfg.node, domain=self.cfg.domain, agent_version=self.cfg.version, boot_id=_boot_id(),
            next_seq=self.next_seq,
            gpus=[common_pb2.GpuInfo(uuid=g.uuid, index=g.index, model=g.model, memory_bytes=g.memory_bytes,
                                     pci_bus_id=g.pci_bus_id,
                                     power=common_pb2.PowerConstraints(min_mw=g.min_mw, max_mw=g.max_mw,
                                                                       default_mw=g.default_mw))
                  for g in self.statics]))

    def on_welcome(self, last_applied: int) -> list[agent_pb2.AgentMessage]:
        """Drop what the manager applied, renumber the rest from last_applied + 1, return it to send."""
        self.last_acked = max(self.last_acked, last_applied)
        self.pending = [r for r in self.pending if r.seq > last_applied]
        for i, r in enumerate(self.pending):
            r.seq = last_applied + 1 + i
        self.next_seq = last_applied + 1 + len(self.pending)
        self.sent_upto = last_applied  # nothing after it was applied; all of it is resent now
        return [self._report_msg(r) for r in self.pending]

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The stream's metadata: the token (every manager serving clients takes the stream)."""
        return self.client.metadata(self.cfg.token)

    def on_ack(self, seq: int) -> None:
        self.last_acked = max(self.last_acked, seq)
        self.pending = [r for r in self.pending if r.seq > seq]

    async def session(self) -> None:
        """One connection: hello, welcome, then reports/heartbeats out and commands in."""
        outbox: asyncio.Queue[agent_pb2.AgentMessage | None] = asyncio.Queue()
        self.outbox = outbox
        outbox.put_nowait(self.hello())

        async def requests() -> AsyncIterator[agent_pb2.AgentMessage]:
            while True:
                m = await outbox.get()
                if m is None:
                    return
                yield m

        async with self.client.aio_channel() as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)  # type: ignore[no-untyped-call]
            call = stub.Connect(requests(), metadata=self.call_metadata())
            beat = asyncio.create_task(self._heartbeats(outbox))
            try:
                async for msg in call:
                    kind = msg.WhichOneof("body")
                    if kind == "welcome":
                        if msg.welcome.leader_epoch < self.epoch_seen:
                            raise StaleManager(f"{self.target} welcomed at leader epoch {msg.welcome.leader_epoch}, "
                                               f"older than {self.epoch_seen}")
                        self.epoch_seen = msg.welcome.leader_epoch
                        period = self.heartbeat_period(msg.welcome.heartbeat_interval_ms)
                        if period != self.beat_s:
                            self.beat_s = period
                            self._period_changed.set()  # the wait under way is for the old period
                        self.quiet_s = max(period, msg.welcome.heartbeat_max_quiet_ms / 1000)
                        self.sent, self.sent_at = {}, float("-inf")  # a new stream: the next beat is sent
                        for m in self.on_welcome(msg.welcome.last_applied_seq):
                            outbox.put_nowait(m)
                        self._connection(True)
                        self.registered.set()
                        log.info("connected", manager=self.target, epoch=msg.welcome.leader_epoch,
                                 last_applied=msg.welcome.last_applied_seq)
                    elif kind == "ack":
                        self.on_ack(msg.ack.seq)
                    else:
                        result = self.on_command(msg)
                        if result is not None:
                            outbox.put_nowait(result)
            finally:
                self._connection(False)
                self.outbox = None
                beat.cancel()
                outbox.put_nowait(None)

    def _connection(self, up: bool) -> None:
        if up != self.connected.is_set():
            self.conn_since = time.time()
            self._state_dirty = True
        if up:
            self.connected.set()
        else:
            self.connected.clear()

    # ---- the local state file (agent/ntp_agent/state.py) ----------------------------------------------------
    def state_doc(self) -> dict[str, Any]:
        """What the state file holds now: the node, its GPUs with their verdicts, the connection."""
        return {
            "format": 1, "node": self.cfg.node, "domain": self.cfg.domain, "pid": os.getpid(),
            "written_at": time.time(), "connected": self.connected.is_set(), "since": self.conn_since,
            "manager": self.target if self.connected.is_set() else None,
            "gpus": [{"index": g.index, "minor": g.minor, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
                      "state": str(self.verdicts[g.uuid].state), "reasons": list(self.verdicts[g.uuid].reasons)}
                     for g in self.statics],
        }

    async def write_state_if_due(self) -> None:
        """Rewrite the state file when something changed or STATE_EVERY_S passed (on a worker
        thread). A file that cannot be written is logged once; the agent goes on."""
        if self.cfg.state_file is None:
            return
        mono = time.monotonic()
        if not self._state_dirty and mono - self._state_written < STATE_EVERY_S:
            return
        self._state_dirty, self._state_written = False, mono
        path = expand(self.cfg.state_file, self.cfg.node)
        try:
            await asyncio.to_thread(write_state, path, self.state_doc())
            self._state_warned = False
        except OSError as e:
            if not self._state_warned:
                log.warning("cannot write the state file", path=str(path), error=str(e))
                self._state_warned = True

    def heartbeat_period(self, manager_ms: int) -> float:
        """The period to beat at under a manager whose welcome says `manager_ms` (0: says nothing):
        the shorter of it and ours. Beating faster than the manager asks only costs a few messages;
        beating slower would have it suspect, then fail, a healthy node."""
        mine = self.cfg.heartbeat_interval_s
        if manager_ms <= 0 or manager_ms / 1000 >= mine:
            return mine
        if manager_ms / 1000 != self.beat_s:
            log.info("beating at the manager's heartbeat period, shorter than ours",
                     manager_s=manager_ms / 1000, configured_s=mine)
        return manager_ms / 1000

    async def _heartbeats(self, outbox: asyncio.Queue[agent_pb2.AgentMessage | None]) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            self._period_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._period_changed.wait(), max(0.0, last + self.beat_s - loop.time()))
            if loop.time() < last + self.beat_s:
                continue  # a new, shorter period: wait out what is left of it
            last = loop.time()
            if self.connected.is_set():
                msg = self.heartbeat_msg()
                if self.beat_due(msg, last):
                    outbox.put_nowait(msg)

    def beat_due(self, msg: agent_pb2.AgentMessage, now: float) -> bool:
        """Whether to send this period's heartbeat: the longest quiet has passed since the last one
        sent, or a GPU's counters changed materially (or a GPU came or went) since they were sent.
        Remembers what it sends."""
        now_counters = {t.uuid: counters(t) for t in msg.heartbeat.gpus}
        due = (now - self.sent_at >= self.quiet_s - 1e-6 or now_counters.keys() != self.sent.keys()
               or any(material(self.sent[u], c) for u, c in now_counters.items()))
        if due:
            self.sent, self.sent_at = now_counters, now
        return due

    def heartbeat_msg(self) -> agent_pb2.AgentMessage:
        """A heartbeat carrying the latest sample of each GPU (GPUs lost or never read: none)."""
        return agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat(
            last_seq=self.next_seq - 1,
            gpus=[telemetry_pb(s) for u, s in self.samples.items()
                  if not self.evidence[u].lost and self.guarded.stuck(u) is None]))

    def on_command(self, msg: agent_pb2.ManagerMessage) -> agent_pb2.AgentMessage | None:
        kind = msg.WhichOneof("body")
        if kind == "set_power":
            st = self.power.set(msg.set_power.gpu_uuid, msg.set_power.limit_mw)
            u = msg.set_power.gpu_uuid
        elif kind == "release_power":
            u = msg.release_power.gpu_uuid
            st = self.power.release(u)
        elif kind == "drain":
            self.drain_deadline = msg.drain.deadline.ToDatetime()
            log.info("drain requested", deadline=str(self.drain_deadline), reason=msg.drain.reason)
            return agent_pb2.AgentMessage(result=agent_pb2.CommandResult(command_id=msg.command_id, ok=True))
        else:
            return None
        if st.error:
            log.warning("power command failed", gpu=u, error=st.error)
        elif st.note:
            log.info("power cap clamped", gpu=u, note=st.note)
        detail = "; ".join(x for x in (st.error, st.note) if x)
        return agent_pb2.AgentMessage(result=agent_pb2.CommandResult(
            command_id=msg.command_id, ok=st.error is None, detail=detail, gpu_uuids=[u],
            power=[agent_pb2.PowerReading(desired_mw=st.desired_mw or 0, enforced_mw=st.enforced_mw or 0)]))

    async def connect_forever(self) -> None:
        wait = wait_exponential_jitter(
            multiplier=self.cfg.backoff_initial_s, max=self.cfg.backoff_max_s, jitter=self.cfg.backoff_initial_s
        )
        attempt = 0  # failed rounds over every address
        failed_here = 0  # addresses failed in a row in this round
        while not self.stopping.is_set():
            hint: str | None = None
            try:
                await self.session()
                failed_here = attempt = 0
                self._move(None)  # the stream ended (the manager stopped or stepped down): try the next
            except grpc.aio.AioRpcError as e:
                hint = self.client.failed(e)
                if code_of(e) in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                                grpc.StatusCode.INVALID_ARGUMENT):
                    log.error("manager rejected the agent", code=e.code().name, detail=e.details())
                log.info("disconnected", manager=self.target, code=e.code().name, leader=hint)
                failed_here += 1
                self._move(hint)
            except StaleManager as e:
                log.warning("left a stale manager", detail=str(e))
                failed_here += 1
                self._move(None)
            if self.stopping.is_set():
                break
            if hint is not None or failed_here < len(self.client.targets):
                delay = random.uniform(0, self.cfg.backoff_initial_s)  # another manager: go now (jittered)
            else:
                attempt += 1
                failed_here = 0
                delay = wait(cast(RetryCallState, _RetryState(attempt)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)

    def _move(self, hint: str | None) -> None:
        """Next manager to try: the leader a standby named, else the next address of its failover cycle
        (contract/client.py: the others in an order of its own, so the agents of a manager that died
        spread over the managers left)."""
        previous = self.client.target
        if self.client.move(hint) is not None:
            log.info("trying another manager", manager=self.client.target, previous=previous)

    # the connection's state, kept by the manager client
    @property
    def target(self) -> str:
        """The manager tried now."""
        return self.client.target

    @property
    def failovers(self) -> int:
        """Moves to another manager."""
        return self.client.failovers

    # ---- main loop ------------------------------------------------------------------------------
    async def run(self, watchdog: Callable[[], None] | None = None) -> None:
        self._start_xid_thread()
        conn = asyncio.create_task(self.connect_forever())
        last_sample = last_reconcile = 0.0
        try:
            while not self.stopping.is_set():
                try:
                    events = await asyncio.wait_for(self._xid_q.get(), timeout=0.1)
                    self.handle_xids(events)
                except TimeoutError:
                    pass
                now = self.clock()
                if now - last_sample >= self.cfg.sample_interval_s:
                    last_sample = now
                    readings = await asyncio.to_thread(self.read_samples)
                    # XID events that arrived while the GPUs were read go first: a GPU that fell off
                    # the bus (XID 79) also fails its sample, and its failure should carry the XID
                    while not self._xid_q.empty():
                        self.handle_xids(self._xid_q.get_nowait())
                    self.apply_samples(readings)
                if now - last_reconcile >= self.cfg.power_reconcile_s:
                    last_reconcile = now
                    self.power.reconcile()
                await self.write_state_if_due()
                if watchdog is not None:
                    watchdog()
        finally:
            self.stopping.set()
            self.power.restore_all()
            conn.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await conn
            self.guarded.close()


class StaleManager(Exception):
    """A manager whose leader epoch is older than one the agent has already seen."""


class _RetryState:
    """The bit of tenacity's RetryCallState its wait strategies read."""

    def __init__(self, attempt: int) -> None:
        self.attempt_number = attempt


def telemetry_pb(s: GpuSample) -> agent_pb2.GpuTelemetry:
    """A sample as sent to the manager; values a field cannot hold (a negative reading, a counter
    past 64 bits) are left unset rather than wrapped."""
    t = agent_pb2.GpuTelemetry(uuid=s.uuid, ecc_uncorrected=max(0, s.dbe_total), nvlink_down=max(0, s.nvlink_down))
    for name, value, bits in (
        ("clock_event_reasons", s.clock_event_reasons, 64), ("sm_clock_mhz", s.sm_clock_mhz, 32),
        ("sm_clock_max_mhz", s.sm_clock_max_mhz, 32), ("usage_mw", s.usage_mw, 32), ("limit_mw", s.limit_mw, 32),
        ("ecc_corrected", s.sbe_total, 64), ("nvlink_replay", s.nvlink_replay, 64),
        ("nvlink_recovery", s.nvlink_recovery, 64), ("nvlink_crc", s.nvlink_crc, 64),
    ):
        if value is not None and 0 <= value < 2**bits:
            setattr(t, name, value)
    if s.temperature_c is not None and -(2**31) <= s.temperature_c < 2**31:
        t.temperature_c = s.temperature_c
    return t


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
