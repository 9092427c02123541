"""A worker's view of one layout version as it crosses the wire: `WireLayout`, and its codec to and
from `ntp.v1.Layout` (proto/ntp/v1/common.proto). The manager encodes with it (rpc/views.py) and
the worker decodes with it (worker/sources.py), so the two read the message's fields one way.

A view holds every replica's summary (`WireSummary`: its TP degree, local batch and the TP degree
of each pipeline stage) and the full rank lists of the worker's own replica and of peers it can
fetch state from (`WireReplica`, a `WireGroup` per stage). Its serialized form may be built in
parts: protobuf appends repeated fields and merges message fields when serialized messages are
concatenated, so `head_part(...) + summaries_part(...) + own_part(...) + peers_part(...)` parses to
the same message as `encode()`. The manager builds the parts once per version and per replica and
concatenates them per watcher; its summaries go as runs where consecutive replicas share one
(`summary_runs_part`: a view of a 12,500-replica job is a few hundred bytes of them, not ~160 KB).

`degrees()` and `rank_of()` read a view the way `contract.ranks` numbers GPUs (replica by replica,
stage by stage, TP index by TP index) and refuse a view whose summaries, groups and ranks do not
agree (ValueError).

Standard library and protobuf only: a worker's installation has both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from itertools import pairwise
from typing import NamedTuple

from google.protobuf.timestamp_pb2 import Timestamp

from ntp_manager.contract.proto.ntp.v1 import common_pb2 as pb
from ntp_manager.contract.ranks import check_degrees, global_rank


class WireSummary(NamedTuple):
    """One replica as every view shows it (`ntp.v1.ReplicaSummary`). A tuple, not a dataclass: a
    view of a large job holds 100K of them, made in one pass."""

    replica_id: int
    tp: int  # the lowest TP degree of its stages
    local_batch: int
    stage_tps: tuple[int, ...] = ()  # each stage's TP degree; () from a manager before pipelines: one stage at tp

    @property
    def degrees(self) -> tuple[int, ...]:
        """Each stage's TP degree (one stage at `tp` when the summary names none)."""
        return self.stage_tps or (self.tp,)


@dataclass(frozen=True, slots=True)
class WireGroup:
    """One TP group of a replica, serving one pipeline stage (`ntp.v1.TpGroup`)."""

    group_id: str
    domain: str
    stage: int
    tp: int
    gpu_uuids: tuple[str, ...]  # TP order
    global_ranks: tuple[int, ...]  # same order as gpu_uuids
    power_ratio: float  # limit / TDP on these GPUs (1.0: not boosted)


@dataclass(frozen=True, slots=True)
class WireReplica:
    """A replica's groups with their GPUs and global ranks (`ntp.v1.ReplicaDetail`)."""

    replica_id: int
    groups: tuple[WireGroup, ...]  # stage order


