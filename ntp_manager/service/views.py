"""A plan (as stored) -> the `ntp.v1.Layout` a worker watches.

Each worker's view holds every replica's summary plus the full rank lists of its own replica and of
one peer it can fetch state from: O(replicas + TP), never the job's whole GPU list. The shared part
(summaries, stamp) is built once per version; per-watcher work is a copy plus two replica details.

Global ranks number GPUs replica by replica (ascending id), stage by stage, TP rank by TP rank
(`planner.ranks`, the function the workers number them with). Every summary carries each stage's
TP degree, so a worker can find its stage's peers in every replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from ntp_manager._proto.ntp.v1 import common_pb2 as pb
from ntp_manager.planner.ranks import stage_ranks
from ntp_manager.service.state import LayoutRec


@dataclass
class LayoutViews:
    base: pb.Layout
    details: dict[int, pb.ReplicaDetail]
    replica_of: dict[str, int]  # GPU UUID -> replica id
    donor_for: dict[int, int | None]  # replica id -> a full-degree peer to fetch state from
    _base_bytes: bytes = b""
    _own_bytes: dict[int, bytes] | None = None
    _peer_bytes: dict[int, bytes] | None = None

    def bytes_for_gpu(self, gpu_uuid: str) -> bytes:
        """The same message as `for_gpu`, serialized. Protobuf concatenation merges messages, so the
        shared part is serialized once per version and each watcher costs two dict look-ups."""
        if self._own_bytes is None:
            self._base_bytes = self.base.SerializeToString()
            self._own_bytes = {r: pb.Layout(own=d).SerializeToString() for r, d in self.details.items()}
            self._peer_bytes = {r: pb.Layout(peers=[d]).SerializeToString() for r, d in self.details.items()}
        rid = self.replica_of.get(gpu_uuid)
        if rid is None:
            return self._base_bytes
        donor = self.donor_for.get(rid)
        assert self._peer_bytes is not None
        return self._base_bytes + self._own_bytes[rid] + (self._peer_bytes[donor] if donor is not None else b"")

    def for_gpu(self, gpu_uuid: str) -> pb.Layout:
        msg = pb.Layout()
        msg.CopyFrom(self.base)
        rid = self.replica_of.get(gpu_uuid)
        if rid is None:
            return msg  # the worker's GPU has no place in this layout
        msg.own.CopyFrom(self.details[rid])
        donor = self.donor_for.get(rid)
        if donor is not None:
            msg.peers.append(self.details[donor])
        return msg


def build_views(rec: LayoutRec, rendezvous: str = "") -> LayoutViews:
    plan: dict[str, Any] = rec.plan
    ts = Timestamp()
    ts.FromDatetime(rec.created_at)
    base = pb.Layout(
        job=rec.job,
        stamp=pb.LayoutStamp(leader_epoch=rec.leader_epoch, version=rec.version, created_at=ts),
        healthy_tp_degree=plan["tp"],
        target_batch=plan["target_batch"],
        global_batch=plan["global_batch"],
        rendezvous=rendezvous,
        reason=rec.reason,
    )
    details: dict[int, pb.ReplicaDetail] = {}
    replica_of: dict[str, int] = {}
    full: list[int] = []
    replicas = sorted(plan["replicas"], key=lambda r: r["id"])
    stages = [sorted(r["groups"], key=lambda g: g["stage"]) for r in replicas]
    numbers = stage_ranks([[len(g["gpus"]) for g in gs] for gs in stages]) if replicas else []
    rank = 0
    for r, groups, ranks_of in zip(replicas, stages, numbers, strict=True):
        base.replicas.append(pb.ReplicaSummary(replica_id=r["id"], tp_degree=r["tp"], local_batch=r["local_batch"],
                                               stage_tp_degrees=[len(g["gpus"]) for g in groups]))
        detail = pb.ReplicaDetail(replica_id=r["id"])
        for g, ranks in zip(groups, ranks_of, strict=True):
            detail.groups.append(
                pb.TpGroup(group_id=g["group"], domain=g["domain"], stage=g["stage"], tp_degree=g["tp"],
                           gpu_uuids=g["gpus"], global_ranks=list(ranks), power_ratio=g["power_ratio"])
            )
            rank = ranks.stop
            for u in g["gpus"]:
                replica_of[u] = r["id"]
        details[r["id"]] = detail
        if r["tp"] == plan["tp"]:
            full.append(r["id"])
    base.world_size = rank
    donor_for: dict[int, int | None] = {}
    for rid in details:
        donor_for[rid] = next((f for f in full if f != rid), None)
    return LayoutViews(base, details, replica_of, donor_for)
