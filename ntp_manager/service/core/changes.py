"""A transaction's changes to the world as one plain value, and that value applied to a world.

The leader writes `encode(tx)` into the world log (store/worldlog.py) inside each transaction that
changes the world; every other manager applies the rows in order to its own copy
(service/leadership/follow.py). A row carries whole records, not deltas: the domains added, every
node and GPU the transaction added or changed with all their stored fields, and the names of the
jobs whose row, layout or holdings it wrote (a job is read back from the store: its layout body is
stored there already and can be large). Applying a row therefore only overwrites; rows applied in
order leave each record as the last one wrote it, whatever state the copy started from, as long as
it started from a load made after the row before the first one applied (follow.py's bootstrap).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from operator import attrgetter
from typing import Any

import orjson

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.state import GpuRec, HealthSource, NodeRec, World

VERSION = 1  # the body's layout; a follower refuses (quarantines) a body of another one

GPU_FIELDS = ("uuid", "node", "domain", "idx", "tdp_mw", "min_mw", "max_mw", "health", "health_reason",
              "health_source", "health_since", "admin", "admin_owner", "admin_reason", "desired_mw", "enforced_mw",
              "model", "memory_bytes", "pos", "speed")
NODE_FIELDS = ("name", "domain", "last_seq", "boot_id", "drain_deadline", "drain_reason", "agent_version")
SHAPE = ("node", "domain", "idx", "tdp_mw", "min_mw", "max_mw")  # the planner's snapshot is rebuilt

_STATES = {s.value: s for s in GpuState}
_SOURCES = {s.value: s for s in HealthSource}


_GPU_VALUES = attrgetter(*GPU_FIELDS)
_SHAPE_OF = attrgetter(*SHAPE)
_NODE_VALUES = attrgetter(*NODE_FIELDS)
# the fields that are not JSON values as they are: their positions in the rows
_HEALTH, _SOURCE, _SINCE, _ADMIN = (GPU_FIELDS.index(f) for f in ("health", "health_source", "health_since", "admin"))
_DEADLINE = NODE_FIELDS.index("drain_deadline")


def _gpu_row(g: GpuRec) -> list[Any]:
    row = list(_GPU_VALUES(g))
    row[_HEALTH] = g.health.value
    row[_SOURCE] = g.health_source.value
    if g.health_since is not None:
        row[_SINCE] = g.health_since.isoformat()
    if g.admin is not None:
        row[_ADMIN] = g.admin.value
    return row


def _node_row(n: NodeRec) -> list[Any]:
    row = list(_NODE_VALUES(n))
    if n.drain_deadline is not None:
        row[_DEADLINE] = n.drain_deadline.isoformat()
    return row


def encode(domains: list[str], nodes: list[NodeRec], gpus: list[GpuRec], jobs: list[str]) -> str | None:
    """The JSON text of one world-log row, or None when the transaction changes nothing of the world.
    (On the leader's path of every transaction: one attrgetter per record, the few fields that are
    not plain JSON values converted by position.)"""
    if not (domains or nodes or gpus or jobs):
        return None
    body: dict[str, Any] = {"v": VERSION}
    if domains:
        body["domains"] = domains
    if nodes:
        body["nodes"] = [_node_row(n) for n in nodes]
    if gpus:
        body["gpus"] = [_gpu_row(g) for g in gpus]
    if jobs:
        body["jobs"] = jobs
    # orjson: several times faster than json.dumps, and this runs in every transaction of the leader.
    # It would write a non-finite speed as null where json.dumps writes NaN (which PostgreSQL's json
    # refuses: the transaction fails, loudly), so those are refused here first; what orjson cannot
    # write at all (an integer beyond 64 bits) the standard library writes.
    bad = next((g for g in gpus if g.speed is not None and not math.isfinite(g.speed)), None)
    if bad is not None:
        raise ValueError(f"GPU {bad.uuid}: speed {bad.speed} is not a finite number")
    try:
        return orjson.dumps(body).decode()
    except orjson.JSONEncodeError:
        return json.dumps(body, separators=(",", ":"))


class BadRow(ValueError):
    """A world-log body this manager cannot apply (the follower quarantines it, with this reason)."""


@dataclass
class Applied:
    """What applying rows changed: GPUs whose state the planner sees changed, whether the shape did
    (GPUs added, moved, limits changed), and the jobs to read back."""

    states: set[str] = field(default_factory=set)
    shape: bool = False
    jobs: set[str] = field(default_factory=set)


def _gpu(values: list[Any]) -> GpuRec:
    if len(values) != len(GPU_FIELDS):
        raise ValueError(f"a GPU record has {len(values)} fields, not {len(GPU_FIELDS)}")
    v = list(values)
    v[_HEALTH] = _STATES[v[_HEALTH]]
    v[_SOURCE] = _SOURCES[v[_SOURCE]]
    if v[_ADMIN] is not None:
        v[_ADMIN] = _STATES[v[_ADMIN]]
    if v[_SINCE] is not None:
        v[_SINCE] = datetime.fromisoformat(v[_SINCE])
    return GpuRec(*v)  # GPU_FIELDS is GpuRec's field order (tests/unit/test_changes.py)


def _node(values: list[Any], now_mono: float) -> NodeRec:
    if len(values) != len(NODE_FIELDS):
        raise ValueError(f"a node record has {len(values)} fields, not {len(NODE_FIELDS)}")
    name, domain, last_seq, boot_id, deadline, reason, version = values  # NODE_FIELDS' order
    return NodeRec(name, domain, [], last_seq, boot_id, now_mono, False,
                   None if deadline is None else datetime.fromisoformat(deadline), reason, version)


def _overwrite_gpu(rec: GpuRec, g: GpuRec) -> None:
    """Every field of `g` but its uuid into `rec` (GPU_FIELDS[1:]; spelled out: a follower does
    this for every GPU of every row, tests/unit/test_changes.py checks that none is missed)."""
    rec.node, rec.domain, rec.idx, rec.tdp_mw, rec.min_mw, rec.max_mw = g.node, g.domain, g.idx, g.tdp_mw, g.min_mw, \
        g.max_mw
    rec.health, rec.health_reason, rec.health_source, rec.health_since = g.health, g.health_reason, \
        g.health_source, g.health_since
    rec.admin, rec.admin_owner, rec.admin_reason = g.admin, g.admin_owner, g.admin_reason
    rec.desired_mw, rec.enforced_mw, rec.model, rec.memory_bytes = g.desired_mw, g.enforced_mw, g.model, g.memory_bytes
    rec.pos, rec.speed = g.pos, g.speed


def _overwrite_node(held: NodeRec, n: NodeRec) -> None:
    """Every stored field of `n` but its name into `held` (NODE_FIELDS[1:])."""
    held.domain, held.last_seq, held.boot_id, held.agent_version = n.domain, n.last_seq, n.boot_id, n.agent_version
    held.drain_deadline, held.drain_reason = n.drain_deadline, n.drain_reason


Checked = tuple[list[str], list[NodeRec], list[GpuRec], list[str]]  # domains, nodes, GPUs, jobs


def check(body: dict[str, Any]) -> Checked:
    """Decode a body completely before anything is applied (BadRow naming what is wrong). Pure: a
    follower runs it off the event loop (a row of a hello burst carries thousands of GPUs)."""
    if body.get("v") != VERSION:
        raise BadRow(f"world-log body version {body.get('v')!r}; this manager reads {VERSION}")
    try:
        domains = [str(d) for d in body.get("domains", ())]
        nodes = [_node(n, 0.0) for n in body.get("nodes", ())]
        gpus = [_gpu(g) for g in body.get("gpus", ())]
        jobs = [str(j) for j in body.get("jobs", ())]
    except (KeyError, TypeError, ValueError) as e:
        raise BadRow(f"world-log body cannot be read: {type(e).__name__}: {str(e)[:200]}") from None
    return domains, nodes, gpus, jobs


def apply_body(w: World, body: dict[str, Any], now_mono: float, out: Applied) -> None:
    """Apply one row to `w` (BadRow, with `w` untouched, when it cannot be)."""
    apply_checked(w, check(body), now_mono, out)


def apply_checked(w: World, checked: Checked, now_mono: float, out: Applied) -> None:
    """Apply one decoded row to `w` (BadRow, with `w` untouched, when it cannot be: a GPU of a node
    that neither `w` nor the row knows, for one)."""
    domains, nodes, gpus, jobs = checked
    known = {n.name for n in nodes}
    for g in gpus:
        if g.node not in w.nodes and g.node not in known:
            raise BadRow(f"world-log body names GPU {g.uuid!r} of unknown node {g.node!r}")
    for d in domains:
        w.domains.setdefault(d, None)
    for n in nodes:
        held = w.nodes.get(n.name)
        if held is None:
            n.last_seen = now_mono
            w.nodes[n.name] = n
            w.domains.setdefault(n.domain, None)
        else:
            _overwrite_node(held, n)
    for g in gpus:
        rec = w.gpus.get(g.uuid)
        if rec is None:
            w.gpus[g.uuid] = g
            w.by_pos[g.pos] = g.uuid
            w.next_pos = max(w.next_pos, g.pos + 1)
            w.nodes[g.node].gpus.append(g.uuid)
            out.shape = True
            continue
        if _SHAPE_OF(rec) != _SHAPE_OF(g):
            out.shape = True
            if rec.node != g.node:
                w.nodes[rec.node].gpus.remove(g.uuid)
                w.nodes[g.node].gpus.append(g.uuid)
        if rec.state != g.state or rec.planned_speed != g.planned_speed:
            out.states.add(g.uuid)
        _overwrite_gpu(rec, g)
    out.jobs.update(jobs)
