"""A layout version -> the `ntp.v1.Layout` each worker watches.

Each worker's view holds every replica's summary plus the full rank lists of its own replica and of
one peer it can fetch state from: O(replicas + TP), never the job's whole GPU list; the summaries
go as runs of consecutive replicas that share one (`summary_runs_part`), so the bytes a push sends
grow with the job's distinct replica shapes (a few, while GPUs fail here and there), not with its
replicas. The shared part (summaries, stamp) is built and serialized once per version, in a worker
thread, with the GPU -> replica map; a replica's detail is built and serialized the first time a
watcher of it asks, and kept: a push to a watcher is a few dict look-ups and a byte concatenation
(protobuf concatenation merges messages), so the per-version work does not grow with the number of
watchers.

Global ranks number GPUs replica by replica (ascending id), stage by stage, TP rank by TP rank
(`LayoutDoc.ranks`, which is `contract.ranks.stage_ranks`, the function the workers number them
with). Every summary carries each stage's TP degree, so a worker can find its stage's peers in
every replica.

The message's fields are written by `contract.layout` (the parts of a `WireLayout`), which the
workers decode with: the two sides cannot read a field differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ntp_manager.contract.layout import (
    WireGroup,
    WireLayout,
    WireReplica,
    head_part,
    own_part,
    peers_part,
    summary_runs_part,
)
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core.state import LayoutRec


@dataclass
class LayoutViews:
    doc: LayoutDoc
    base: bytes  # the serialized shared part
    replica_of: dict[str, int]  # GPU UUID -> its replica's index in doc.replicas
    full: tuple[int, ...]  # indexes of (up to two) full-degree replicas: donors of state
    _own: dict[int, bytes] = field(default_factory=dict)
    _peer: dict[int, bytes] = field(default_factory=dict)

    def bytes_for_gpu(self, gpu_uuid: str) -> bytes:
        """The serialized `ntp.v1.Layout` of the worker on `gpu_uuid`: the shared part, its own
        replica's detail and a full-degree peer's (none for a GPU with no place in the layout)."""
        i = self.replica_of.get(gpu_uuid)
        if i is None:
            return self.base
        own = self._own.get(i)
        if own is None:
            own = self._own[i] = own_part(self.detail(i))
        donor = next((f for f in self.full if f != i), None)
        if donor is None:
            return self.base + own
        peer = self._peer.get(donor)
        if peer is None:
            peer = self._peer[donor] = peers_part([self.detail(donor)])
        return self.base + own + peer

    def detail(self, i: int) -> WireReplica:
        """Replica `i`'s groups with their GPUs and global ranks. O(its GPUs)."""
        doc = self.doc
        r, first = doc.replica(i), doc.group_starts[i]
        return WireReplica(r.id, tuple(
            WireGroup(g.group, g.domain, g.stage, g.tp, g.gpus, tuple(doc.group_ranks(first + g.stage)),
                      g.power_ratio)
            for g in r.groups))


CHUNK = 4096  # replica summaries per protobuf call (each call holds the GIL throughout)


def build_views(rec: LayoutRec, rendezvous: str = "") -> LayoutViews:
    """The views of one layout version. O(GPUs): call it in a worker thread. The shared part is
    serialized in pieces (protobuf concatenation appends repeated fields), so no single C call
    spans 100K replica summaries."""
    doc = rec.doc
    head = WireLayout(job=rec.job, version=rec.version, epoch=rec.leader_epoch, created_at=rec.created_at,
                      healthy_tp=doc.tp, target_batch=doc.target_batch, global_batch=doc.global_batch,
                      world_size=doc.world_size, rendezvous=rendezvous, reason=rec.reason,
                      restore_step=doc.restore_step)  # restore_step: issue 22, no survivor holds some unit
    parts = [head_part(head)]
    ids, tps, batches, degrees = doc.replica_ids, doc.replica_tps, doc.local_batches, doc.degrees
    for lo in range(0, len(ids), CHUNK):
        hi = lo + CHUNK  # plain tuples in WireSummary's field order: no object per replica
        parts.append(summary_runs_part(list(zip(ids[lo:hi], tps[lo:hi], batches[lo:hi], degrees[lo:hi], strict=True))))
    replica_of: dict[str, int] = {}
    gs, us = doc.group_starts, doc.gpu_starts
    for i in range(len(ids)):
        replica_of.update(dict.fromkeys(doc.gpus[us[gs[i]] : us[gs[i + 1]]], i))
    full = tuple(i for i, t in enumerate(tps) if t == doc.tp)[:2]
    return LayoutViews(doc, b"".join(parts), replica_of, full)
