"""Layout versions as the store keeps them: compact bodies, and deltas between keyframes.

A layout version used to be stored as its full plan JSON: a UUID string per GPU per version, ~4 MB
for a 100K-GPU job on every replan. Here a version is one zlib-compressed JSON body of columns:

- GPUs are named by their position (`gpus.pos`, a stable integer given at registration), written
  as differences from the previous GPU's, so a job's GPUs in registration order are a run of 1s;
- a group's stage is its place in the replica, its GPU count its TP degree, its id
  `domain/gN` the index of its domain in a table plus N, its previous place `true` when it stayed;
- a *keyframe* holds the whole layout; a *delta* holds the replica ids in order, the replicas that
  differ from the version before (whole), the power caps set and removed, and the lists that
  changed; everything else is the base's. Every `KEYFRAME_EVERY`-th version is a keyframe, so a
  version is read from at most that many bodies.

Pure: bytes in, `LayoutDoc` out. GPU positions are resolved by the caller's `pos_of` / `uuid_at`
(the manager's memory, or the gpus table). A body this code cannot read raises `CodecError`.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any

from ntp_manager.planner.layout import AsideDoc, GroupDoc, LayoutDoc, MovesDoc, ReplicaDoc
from ntp_manager.planner.spec import PlanError

CODEC = 1
KEYFRAME_EVERY = 16  # a keyframe, then up to 15 deltas
LEVEL = 6  # zlib level: ~1% of the JSON for a healthy 100K-GPU layout (bench/layouts.py)

PosOf = Callable[[str], int]  # GPU UUID -> position; KeyError when the GPU has none
UuidAt = Callable[[int], str]  # position -> GPU UUID; KeyError/IndexError when unknown


class CodecError(ValueError):
    """A layout body that cannot be written or read (unknown GPU, wrong base, corrupt bytes)."""


# ---- writing --------------------------------------------------------------------------------


def encode(doc: LayoutDoc, pos_of: PosOf, base: LayoutDoc | None = None) -> bytes:
    """The body of `doc`: a keyframe, or with `base` (the version before it) a delta. O(GPUs) for
    a keyframe, O(replicas + the changed replicas' GPUs) for a delta."""
    body: dict[str, Any] = {"codec": CODEC, "kind": "key" if base is None else "delta", "head": _head(doc)}
    if base is None:
        body.update(_replicas(doc, range(len(doc.replica_ids)), pos_of))
        body["caps"] = _caps(doc.power_caps_w.items(), pos_of)
        for name in LISTS:
            body[name] = _list(doc, name)
    else:
        body["order"] = _deltas(doc.replica_ids)
        body.update(_replicas(doc, changed(doc, base), pos_of))
        old, new = base.power_caps_w, doc.power_caps_w
        body["caps"] = _caps(((u, w) for u, w in new.items() if old.get(u) != w), pos_of)
        body["caps_off"] = _deltas(sorted(_pos(pos_of, u) for u in old if u not in new))
        for name in LISTS:
            if getattr(doc, name) != getattr(base, name):
                body[name] = _list(doc, name)
    body["moves"] = None if doc.moves is None else list(doc.moves)
    if doc.restore_step is not None:  # issue 22; absent from bodies without one
        body["restore_step"] = doc.restore_step
    return zlib.compress(_dumps(body).encode(), LEVEL)


LISTS = ("dropped", "idle", "spares_used", "reasons")
REPLICA_COLUMNS = ("replica_tps", "local_batches", "replica_throughputs")
GROUP_COLUMNS = ("group_ids", "group_domains", "group_tps", "group_usable", "group_spare", "power_ratios",
                 "prev_replicas", "prev_stages")


def changed(doc: LayoutDoc, base: LayoutDoc) -> list[int]:
    """Indices (in `doc`) of the replicas that `base` does not have or has otherwise (any field of
    the replica, its groups or their GPUs): what a delta must carry. Compared row by row on the
    columns zipped into tuples (C loops, no record: a layout of 100K one-GPU replicas would make
    200K records per side)."""
    st, bst = doc.group_starts, base.group_starts
    where = {rid: j for j, rid in enumerate(base.replica_ids)}
    js = [where.get(rid, -1) for rid in doc.replica_ids]
    rows = list(zip(*(getattr(doc, c) for c in REPLICA_COLUMNS), strict=True))
    brows = list(zip(*(getattr(base, c) for c in REPLICA_COLUMNS), strict=True))
    same = [j >= 0 and st[i + 1] - st[i] == bst[j + 1] - bst[j] and rows[i] == brows[j] for i, j in enumerate(js)]
    gmap: list[int] = []  # doc group -> the group at the same stage of the same replica in base (-1: none)
    for i, j in enumerate(js):
        n = st[i + 1] - st[i]
        gmap.extend(range(bst[j], bst[j] + n) if same[i] else [-1] * n)
    grows = list(zip(*(getattr(doc, c) for c in GROUP_COLUMNS), strict=True))
    bgrows = list(zip(*(getattr(base, c) for c in GROUP_COLUMNS), strict=True))
    gs, bgs, ga, gb = doc.gpu_starts, base.gpu_starts, doc.gpus, base.gpus
    # equal TP degrees where the rows are equal, so the GPU runs have equal lengths
    gsame = [m >= 0 and grows[g] == bgrows[m] and ga[gs[g] : gs[g + 1]] == gb[bgs[m] : bgs[m + 1]]
             for g, m in enumerate(gmap)]
    return [i for i in range(len(js)) if not (same[i] and all(gsame[st[i] : st[i + 1]]))]


def _head(doc: LayoutDoc) -> list[Any]:
    return [doc.job, doc.scheme, doc.tp, doc.global_batch, doc.target_batch, doc.relative_throughput,
            doc.meets_target, doc.tracks_moves]


def _pos(pos_of: PosOf, uuid: str) -> int:
    try:
        return pos_of(uuid)
    except KeyError:
        raise CodecError(f"GPU {uuid[:200]!r} has no position in the store") from None


def _deltas(values: Iterable[int]) -> list[int]:
    vals = list(values)
    return [b - a for a, b in zip([0, *vals], vals, strict=False)]


def _undeltas(values: Sequence[int]) -> list[int]:
    return list(accumulate(values))


def _positions(uuids: Sequence[str], pos_of: PosOf) -> list[int]:
    try:
        return list(map(pos_of, uuids))
    except KeyError:
        return [_pos(pos_of, u) for u in uuids]  # names the GPU that has none


def _uuids(positions: Sequence[int], uuid_at: UuidAt) -> list[str]:
    try:
        return list(map(uuid_at, positions))
    except (KeyError, IndexError):
        return [_uuid(uuid_at, p) for p in positions]  # names the position that has none


def _replicas(doc: LayoutDoc, which: Sequence[int], pos_of: PosOf) -> dict[str, Any]:
    """The columns of the replicas at indices `which` (ascending), read off `doc`'s columns."""
    st, gs = doc.group_starts, doc.gpu_starts
    groups = [g for i in which for g in range(st[i], st[i + 1])]
    domains: dict[str, int] = {}
    gdom_name = [doc.group_domains[g] for g in groups]
    gdom = [domains.setdefault(d, len(domains)) for d in gdom_name]
    ids, pr, ps = doc.group_ids, doc.prev_replicas, doc.prev_stages
    owner = [(doc.replica_ids[i], g - st[i]) for i in which for g in range(st[i], st[i + 1])]
    gpv = [True if (pr[g], ps[g]) == here else None if pr[g] is None and ps[g] is None else [pr[g], ps[g]]
           for g, here in zip(groups, owner, strict=True)]
    every = doc.gpus
    gpus = [u for g in groups for u in every[gs[g] : gs[g + 1]]]

    def col(name: str, rows: Sequence[int]) -> list[Any]:
        c = getattr(doc, name)
        return [c[k] for k in rows]

    return {"domains": list(domains),
            "r": {"id": col("replica_ids", which), "tp": col("replica_tps", which), "lb": col("local_batches", which),
                  "rt": col("replica_throughputs", which), "ng": [st[i + 1] - st[i] for i in which]},
            "g": {"dom": gdom, "id": [_local(ids[g], d) for g, d in zip(groups, gdom_name, strict=True)],
                  "tp": col("group_tps", groups), "us": col("group_usable", groups),
                  "sp": [1 if doc.group_spare[g] else 0 for g in groups], "pr": col("power_ratios", groups),
                  "pv": gpv},
            "gpus": _deltas(_positions(gpus, pos_of))}


def _local(group: str, domain: str) -> int | str:
    """A group id `domain/gN` as N; any other id as itself."""
    head, sep, n = group.rpartition("/g")
    if sep and head == domain and n.isdigit() and str(int(n)) == n:
        return int(n)
    return group


def _caps(items: Iterable[tuple[str, float]], pos_of: PosOf) -> dict[str, list[Any]]:
    items = list(items)
    pairs = sorted(zip(_positions([u for u, _ in items], pos_of), [w for _, w in items], strict=True))
    return {"pos": _deltas(p for p, _ in pairs), "w": [w for _, w in pairs]}


def _list(doc: LayoutDoc, name: str) -> list[Any]:
    return [list(x) if isinstance(x, tuple) else x for x in getattr(doc, name)]


CHUNK = 4096  # list items per line of a body


def _dumps(obj: Any) -> str:
    """The body's text: one JSON line for the document with each list longer than CHUNK replaced
    by `{"$n": k}`, then those lists' items, CHUNK per line, in the order the replacements appear.
    json's C encoder and decoder hold the GIL for a whole call, and so hold the event loop while a
    worker thread writes or reads a 100K-GPU layout; a line is a few milliseconds."""
    lines: list[str] = []
    head = _shape(obj, lines)
    return "\n".join([json.dumps(head, separators=(",", ":"), allow_nan=False), *lines])


def _shape(obj: Any, lines: list[str]) -> Any:
    if isinstance(obj, dict):
        return {k: _shape(v, lines) for k, v in obj.items()}
    if isinstance(obj, list):
        if len(obj) <= CHUNK:
            return [_shape(x, lines) for x in obj] if any(isinstance(x, list | dict) for x in obj) else obj
        chunks = [json.dumps(obj[i : i + CHUNK], separators=(",", ":"), allow_nan=False)
                  for i in range(0, len(obj), CHUNK)]
        lines.extend(chunks)
        return {"$n": len(chunks)}
    return obj


def _loads(text: bytes) -> Any:
    lines = text.split(b"\n")
    rest = iter(lines[1:])

    def fill(obj: Any) -> Any:
        if isinstance(obj, dict):
            if obj.keys() == {"$n"}:
                return [x for _ in range(int(obj["$n"])) for x in json.loads(next(rest))]
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [fill(x) for x in obj]
        return obj

    out = fill(json.loads(lines[0]))
    if next(rest, None) is not None:
        raise ValueError("lines left over after the document")
    return out


# ---- reading --------------------------------------------------------------------------------


def decode(body: bytes, uuid_at: UuidAt, base: LayoutDoc | None = None) -> LayoutDoc:
    """The layout a body holds; a delta needs its `base` (the version before it, decoded)."""
    d = _load(body)
    try:
        return _decode(d, uuid_at, base)
    except CodecError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, PlanError) as e:
        raise CodecError(f"layout body is malformed: {e!r}") from None


