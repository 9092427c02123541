"""The typed layout: what a job runs, as the manager keeps, stores and serves it.

`LayoutDoc` is a plan reduced to what outlives the planning: replicas in id order, each a pipeline
of TP groups in stage order with their GPUs in TP-rank order, the groups set aside, power caps,
batches, reasons and what moved. It is built from a `Plan` (`LayoutDoc.of`), read back from the
store (store/layout_codec.py) or from the documented plan JSON (`from_dict`, docs/plan-json.md),
and every reader (the manager's queries, the dashboard, the gRPC views) uses its fields, never
string keys. Only the edges turn it into something else: a dict for REST (`to_dict`), protobuf in
rpc/, bytes in the store.

Global ranks are the GPUs' positions in `gpus()`: replica by replica (ascending id), stage by
stage, TP index by TP index, as `contract.ranks.stage_ranks` numbers them for the workers.

Records are NamedTuples: immutable, compared field by field in C, and cheaper to make than
dataclasses (a layout of 100K one-GPU replicas holds 200K of them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import accumulate, pairwise
from typing import Any, NamedTuple, overload

from ntp_manager.contract.ranks import stage_ranks
from ntp_manager.planner.moves import PreviousLayout
from ntp_manager.planner.plan import Plan, SetAside
from ntp_manager.planner.spec import PlanError

PLAN_SCHEMA_VERSION = 1


class GroupDoc(NamedTuple):
    """One TP group of a replica: the pipeline stage it serves, at `tp` GPUs (`gpus`, TP order)."""

    group: str  # "domain/gN"
    domain: str
    stage: int
    tp: int
    usable: int  # usable GPUs the group had (>= tp)
    spare: bool
    power_ratio: float  # limit / nominal limit on its GPUs; > 1 when boosted
    gpus: tuple[str, ...]
    prev_replica: int | None = None  # where it was in the previous plan (None: not placed there)
    prev_stage: int | None = None

    def placement(self) -> tuple[Any, ...]:
        """The fields that make the layout: all but the previous place (history, not layout)."""
        return self[:8]


class ReplicaDoc(NamedTuple):
    id: int
    tp: int  # the lowest TP degree of its stages
    local_batch: int
    relative_throughput: float
    groups: tuple[GroupDoc, ...]  # stage order

    @property
    def stage_tp(self) -> tuple[int, ...]:
        return tuple(g.tp for g in self.groups)


class AsideDoc(NamedTuple):
    """A group the layout does not use, and why."""

    group: str
    domain: str
    usable: int
    spare: bool
    reason: str


class MovesDoc(NamedTuple):
    """What a layout changed relative to the one before it (planner.MoveSummary)."""

    moved: int
    stage_changed: int
    joined: int
    left: int
    bytes: int | None


class Move(NamedTuple):
    """A group placed in a replica where it was not before (`from_replica` None: newly placed)."""

    group: str
    stage: int
    from_replica: int | None
    from_stage: int | None


HEADER = ("job", "scheme", "tp", "global_batch", "target_batch", "relative_throughput", "meets_target",
          "dropped", "idle", "spares_used", "power_caps_w", "reasons", "moves", "tracks_moves", "restore_step")
COLUMNS = ("replica_ids", "replica_tps", "local_batches", "replica_throughputs", "group_starts", "group_ids",
           "group_domains", "group_tps", "group_usable", "group_spare", "power_ratios", "prev_replicas",
           "prev_stages", "gpus")


class LayoutDoc:
    """A layout: its header fields, and its replicas and groups kept as columns (tuples of plain
    values, one entry per replica or per group, and every GPU in global-rank order). A layout of
    100K one-GPU replicas is then a few dozen objects instead of several hundred thousand, which
    the cyclic garbage collector would scan (holding the event loop) and a replacement would free
    one by one. `replicas` gives the typed records, made when read. Immutable; equal when every
    field and column is."""

    __slots__ = (*HEADER, *COLUMNS, "gpu_starts")

    job: str
    scheme: str
    tp: int  # the healthy TP degree
    global_batch: int
    target_batch: int
    relative_throughput: float
    meets_target: bool
    dropped: tuple[AsideDoc, ...]
    idle: tuple[AsideDoc, ...]
    spares_used: tuple[str, ...]
    power_caps_w: Mapping[str, float]  # GPU UUID -> watts, only where the limit differs from nominal
    reasons: tuple[str, ...]
    moves: MovesDoc | None  # None: planned without a previous layout
    tracks_moves: bool  # whether groups carry their previous places (older documents do not)
    # issue 22: the checkpoint step the workers restore from, when no surviving GPU holds some unit
    # (planner/restore.py; the manager sets it, a plan never does)
    restore_step: int | None
    # columns: replicas in ascending id; groups replica by replica in stage order
    replica_ids: tuple[int, ...]
    replica_tps: tuple[int, ...]
    local_batches: tuple[int, ...]
    replica_throughputs: tuple[float, ...]
    group_starts: tuple[int, ...]  # replica i's groups are group_starts[i] .. group_starts[i + 1] - 1
    group_ids: tuple[str, ...]
    group_domains: tuple[str, ...]
    group_tps: tuple[int, ...]
    group_usable: tuple[int, ...]
    group_spare: tuple[bool, ...]
    power_ratios: tuple[float, ...]
    prev_replicas: tuple[int | None, ...]
    prev_stages: tuple[int | None, ...]
    gpus: tuple[str, ...]  # every GPU in global-rank order
    gpu_starts: tuple[int, ...]  # group g's GPUs (and global ranks) are gpu_starts[g] .. gpu_starts[g + 1] - 1

    def __init__(self, job: str, scheme: str, tp: int, global_batch: int, target_batch: int,
                 relative_throughput: float, meets_target: bool, replicas: Iterable[ReplicaDoc],
                 dropped: tuple[AsideDoc, ...] = (), idle: tuple[AsideDoc, ...] = (), spares_used: tuple[str, ...] = (),
                 power_caps_w: Mapping[str, float] | None = None, reasons: tuple[str, ...] = (),
                 moves: MovesDoc | None = None, tracks_moves: bool = True, restore_step: int | None = None) -> None:
        """From typed records. PlanError when replica ids do not ascend, a replica has no group,
        or a group is not at its place (stage = its index) or holds other than TP GPUs."""
        cols: dict[str, list[Any]] = {c: [] for c in COLUMNS}
        cols["group_starts"].append(0)
        gpus: list[str] = []
        for r in replicas:
            cols["replica_ids"].append(r.id)
            cols["replica_tps"].append(r.tp)
            cols["local_batches"].append(r.local_batch)
            cols["replica_throughputs"].append(r.relative_throughput)
            if not r.groups:
                raise PlanError(f"layout of {job!r}: replica {r.id} has no group")
            for s, g in enumerate(r.groups):
                if g.stage != s or len(g.gpus) != g.tp or g.tp < 1:
                    raise PlanError(f"layout of {job!r}: replica {r.id} group {g.group!r} is stage {g.stage} "
                                    f"at TP{g.tp} with {len(g.gpus)} GPUs (expected stage {s}, TP = GPUs >= 1)")
                cols["group_ids"].append(g.group)
                cols["group_domains"].append(g.domain)
                cols["group_tps"].append(g.tp)
                cols["group_usable"].append(g.usable)
                cols["group_spare"].append(g.spare)
                cols["power_ratios"].append(g.power_ratio)
                cols["prev_replicas"].append(g.prev_replica)
                cols["prev_stages"].append(g.prev_stage)
                gpus.extend(g.gpus)
            cols["group_starts"].append(len(cols["group_ids"]))
        cols["gpus"] = gpus
        header = (job, scheme, tp, global_batch, target_batch, relative_throughput, meets_target, tuple(dropped),
                  tuple(idle), tuple(spares_used), dict(power_caps_w or {}), tuple(reasons), moves, tracks_moves,
                  restore_step)
        self._set(header, tuple(tuple(cols[c]) for c in COLUMNS))

    @classmethod
    def from_columns(cls, header: tuple[Any, ...], columns: tuple[tuple[Any, ...], ...]) -> LayoutDoc:
        """From its header fields (in HEADER order) and columns (in COLUMNS order), as read off
        another layout's attributes: no record is made. PlanError when replica ids do not ascend."""
        if len(header) != len(HEADER) or len(columns) != len(COLUMNS):
            raise PlanError(f"a layout has {len(HEADER)} header fields and {len(COLUMNS)} columns")
        out = object.__new__(cls)
        out._set(header, columns)
        return out

    def _set(self, header: tuple[Any, ...], columns: tuple[tuple[Any, ...], ...]) -> None:
        for name, v in zip(HEADER, header, strict=True):
            object.__setattr__(self, name, v)
        for name, v in zip(COLUMNS, columns, strict=True):
            object.__setattr__(self, name, v)
        # global ranks number the GPUs replica by replica, stage by stage (contract.ranks): a
        # group's ranks are the running sum of the TP degrees before it
        object.__setattr__(self, "gpu_starts", (0, *accumulate(self.group_tps)))
        ids = self.replica_ids
        if any(b <= a for a, b in pairwise(ids)):
            raise PlanError(f"layout of {self.job!r}: replica ids must ascend, got {list(ids[:20])}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"LayoutDoc is immutable ({name})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayoutDoc):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in (*HEADER, *COLUMNS))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"LayoutDoc(job={self.job!r}, replicas={len(self.replica_ids)}, groups={len(self.group_ids)}, "
                f"gpus={len(self.gpus)}, global_batch={self.global_batch}, moves={self.moves})")

    def header(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in HEADER}

    def replace(self, **changes: Any) -> LayoutDoc:
        """A copy with some header fields, or `replicas`, changed."""
        if "replicas" in changes:
            return LayoutDoc(**{**self.header(), **changes})
        out = object.__new__(LayoutDoc)
        out._set(tuple(changes.get(n, getattr(self, n)) for n in HEADER), tuple(getattr(self, c) for c in COLUMNS))
        return out

    # ---- reading -----------------------------------------------------------------------------
    @property
    def replicas(self) -> Replicas:
        """The replicas as typed records (made when read: O(GPUs) to go through them all)."""
        return Replicas(self)

    def group(self, g: int, replica: int, stage: int) -> GroupDoc:
        a, b = self.gpu_starts[g], self.gpu_starts[g + 1]
        return GroupDoc(self.group_ids[g], self.group_domains[g], stage, self.group_tps[g], self.group_usable[g],
                        self.group_spare[g], self.power_ratios[g], self.gpus[a:b], self.prev_replicas[g],
                        self.prev_stages[g])

    def replica(self, i: int) -> ReplicaDoc:
        """The replica at index `i` (ascending id order)."""
        rid, first, end = self.replica_ids[i], self.group_starts[i], self.group_starts[i + 1]
        return ReplicaDoc(rid, self.replica_tps[i], self.local_batches[i], self.replica_throughputs[i],
                          tuple(self.group(g, rid, g - first) for g in range(first, end)))

    def group_ranks(self, g: int) -> range:
        """Global ranks of group `g` (an index into the group columns)."""
        return range(self.gpu_starts[g], self.gpu_starts[g + 1])

    @property
    def degrees(self) -> tuple[tuple[int, ...], ...]:
        """Per replica, each stage's TP degree (the input of `contract.ranks`)."""
        t, st = self.group_tps, self.group_starts
        return tuple(t[st[i] : st[i + 1]] for i in range(len(self.replica_ids)))

    def ranks(self) -> list[list[range]]:
        """[replica index][stage] -> that group's global ranks (`contract.ranks.stage_ranks`)."""
        return stage_ranks(self.degrees) if self.replica_ids else []

    @property
    def world_size(self) -> int:
        return len(self.gpus)

    def moved_into(self, r: ReplicaDoc) -> list[Move]:
        """The groups of `r` that were not at this (replica, stage) in the previous layout; none
        when the layout does not record previous places."""
        if not self.tracks_moves:
            return []
        return [Move(g.group, g.stage, g.prev_replica, g.prev_stage) for g in r.groups
                if (g.prev_replica, g.prev_stage) != (r.id, g.stage)]

    def boosted(self) -> Iterator[tuple[str, float]]:
        """(GPU, power ratio) of every GPU running above its nominal limit."""
        for g, ratio in enumerate(self.power_ratios):
            if ratio > 1.0:
                for u in self.gpus[self.gpu_starts[g] : self.gpu_starts[g + 1]]:
                    yield u, ratio

    def previous(self) -> PreviousLayout:
        """Where each group is, for the planner to keep it there in the next plan. PlanError when
        a group is in two places."""
        st = self.group_starts
        per = {st[i + 1] - st[i] for i in range(len(self.replica_ids))}
        slots = {self.group_ids[g]: (rid, g - st[i]) for i, rid in enumerate(self.replica_ids)
                 for g in range(st[i], st[i + 1])}
        if len(slots) != len(self.group_ids):
            raise PlanError(f"layout of {self.job!r}: a group is placed twice")
        gs, every = self.gpu_starts, self.gpus
        members = {gid: every[gs[g]:gs[g + 1]] for g, gid in enumerate(self.group_ids)}
        return PreviousLayout(slots, self.tp, per.pop() if len(per) == 1 else None, members)

    def _replica_key(self, i: int) -> tuple[Any, ...]:
        """Replica `i`'s placement (what `same_layout` compares) as plain values, id left out."""
        a, b = self.group_starts[i], self.group_starts[i + 1]
        return (self.replica_tps[i], self.local_batches[i], self.replica_throughputs[i], self.group_ids[a:b],
                self.group_domains[a:b], self.group_tps[a:b], self.group_usable[a:b], self.group_spare[a:b],
                self.power_ratios[a:b], self.gpus[self.gpu_starts[a]:self.gpu_starts[b]])

    def changed_since(self, old: LayoutDoc | None) -> list[int]:
        """Indices of the replicas that are new, or placed otherwise, since `old` (all without
        one): their TP, batch, throughput, groups or GPUs differ. Column slices, no records."""
        if old is None:
            return list(range(len(self.replica_ids)))
        at = {rid: k for k, rid in enumerate(old.replica_ids)}
        return [i for i, rid in enumerate(self.replica_ids)
                if (k := at.get(rid)) is None or old._replica_key(k) != self._replica_key(i)]

    PLACEMENT = ("replica_ids", "replica_tps", "local_batches", "replica_throughputs", "group_starts", "group_ids",
                 "group_domains", "group_tps", "group_usable", "group_spare", "power_ratios", "gpus")

    def same_layout(self, other: LayoutDoc) -> bool:
        """Whether `other` runs exactly this layout: the same replicas, groups, GPUs, batches and
        power caps. Where groups were before, what moved and the reasons are left out (two equal
        layouts planned from different previous ones differ in those). Column by column."""
        return (self.global_batch == other.global_batch and dict(self.power_caps_w) == dict(other.power_caps_w)
                and all(getattr(self, c) == getattr(other, c) for c in self.PLACEMENT))

    # ---- building ----------------------------------------------------------------------------
    @classmethod
    def of(cls, plan: Plan) -> LayoutDoc:
        """The layout of a plan. O(GPUs): its columns are filled from the plan's groups directly
        (no record per group made and taken apart again: that was a third of a 96,000-GPU replan)."""
        ids: list[int] = []
        rtps: list[int] = []
        batches: list[int] = []
        thr: list[float] = []
        starts = [0]
        gids: list[str] = []
        doms: list[str] = []
        gtps: list[int] = []
        usable: list[int] = []
        spare: list[bool] = []
        ratios: list[float] = []
        prev_r: list[int | None] = []
        prev_s: list[int | None] = []
        gpus: list[str] = []
        for r in plan.replicas:
            if not r.groups:
                raise PlanError(f"layout of {plan.job!r}: replica {r.replica_id} has no group")
            ids.append(r.replica_id)
            rtps.append(r.tp)
            batches.append(r.local_batch)
            thr.append(round(r.relative_throughput, 6))
            for s, g in enumerate(r.groups):
                members = g.gpus
                if g.stage != s or len(members) != g.tp or g.tp < 1:
                    raise PlanError(f"layout of {plan.job!r}: replica {r.replica_id} group {g.group_id!r} is "
                                    f"stage {g.stage} at TP{g.tp} with {len(members)} GPUs (expected stage {s}, "
                                    "TP = GPUs >= 1)")
                gids.append(g.group_id)
                doms.append(g.domain)
                gtps.append(g.tp)
                usable.append(g.usable)
                spare.append(g.spare)
                ratios.append(g.power_ratio)
                prev_r.append(g.prev_replica)
                prev_s.append(g.prev_stage)
                gpus.extend(members)
            starts.append(len(gids))
        m = plan.moves
        moves = None if m is None else MovesDoc(m.moved, m.stage_changed, m.joined, m.left, m.bytes)
        header = (plan.job, plan.scheme.value, plan.tp, plan.global_batch, plan.target_batch,
                  round(plan.relative_throughput, 6), plan.meets_target, tuple(_aside(s) for s in plan.dropped),
                  tuple(_aside(s) for s in plan.idle), tuple(plan.spares_used), dict(sorted(plan.power_caps_w.items())),
                  tuple(plan.reasons), moves, True, None)
        columns = (ids, rtps, batches, thr, starts, gids, doms, gtps, usable, spare, ratios, prev_r, prev_s, gpus)
        return cls.from_columns(header, tuple(tuple(c) for c in columns))

    # ---- the documented plan JSON (docs/plan-json.md) -------------------------------------------
    def to_dict(self, start: int = 0, stop: int | None = None, list_max: int | None = None) -> dict[str, Any]:
        """The plan JSON shape of docs/plan-json.md (what REST and `ntp-manager plan --json` show).

        A page of it, for answers that must not grow with the job: only the replicas at indices
        `start` .. `stop` - 1 (ascending id order; `stop` None: to the end), `power_caps_w` only for
        their GPUs, and with `list_max` at most that many entries of `dropped`, `idle`,
        `spares_used` and `reasons` (the first ones). O(the page's GPUs + list_max)."""
        n = len(self.replica_ids)
        start = min(start, n)
        end = n if stop is None else max(start, min(stop, n))
        track = self.tracks_moves
        caps = self.power_caps_w
        if start == 0 and end == n:
            page_caps = dict(caps)
        elif caps:
            shown = self.gpus[self.gpu_starts[self.group_starts[start]] : self.gpu_starts[self.group_starts[end]]]
            page_caps = {u: caps[u] for u in shown if u in caps}
        else:
            page_caps = {}
        cut = slice(None) if list_max is None else slice(0, list_max)
        return {
            "schema": PLAN_SCHEMA_VERSION,
            "job": self.job,
            "scheme": self.scheme,
            "tp": self.tp,
            "global_batch": self.global_batch,
            "target_batch": self.target_batch,
            "relative_throughput": self.relative_throughput,
            "meets_target": self.meets_target,
            "replicas": [_replica_dict(self.replica(i), track) for i in range(start, end)],
            "dropped": [a._asdict() for a in self.dropped[cut]],
            "idle": [a._asdict() for a in self.idle[cut]],
            "spares_used": list(self.spares_used[cut]),
            "power_caps_w": page_caps,
            "reasons": list(self.reasons[cut]),
            "moves": None if self.moves is None else self.moves._asdict(),
            "restore_step": self.restore_step,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayoutDoc:
        """From plan JSON (docs/plan-json.md), including documents written before `prev_replica`,
        `prev_stage` and `moves` existed. Raises PlanError naming what is malformed."""
        try:
            first = next((g for r in d["replicas"] for g in r["groups"]), None)
            track = first is None or "prev_replica" in first
            replicas = tuple(
                ReplicaDoc(int(r["id"]), int(r["tp"]), int(r["local_batch"]), float(r["relative_throughput"]),
                           tuple(_group_of(g) for g in sorted(r["groups"], key=lambda g: int(g["stage"]))))
                for r in sorted(d["replicas"], key=lambda r: int(r["id"])))
            m = d.get("moves")
            return cls(
                job=str(d["job"]), scheme=str(d["scheme"]), tp=int(d["tp"]), global_batch=int(d["global_batch"]),
                target_batch=int(d["target_batch"]), relative_throughput=float(d["relative_throughput"]),
                meets_target=bool(d["meets_target"]), replicas=replicas,
                dropped=tuple(_aside_of(a) for a in d.get("dropped", ())),
                idle=tuple(_aside_of(a) for a in d.get("idle", ())),
                spares_used=tuple(str(s) for s in d.get("spares_used", ())),
                power_caps_w={str(u): float(w) for u, w in d.get("power_caps_w", {}).items()},
                reasons=tuple(str(s) for s in d.get("reasons", ())),
                moves=None if m is None else MovesDoc(int(m["moved"]), int(m["stage_changed"]), int(m["joined"]),
                                                      int(m["left"]), None if m["bytes"] is None else int(m["bytes"])),
                tracks_moves=track,
                restore_step=None if d.get("restore_step") is None else int(d["restore_step"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"plan JSON is malformed: {e!r}") from None


def _aside(s: SetAside) -> AsideDoc:
    return AsideDoc(s.group_id, s.domain, s.usable, s.spare, s.reason)


def _replica_dict(r: ReplicaDoc, track: bool) -> dict[str, Any]:
    return {"id": r.id, "tp": r.tp, "local_batch": r.local_batch, "relative_throughput": r.relative_throughput,
            "groups": [_group_dict(g, track) for g in r.groups]}


def _group_dict(g: GroupDoc, track: bool) -> dict[str, Any]:
    d = {"group": g.group, "domain": g.domain, "stage": g.stage, "tp": g.tp, "usable": g.usable, "spare": g.spare,
         "power_ratio": g.power_ratio, "gpus": list(g.gpus)}
    if track:
        d["prev_replica"], d["prev_stage"] = g.prev_replica, g.prev_stage
    return d


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _group_of(g: Mapping[str, Any]) -> GroupDoc:
    return GroupDoc(str(g["group"]), str(g["domain"]), int(g["stage"]), int(g["tp"]), int(g["usable"]),
                    bool(g["spare"]), float(g["power_ratio"]), tuple(str(u) for u in g["gpus"]),
                    _opt_int(g.get("prev_replica")), _opt_int(g.get("prev_stage")))


def _aside_of(a: Mapping[str, Any]) -> AsideDoc:
    return AsideDoc(str(a["group"]), str(a["domain"]), int(a["usable"]), bool(a["spare"]), str(a["reason"]))


class Replicas(Sequence[ReplicaDoc]):
    """The replicas of a layout as typed records, made on access (`layout.replicas`)."""

    __slots__ = ("_doc",)

    def __init__(self, doc: LayoutDoc) -> None:
        self._doc = doc

    def __len__(self) -> int:
        return len(self._doc.replica_ids)

    @overload
    def __getitem__(self, i: int) -> ReplicaDoc: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[ReplicaDoc, ...]: ...

    def __getitem__(self, i: int | slice) -> ReplicaDoc | tuple[ReplicaDoc, ...]:
        if isinstance(i, slice):
            return tuple(self._doc.replica(k) for k in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"replica index {i} out of range")
        return self._doc.replica(i)

    def __iter__(self) -> Iterator[ReplicaDoc]:
        doc = self._doc
        for i in range(len(doc.replica_ids)):
            yield doc.replica(i)
