"""Where a worker learns its job's layout: the manager's gRPC watch stream, or a store-backed source
that a test or a launcher controls.

Both give the runtime the same thing, a `WorkerLayout`: the version, every replica's local batch and
the TP degree of each of its pipeline stages, in global-rank order (replica by replica, stage by
stage, TP rank by TP rank: `contract.ranks`, as the manager numbers them), and this worker's global
rank in it (None when its GPU has no place). Sources keep every version they have seen, so ranks
can agree on one version even when some saw it later than others.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from ntp_manager.contract.ranks import check_degrees, global_rank, locate, stage_ranks, world_size
from ntp_manager.contract.tls import TlsFiles
from ntp_manager.worker.sync import ReplicaGroup, SyncLayout

if TYPE_CHECKING:
    from ntp_manager.contract.layout import WireLayout

log = structlog.get_logger("ntp.worker")


@dataclass(frozen=True)
class WorkerLayout:
    """One version of the job's layout as a worker sees it. A replica is a pipeline of stages,
    each a TP group of its own degree; ranks are numbered by `contract.ranks` (replica by replica,
    stage by stage, TP index by TP index)."""

    version: int
    replicas: tuple[tuple[int, int], ...]  # (TP degree: the lowest of its stages, local batch) per replica
    rank: int | None  # this worker's global rank; None when it has no place in this version
    reason: str = ""
    epoch: int = 0
    # per replica, the TP degree of each pipeline stage; () for single-stage replicas of degree replicas[i][0]
    stages: tuple[tuple[int, ...], ...] = ()
    # the manager's word that no survivor holds some unit: restore the checkpoint of this step (or
    # the newest older one that verifies); None: the workers choose (the newest that verifies)
    restore_step: int | None = None

    def __post_init__(self) -> None:
        if self.stages:
            if len(self.stages) != len(self.replicas):
                raise ValueError(f"layout version {self.version}: {len(self.stages)} stage lists for "
                                 f"{len(self.replicas)} replicas")
            check_degrees(self.stages)
        if self.rank is not None and not 0 <= self.rank < self.world:
            raise ValueError(f"layout version {self.version}: rank {self.rank} outside a world of {self.world}")

    @property
    def degrees(self) -> tuple[tuple[int, ...], ...]:
        """Per replica, the TP degree of each stage."""
        return self.stages or tuple((tp,) for tp, _ in self.replicas)

    @property
    def n_stages(self) -> int:
        return len(self.degrees[0]) if self.replicas else 1

    @property
    def world(self) -> int:
        return world_size(self.degrees)

    @property
    def global_batch(self) -> int:
        return sum(b for _, b in self.replicas)

    def group_ranks(self) -> list[list[range]]:
        """[replica][stage] -> that TP group's global ranks."""
        return stage_ranks(self.degrees) if self.replicas else []

    def where(self, rank: int) -> tuple[int, int, int]:
        """(replica, stage, TP index) of a global rank."""
        try:
            return locate(self.degrees, rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in layout version {self.version}") from None

    def sync_layout(self, units: dict[str, int], stage: int = 0) -> SyncLayout:
        """The NTP sync of one stage: that stage's TP group of every replica."""
        groups = self.group_ranks()
        return SyncLayout(
            tuple(ReplicaGroup(tuple(g[stage]), b) for g, (_, b) in zip(groups, self.replicas, strict=True)),
            units,
        )

    def replica_of(self, rank: int) -> int:
        return self.where(rank)[0]

    def stage_of(self, rank: int) -> int:
        return self.where(rank)[1]

    def tp_of(self, rank: int) -> int:
        """The TP degree of the group `rank` belongs to."""
        ri, si, _ = self.where(rank)
        return self.degrees[ri][si]


class LayoutSource(Protocol):
    def latest(self) -> WorkerLayout | None: ...

    def get(self, version: int) -> WorkerLayout | None: ...

    def wait_newer(self, version: int, timeout: float) -> WorkerLayout | None: ...

    def ack(self, layout: WorkerLayout, ok: bool, detail: str = "", restored: RestoreNote | None = None) -> None: ...

    def report_step(self, layout: WorkerLayout, step: int, step_time_s: float, tokens: int,
                    work: StepWork | None = None) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RestoreNote:
    """What an ack says when the worker applied the layout by restoring a checkpoint (issue 22):
    the checkpoint's step and directory name, why no survivor could give the state ("" when the
    job resumed), and the newer checkpoints passed over ("name: why"). The manager records it once
    per layout version (service/planning/restores.py)."""

    step: int
    checkpoint: str
    reason: str = ""
    skipped: tuple[str, ...] = ()

    def fill(self, r: Any) -> None:
        """Set the fields of an ntp.v1.CheckpointRestore (texts cut to what the manager takes)."""
        r.step, r.checkpoint, r.reason = self.step, self.checkpoint[:64], self.reason[:2000]
        r.skipped.extend(s[:2000] for s in self.skipped[:16])


@dataclass(frozen=True)
class StepWork:
    """What a step's report says beyond its time (fail-slow detection, issue 21). Only what the
    worker knows without a GPU sync: 0 / None means "not measured" and the manager treats it so.

    - `compute_s`: host-timed forward + backward; meaningful only where the host waits for the
      device (CPU training), so the runtime leaves it 0 on GPUs.
    - `comm_wait_s`: seconds blocked in the TP group's collectives (0: not measured).
    - `sequence_lengths`: lengths of the step's sequences, from the batch when it says them
      (`batch.sequence_lengths` or `batch["sequence_lengths"]`); tokens and sum of squares follow.
    """

    compute_s: float = 0.0
    comm_wait_s: float = 0.0
    sequence_lengths: tuple[int, ...] | None = None

    @staticmethod
    def lengths_of(batch: Any) -> tuple[int, ...] | None:
        v = batch.get("sequence_lengths") if isinstance(batch, dict) else getattr(batch, "sequence_lengths", None)
        if v is None:
            return None
        out = tuple(int(x) for x in v)
        if any(x < 0 for x in out):
            raise ValueError(f"batch sequence_lengths must be >= 0, got {min(out)}")
        return out

    def fill(self, r: Any) -> None:
        """Set the fields of an ntp.v1.RankStep."""
        r.compute_s, r.comm_wait_s = max(0.0, self.compute_s), max(0.0, self.comm_wait_s)
        if self.sequence_lengths is not None:
            r.tokens = sum(self.sequence_lengths)
            r.sequence_sq_sum = sum(x * x for x in self.sequence_lengths)


class _History:
    """Versions seen so far, with a condition to wait on."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.by_version: dict[int, WorkerLayout] = {}
        self.newest: WorkerLayout | None = None
        self.error: str | None = None

    def add(self, lay: WorkerLayout) -> None:
        with self.cond:
            if lay.version not in self.by_version:
                self.by_version[lay.version] = lay
            if self.newest is None or lay.version > self.newest.version:
                self.newest = lay
            self.cond.notify_all()

    def wait_newer(self, version: int, timeout: float, poll: Callable[[], None] | None = None) -> WorkerLayout | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                if poll is not None:
                    self.cond.release()
                    try:
                        poll()
                    finally:
                        self.cond.acquire()
                if self.newest is not None and self.newest.version > version:
                    return self.newest
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, 0.02) if poll is not None else left)


# ---- store-backed source (tests, launchers) ---------------------------------------------------
def publish_layout(
    store: Any, job: str, version: int, replicas: Sequence[tuple[Sequence[str] | Sequence[Sequence[str]], int]],
    reason: str = "", restore_step: int | None = None,
) -> None:
    """Publish a layout for `job`: `replicas` lists (workers, local batch), where workers are the
    worker ids in TP order (one stage) or, for pipelines, one such list per stage. `restore_step`:
    as the manager's `Layout.restore_step`."""
    reps: list[dict[str, Any]] = []
    for ws, b in replicas:
        if ws and not isinstance(ws[0], str):
            reps.append({"stages": [list(st) for st in ws], "local_batch": b})
        else:
            reps.append({"workers": list(ws), "local_batch": b})
    doc: dict[str, Any] = {"version": version, "reason": reason, "replicas": reps}
    if restore_step is not None:
        doc["restore_step"] = restore_step
    store.set(f"ntp/{job}/layout/{version}", json.dumps(doc))
    store.set(f"ntp/{job}/layout/latest", str(version))


def read_acks(store: Any, job: str, version: int, workers: Sequence[str]) -> dict[str, str]:
    keys = [f"ntp/{job}/ack/{version}/{w}" for w in workers]
    return {w: store.get(k).decode() for w, k in zip(workers, keys, strict=True) if store.check([k])}


def failed_key(job: str, version: int, epoch: int = 0) -> str:
    """Where a failure at a layout version is reported: by the first rank whose collective failed,
    or by the launcher that saw a rank's process die; every rank still computing a step of that
    version abandons it (runtime/abort.py)."""
    return f"ntp/{job}/failed/v{epoch}.{version}"


def report_failure(store: Any, job: str, version: int, why: str, epoch: int = 0) -> None:
    store.set(failed_key(job, version, epoch), why[:300])


def layout_from_doc(doc: dict[str, Any], worker_id: str) -> WorkerLayout:
    """A `publish_layout` document -> this worker's WorkerLayout."""
    reps, degrees, where = [], [], None
    for ri, rep in enumerate(doc["replicas"]):
        stages = rep["stages"] if "stages" in rep else [rep["workers"]]
        for si, ws in enumerate(stages):
            if worker_id in ws:
                where = (ri, si, list(ws).index(worker_id))
        degrees.append(tuple(len(ws) for ws in stages))
        reps.append((min(degrees[-1]), int(rep["local_batch"])))
    rank = global_rank(degrees, *where) if where is not None else None
    multi = any(len(d) > 1 for d in degrees)
    restore = doc.get("restore_step")
    return WorkerLayout(int(doc["version"]), tuple(reps), rank, doc.get("reason", ""),
                        stages=tuple(degrees) if multi else (), restore_step=None if restore is None else int(restore))


class StoreLayoutSource:
    """Layouts published into a torch.distributed store by `publish_layout`. Acks are written back
    to the store (`ntp/<job>/ack/<version>/<worker>`), so the publisher can watch them."""

    def __init__(self, store: Any, job: str, worker_id: str) -> None:
        self.store, self.job, self.worker_id = store, job, worker_id
        self.history = _History()
        self._lock = threading.Lock()

    def _doc(self, version: int) -> WorkerLayout | None:
        key = f"ntp/{self.job}/layout/{version}"
        if not self.store.check([key]):
            return None
        doc = json.loads(self.store.get(key))
        return layout_from_doc(doc, self.worker_id)

    def _poll(self) -> None:
        with self._lock:
            key = f"ntp/{self.job}/layout/latest"
            if not self.store.check([key]):
                return
            v = int(self.store.get(key))
            newest = self.history.newest
            if newest is None or v > newest.version:
                lay = self._doc(v)
                if lay is not None:
                    self.history.add(lay)

    def latest(self) -> WorkerLayout | None:
        self._poll()
        return self.history.newest

    def get(self, version: int) -> WorkerLayout | None:
        lay = self.history.by_version.get(version)
        if lay is None:
            with self._lock:
                lay = self._doc(version)
            if lay is not None:
                self.history.add(lay)
        return lay

    def wait_newer(self, version: int, timeout: float) -> WorkerLayout | None:
        return self.history.wait_newer(version, timeout, poll=self._poll)

    def ack(self, layout: WorkerLayout, ok: bool, detail: str = "", restored: RestoreNote | None = None) -> None:
        with self._lock:
            self.store.set(f"ntp/{self.job}/ack/{layout.version}/{self.worker_id}", "ok" if ok else f"failed: {detail}")

    def report_step(self, layout: WorkerLayout, step: int, step_time_s: float, tokens: int,
                    work: StepWork | None = None) -> None:
        pass

    def close(self) -> None:
        pass


# ---- the manager's gRPC watch stream ------------------------------------------------------------
# The channel, its keepalive and TLS, leader hints and failover are the manager client's
# (contract/client.py, the agent's too), imported when a source is made: importing this module
# does not import grpc.


def manager_addresses(target: str | Sequence[str]) -> list[str]:
    """One address or several ("a:1,b:2" or a list) -> the list, blanks dropped."""
    from ntp_manager.contract.client import manager_addresses as addresses

    return addresses(target)


def layout_from_pb(msg: Any, gpu_uuid: str) -> WorkerLayout:
    """`ntp.v1.Layout` (one worker's view) -> WorkerLayout, decoded by the contract's codec
    (`contract.layout.WireLayout`, which the manager encodes with). Pipelines need each replica's
    stage degrees (`ReplicaSummary.stage_tps`); a summary without them is one stage. The worker's
    rank is the one the manager gave it, checked against `contract.ranks`' numbering. Raises
    ValueError for a view whose stages or ranks do not add up."""
    from ntp_manager.contract.layout import WireLayout

    return layout_from_wire(WireLayout.decode(msg), gpu_uuid)


def layout_from_wire(wire: WireLayout, gpu_uuid: str) -> WorkerLayout:
    """A decoded view -> the WorkerLayout of the worker on `gpu_uuid`."""
    degrees = wire.degrees
    rank = wire.rank_of(gpu_uuid)
    multi = any(len(d) > 1 for d in degrees)
    return WorkerLayout(wire.version, tuple((s.tp, s.local_batch) for s in wire.replicas), rank, wire.reason,
                        wire.epoch, stages=degrees if multi else (), restore_step=wire.restore_step)


def step_report(job: str, worker_id: str, gpu_uuid: str, layout: WorkerLayout, step: int, step_time_s: float,
                tokens: int, work: StepWork | None = None) -> Any:
    """One rank's ntp.v1.StepReport (the manager places it by its layout)."""
    from ntp_manager.contract.proto.ntp.v1 import common_pb2, worker_pb2

    r = worker_pb2.RankStep(rank=layout.rank or 0, gpu_uuid=gpu_uuid, step_time_s=step_time_s, tokens=tokens)
    if work is not None:
        work.fill(r)
    return worker_pb2.StepReport(job=job, worker_id=worker_id, step=step,
                                 stamp=common_pb2.LayoutStamp(leader_epoch=layout.epoch, version=layout.version),
                                 ranks=[r])


class GrpcLayoutSource:
    """Watches `WorkerService.WatchLayout` on a background thread (reconnecting with backoff), and
    sends acks and step reports. Thread-safe.

    `target` is one manager's address or several ("a:1,b:2", or a list) when managers run as a
    leader and standbys: a standby answers UNAVAILABLE naming the leader (trailing metadata
    `ntp-leader`) and the watch goes there at once; any other failure moves it to the next address
    of its failover cycle (contract/client.py),
    with exponential backoff and full jitter once every address has failed in a row. Training goes
    on with the layout in hand meanwhile: nothing waits for the watch but the next version.

    `tls` (contract/tls.py `TlsFiles`: CA, client certificate and key; `TlsFiles.from_env` reads
    NTP_TLS_CA/CERT/KEY) makes the channel TLS or mTLS; the files are read here once, so a bad
    path is refused at once. A TLS handshake that fails before the first layout (a CA that did
    not sign the manager's certificate, a certificate the manager refuses) ends the set-up with
    one line saying so instead of retrying until `connect_timeout_s`."""

    def __init__(self, target: str | Sequence[str], token: str, job: str, gpu_uuid: str,
                 worker_id: str | None = None, connect_timeout_s: float = 30.0, tls: TlsFiles | None = None) -> None:
        from ntp_manager.contract.client import ManagerClient
        from ntp_manager.contract.proto.ntp.v1 import worker_pb2_grpc

        try:
            self.client = ManagerClient(target, tls)
        except ValueError as e:
            raise ValueError(f"target: {e}") from None
        self.client.tls.check()  # OSError naming a file that cannot be used
        self.job, self.gpu_uuid, self.worker_id = job, gpu_uuid, worker_id or gpu_uuid
        self._token = token
        self._md = (("authorization", f"Bearer {token}"),)
        self._stubs = worker_pb2_grpc
        self._channel = self.client.channel()
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)  # type: ignore[no-untyped-call]  # generated
        self._switch_lock = threading.Lock()
        self.history = _History()
        self._stop = threading.Event()
        self._refused = threading.Event()  # the watch was refused for good and has ended
        self._call: Any = None
        self._steps: list[Any] = []
        self._steps_cond = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="ntp-layout-watch", daemon=True)
        self._thread.start()
        self._reporter = threading.Thread(target=self._report_loop, name="ntp-step-reports", daemon=True)
        self._reporter.start()
        # the first layout, or a refusal (no such job, a bad token: the watch has ended), or the timeout
        deadline = time.monotonic() + connect_timeout_s
        while (self.history.wait_newer(-1, max(0.0, min(0.05, deadline - time.monotonic()))) is None
               and not self._refused.is_set() and time.monotonic() < deadline):
            pass
        if self.history.newest is None and self.history.error:
            self.close()
            error = self.history.error
            if not self._refused.is_set() and "socket closed" in error.lower():
                # TLS 1.3: the client's side of the handshake ends before the manager checks its
                # certificate, so a refused one reads as a connection closed; so does plaintext
                # sent to a TLS port
                error += (f" (over {self.client.tls.describe()}: a manager that requires client certificates "
                          f"closes the connection of one it refuses; check {self.client.tls.labels[1]})"
                          if self.client.tls.enabled else
                          " (over plaintext: a TLS port closes plaintext connections; give the manager's CA)")
            raise RuntimeError(f"cannot watch the layout of {job!r}: {error}")

    # the connection's state, kept by the manager client
    @property
    def targets(self) -> list[str]:
        return self.client.targets

    @property
    def target(self) -> str:
        """The manager watched now."""
        return self.client.target

    @property
    def failovers(self) -> int:
        """Moves to another manager."""
        return self.client.failovers

    def _move(self, hint: str | None) -> None:
        """Watch, ack and report through the leader a standby named, else the next address."""
        with self._switch_lock:
            old = self._channel
            nxt = self.client.move(hint)
            if nxt is None:
                return
            self._channel = self.client.channel()
            self._stub = self._stubs.WorkerServiceStub(self._channel)  # type: ignore[no-untyped-call]  # generated
        log.info("layout watch moves to another manager", manager=nxt)
        old.close()

    def watch_metadata(self) -> tuple[tuple[str, str], ...]:
        """The watch's metadata: the token (every manager serving clients takes the watch)."""
        return self.client.metadata(self._token)

    def _watch(self) -> None:
        import random

        import grpc

        from ntp_manager.contract.client import code_of, handshake_failure
        from ntp_manager.contract.proto.ntp.v1 import worker_pb2

        delay, failed_here = 0.1, 0
        while not self._stop.is_set():
            hint = None
            try:
                self._call = self._stub.WatchLayout(
                    worker_pb2.WatchLayoutRequest(job=self.job, worker_id=self.worker_id, gpu_uuid=self.gpu_uuid),
                    metadata=self.watch_metadata(),
                )
                for msg in self._call:
                    self.history.add(layout_from_pb(msg, self.gpu_uuid))
                    delay, failed_here = 0.1, 0
                self._move(None)  # the stream ended: that manager stopped or stepped down
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                code = code_of(e)
                self.history.error = f"{code}: {e.details() if hasattr(e, 'details') else e}"
                # a handshake that fails before any layout: the set-up is wrong (CA, certificate,
                # a TLS port for a plaintext one); later (a manager's certificate renewed wrongly,
                # a failover) the watch goes on trying, saying so
                tls_refused = handshake_failure(e) and self.history.newest is None
                if tls_refused or code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                                           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                    self.history.error = self.client.refusal(e)
                    log.error("layout watch refused", error=self.history.error)
                    self._refused.set()
                    with self.history.cond:
                        self.history.cond.notify_all()
                    return
                if handshake_failure(e):
                    log.error("layout watch: TLS handshake failed", error=self.client.refusal(e))
                hint = self.client.failed(e)
                failed_here += 1
                log.warning("layout watch lost; reconnecting", error=self.history.error, leader=hint)
                self._move(hint)
            if hint is not None or failed_here < len(self.targets):
                self._stop.wait(random.uniform(0, 0.1))  # another manager: go now (jittered)
                continue
            failed_here = 0
            self._stop.wait(random.uniform(0, delay))  # every address failed: full jitter
            delay = min(delay * 2, 5.0)

    def latest(self) -> WorkerLayout | None:
        return self.history.newest

    def get(self, version: int) -> WorkerLayout | None:
        return self.history.by_version.get(version)

    def wait_newer(self, version: int, timeout: float) -> WorkerLayout | None:
        """The newest layout after `version` within `timeout`, else None; raises RuntimeError once
        the manager has refused the watch for good (the job was deleted, the token revoked): no
        layout can come, and a spare that waits without a deadline would wait forever."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.history.wait_newer(version, min(1.0, max(0.0, deadline - time.monotonic())))
            if got is not None:
                return got
            if self._refused.is_set():
                raise RuntimeError(f"the manager ended the layout watch of {self.job!r}: {self.history.error}")
            if time.monotonic() >= deadline:
                return None

    def ack(self, layout: WorkerLayout, ok: bool, detail: str = "", restored: RestoreNote | None = None) -> None:
        from ntp_manager.contract.proto.ntp.v1 import common_pb2, worker_pb2

        req = worker_pb2.AckLayoutRequest(
            job=self.job, worker_id=self.worker_id,
            stamp=common_pb2.LayoutStamp(leader_epoch=layout.epoch, version=layout.version),
            status=worker_pb2.ACK_STATUS_APPLIED if ok else worker_pb2.ACK_STATUS_FAILED, detail=detail,
        )
        if restored is not None and ok:
            restored.fill(req.restored)
        try:
            self._stub.AckLayout(req, metadata=self._md, timeout=10)
        except Exception as e:  # an ack that cannot be delivered must not stop training
            log.warning("ack failed", version=layout.version, error=str(e))

    def report_step(self, layout: WorkerLayout, step: int, step_time_s: float, tokens: int,
                    work: StepWork | None = None) -> None:
        rep = step_report(self.job, self.worker_id, self.gpu_uuid, layout, step, step_time_s, tokens, work)
        rep.at.GetCurrentTime()
        with self._steps_cond:  # sent from a thread: a step never waits on the manager
            self._steps = [rep]  # only the newest matters
            self._steps_cond.notify()

    def _report_loop(self) -> None:
        while not self._stop.is_set():
            with self._steps_cond:
                while not self._steps and not self._stop.is_set():
                    self._steps_cond.wait(0.5)
                batch, self._steps = self._steps, []
            for rep in batch:
                try:
                    self._stub.ReportSteps(rep, metadata=self._md, timeout=5)
                except Exception as e:
                    log.debug("step report failed", error=str(e))

    def close(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        with self._steps_cond:
            self._steps_cond.notify_all()
        self._channel.close()