def decode_chain(bodies: Sequence[bytes], uuid_at: UuidAt, base: LayoutDoc | None = None) -> list[LayoutDoc]:
    """Consecutive versions: `bodies[0]` a keyframe (or a delta on `base`), each next one a
    delta on the one before (or a keyframe, which starts afresh)."""
    out: list[LayoutDoc] = []
    for body in bodies:
        base = decode(body, uuid_at, base)
        out.append(base)
    return out


def _load(body: bytes) -> dict[str, Any]:
    try:
        d = _loads(zlib.decompress(body))
    except (zlib.error, ValueError, TypeError, StopIteration) as e:
        raise CodecError(f"layout body is not a compressed JSON document: {e}") from None
    if not isinstance(d, dict) or d.get("codec") != CODEC or d.get("kind") not in ("key", "delta"):
        raise CodecError(f"layout body: unknown codec {d.get('codec') if isinstance(d, dict) else d!r}")
    return d


def _decode(d: dict[str, Any], uuid_at: UuidAt, base: LayoutDoc | None) -> LayoutDoc:
    job, scheme, tp, gb, tb, rt, meets, track = d["head"]
    changed = _replicas_of(d, uuid_at)
    if d["kind"] == "key":
        replicas = tuple(changed)
        caps = dict(sorted(_caps_of(d["caps"], uuid_at).items()))
        lists = {name: d[name] for name in LISTS}
    else:
        if base is None:
            raise CodecError("layout body is a delta and no base version was given")
        by_id = {r.id: r for r in base.replicas}
        by_id.update((r.id, r) for r in changed)
        replicas = tuple(by_id[i] for i in _undeltas(d["order"]))
        caps = dict(base.power_caps_w)
        for p in _undeltas(d["caps_off"]):
            caps.pop(_uuid(uuid_at, p), None)
        caps.update(_caps_of(d["caps"], uuid_at))
        caps = dict(sorted(caps.items()))
        lists = {name: d[name] if name in d else getattr(base, name) for name in LISTS}
    m = d["moves"]
    return LayoutDoc(
        job=str(job), scheme=str(scheme), tp=int(tp), global_batch=int(gb), target_batch=int(tb),
        relative_throughput=float(rt), meets_target=bool(meets), replicas=replicas,
        dropped=tuple(AsideDoc(*a) for a in lists["dropped"]), idle=tuple(AsideDoc(*a) for a in lists["idle"]),
        spares_used=tuple(lists["spares_used"]), power_caps_w=caps, reasons=tuple(lists["reasons"]),
        moves=None if m is None else MovesDoc(*m), tracks_moves=bool(track),
        restore_step=None if d.get("restore_step") is None else int(d["restore_step"]),
    )