@dataclass(frozen=True)
class WireLayout:
    """One worker's view of a layout version (`ntp.v1.Layout`). Every view is complete: no deltas."""

    job: str
    version: int
    epoch: int = 0  # the leader epoch that made the version
    created_at: datetime | None = None  # UTC; decoded as an aware datetime
    healthy_tp: int = 0
    target_batch: int = 0
    global_batch: int = 0
    world_size: int = 0
    replicas: tuple[WireSummary, ...] = ()
    own: WireReplica | None = None  # None when the worker's GPU has no place in this version
    peers: tuple[WireReplica, ...] = ()  # replicas the worker can sync or reshard with
    rendezvous: str = ""  # store address for the process groups of this version
    reason: str = ""  # why this version exists (human readable)
    # the manager's word that no survivor holds some unit: restore the checkpoint of this step (or
    # the newest older one that verifies); None: the workers choose
    restore_step: int | None = None

    # -- the codec ---------------------------------------------------------------------------------

    def encode(self) -> pb.Layout:
        msg: pb.Layout = pb.Layout.FromString(self.to_bytes())
        return msg

    def to_bytes(self) -> bytes:
        """The serialized `ntp.v1.Layout`, made from the same parts the manager concatenates."""
        parts = [head_part(self), summaries_part(self.replicas)]
        if self.own is not None:
            parts.append(own_part(self.own))
        if self.peers:
            parts.append(peers_part(self.peers))
        return b"".join(parts)

    @classmethod
    def decode(cls, msg: pb.Layout) -> WireLayout:
        stamp = msg.stamp
        created = stamp.created_at.ToDatetime(tzinfo=UTC) if stamp.HasField("created_at") else None
        return cls(
            job=msg.job,
            version=int(stamp.version),
            epoch=int(stamp.leader_epoch),
            created_at=created,
            healthy_tp=int(msg.healthy_tp),
            target_batch=int(msg.target_batch),
            global_batch=int(msg.global_batch),
            world_size=int(msg.world_size),
            replicas=_summaries(msg),
            own=_replica(msg.own) if msg.HasField("own") else None,
            peers=tuple(_replica(d) for d in msg.peers),
            rendezvous=msg.rendezvous,
            reason=msg.reason,
            restore_step=int(msg.restore_step) if msg.HasField("restore_step") else None,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> WireLayout:
        return cls.decode(pb.Layout.FromString(data))

    # -- reading a view ----------------------------------------------------------------------------

    @cached_property
    def degrees(self) -> tuple[tuple[int, ...], ...]:
        """Per replica, each stage's TP degree: the input of `contract.ranks`. Raises ValueError
        when the replicas' pipelines differ in depth or a degree is below 1."""
        degrees = tuple(s.stage_tps or (s.tp,) for s in self.replicas)
        if degrees:
            check_degrees(degrees)
        return degrees

    def rank_of(self, gpu_uuid: str) -> int | None:
        """The global rank the manager gave `gpu_uuid` in its own replica (None: no place), checked
        against `contract.ranks`' numbering of the summaries' stage degrees. Raises ValueError for
        a view whose own replica, groups and ranks do not agree with its summaries."""
        degrees = self.degrees
        if self.own is None:
            return None
        ids = [s.replica_id for s in self.replicas]
        for g in self.own.groups:
            if gpu_uuid not in g.gpu_uuids:
                continue
            if self.own.replica_id not in ids:
                raise ValueError(f"layout {self.version}: own replica {self.own.replica_id} has no summary")
            if len(g.global_ranks) != len(g.gpu_uuids):
                raise ValueError(f"layout {self.version}: group {g.group_id} has {len(g.gpu_uuids)} GPUs and "
                                 f"{len(g.global_ranks)} ranks")
            ri, index = ids.index(self.own.replica_id), g.gpu_uuids.index(gpu_uuid)
            if g.stage >= len(degrees[ri]) or len(g.gpu_uuids) != degrees[ri][g.stage]:
                raise ValueError(f"layout {self.version}: group {g.group_id} (stage {g.stage}, {len(g.gpu_uuids)} "
                                 f"GPUs) does not match replica {self.own.replica_id}'s stage degrees "
                                 f"{list(degrees[ri])}")
            rank, expected = g.global_ranks[index], global_rank(degrees, ri, g.stage, index)
            if rank != expected:
                raise ValueError(f"layout {self.version}: the manager gives {gpu_uuid} rank {rank}, the stage "
                                 f"numbering gives {expected} (replica {ri}, stage {g.stage}, TP index {index})")
            return rank
        return None


# -- the parts of a serialized view (the manager concatenates them per watcher) ----------------------


def head_part(layout: WireLayout) -> bytes:
    """Everything of `layout` but its replicas: summaries, own replica and peers."""
    stamp = pb.LayoutStamp(leader_epoch=layout.epoch, version=layout.version)
    if layout.created_at is not None:
        ts = Timestamp()
        ts.FromDatetime(layout.created_at)  # a naive datetime is read as UTC
        stamp.created_at.CopyFrom(ts)
    msg = pb.Layout(job=layout.job, stamp=stamp, healthy_tp=layout.healthy_tp, target_batch=layout.target_batch,
                    global_batch=layout.global_batch, world_size=layout.world_size, rendezvous=layout.rendezvous,
                    reason=layout.reason)
    if layout.restore_step is not None:
        msg.restore_step = layout.restore_step
    return _bytes(msg)


def summaries_part(summaries: Iterable[tuple[int, int, int, Sequence[int]]]) -> bytes:
    """Replica summaries (`WireSummary`s, or plain tuples in its field order), appended to a view's
    replicas. One protobuf call, which holds the GIL throughout: the manager gives a large job's
    summaries a few thousand at a time."""
    summary = pb.ReplicaSummary
    return _bytes(pb.Layout(replicas=[
        summary(replica_id=rid, tp=tp, local_batch=batch, stage_tps=stage_tps)
        for rid, tp, batch, stage_tps in summaries
    ]))


def summary_runs_part(summaries: Sequence[tuple[int, int, int, Sequence[int]]]) -> bytes:
    """Like `summaries_part`, for summaries in ascending replica id order: runs of two or more
    consecutive ids that share TP degree, batch and stage degrees become one `ReplicaRun` each,
    the rest stay summaries (a view of a large job is then a few runs: common.proto). Summaries
    whose ids do not ascend are written as they are."""
    ids = [s[0] for s in summaries]
    if any(a >= b for a, b in pairwise(ids)):
        return summaries_part(summaries)
    singles: list[pb.ReplicaSummary] = []
    runs: list[pb.ReplicaRun] = []
    i, n = 0, len(summaries)
    while i < n:
        rid, tp, batch, stage_tps = summaries[i]
        shape = (tp, batch, tuple(stage_tps))
        j = i + 1
        while j < n and summaries[j][0] == rid + (j - i) and (summaries[j][1], summaries[j][2],
                                                              tuple(summaries[j][3])) == shape:
            j += 1
        if j - i >= 2:
            runs.append(pb.ReplicaRun(first_id=rid, count=j - i, tp=tp, local_batch=batch, stage_tps=stage_tps))
        else:
            singles.append(pb.ReplicaSummary(replica_id=rid, tp=tp, local_batch=batch, stage_tps=stage_tps))
        i = j
    return _bytes(pb.Layout(replicas=singles, replica_runs=runs))


MAX_REPLICAS = 1 << 20  # replicas one view may list (its runs expanded): bounds what a message makes a worker hold


def _summaries(msg: pb.Layout) -> tuple[WireSummary, ...]:
    """A view's summaries: `replicas`, and the runs expanded, in replica id order. ValueError for
    runs that list no replica, more than MAX_REPLICAS in all, or a replica twice."""
    plain = [_summary((s.replica_id, s.tp, s.local_batch, tuple(s.stage_tps))) for s in msg.replicas]
    if not msg.replica_runs:
        return tuple(plain)
    total = len(plain)
    for r in msg.replica_runs:
        if r.count < 1:
            raise ValueError(f"layout.replica_runs: the run from replica {r.first_id} lists no replica")
        total += r.count
        if total > MAX_REPLICAS:
            raise ValueError(f"layout.replica_runs: more than {MAX_REPLICAS} replicas in one view")
    for r in msg.replica_runs:
        stage_tps = tuple(r.stage_tps)
        plain.extend(_summary((r.first_id + k, r.tp, r.local_batch, stage_tps)) for k in range(r.count))
    plain.sort(key=lambda s: s[0])
    for a, b in pairwise(plain):
        if a[0] == b[0]:
            raise ValueError(f"layout.replica_runs: replica {a[0]} is listed twice")
    return tuple(plain)


def own_part(own: WireReplica) -> bytes:
    """A view's own replica."""
    return _bytes(pb.Layout(own=_detail(own)))


def peers_part(peers: Sequence[WireReplica]) -> bytes:
    """Peer replicas, appended to a view's peers."""
    return _bytes(pb.Layout(peers=[_detail(p) for p in peers]))


_summary = WireSummary._make  # a NamedTuple from a tuple, without the keyword handling of its __new__


def _bytes(msg: pb.Layout) -> bytes:
    data: bytes = msg.SerializeToString()
    return data


def _detail(r: WireReplica) -> pb.ReplicaDetail:
    return pb.ReplicaDetail(replica_id=r.replica_id, groups=[
        pb.TpGroup(group_id=g.group_id, domain=g.domain, stage=g.stage, tp=g.tp, gpu_uuids=g.gpu_uuids,
                   global_ranks=g.global_ranks, power_ratio=g.power_ratio)
        for g in r.groups])


def _replica(d: pb.ReplicaDetail) -> WireReplica:
    return WireReplica(int(d.replica_id), tuple(
        WireGroup(g.group_id, g.domain, int(g.stage), int(g.tp), tuple(g.gpu_uuids),
                  tuple(int(r) for r in g.global_ranks), float(g.power_ratio))
        for g in d.groups))