def _uuid(uuid_at: UuidAt, pos: int) -> str:
    try:
        return uuid_at(pos)
    except (KeyError, IndexError):
        raise CodecError(f"layout body names GPU position {pos}, which the store does not hold") from None


def _replicas_of(d: Mapping[str, Any], uuid_at: UuidAt) -> list[ReplicaDoc]:
    domains = d["domains"]
    r_, g_ = d["r"], d["g"]
    rid, rtp, rlb, rrt, rng = r_["id"], r_["tp"], r_["lb"], r_["rt"], r_["ng"]
    gdom, gid, gtp, gus, gsp, gpr, gpv = g_["dom"], g_["id"], g_["tp"], g_["us"], g_["sp"], g_["pr"], g_["pv"]
    gpus = _uuids(_undeltas(d["gpus"]), uuid_at)
    out = []
    k = at = 0
    for i, r in enumerate(rid):
        groups = []
        for stage in range(rng[i]):
            dom, tp = domains[gdom[k]], gtp[k]
            local, pv = gid[k], gpv[k]
            prev = (r, stage) if pv is True else (None, None) if pv is None else pv
            groups.append(GroupDoc(f"{dom}/g{local}" if isinstance(local, int) else local, dom, stage, tp, gus[k],
                                   bool(gsp[k]), gpr[k], tuple(gpus[at : at + tp]), prev[0], prev[1]))
            at += tp
            k += 1
        out.append(ReplicaDoc(r, rtp[i], rlb[i], rrt[i], tuple(groups)))
    if at != len(gpus) or k != len(gdom):
        raise CodecError(f"layout body: {len(gpus)} GPUs and {len(gdom)} groups, the replicas account for {at} "
                         f"and {k}")
    return out


def _caps_of(c: Mapping[str, Sequence[Any]], uuid_at: UuidAt) -> dict[str, float]:
    return {u: float(w) for u, w in zip(_uuids(_undeltas(c["pos"]), uuid_at), c["w"], strict=True)}
