"""The operator dashboard: one HTML page (no build step, no external assets) fed by server-sent
events. `/v1/stream` sends a `snapshot` event whenever the state it shows changes (checked twice a
second), so the page updates without reloading. The page asks for a token once (or takes `?token=`
once and removes it from the address bar) and keeps it in the browser's session storage. Browsers
cannot set headers on an EventSource, so the page trades the token for a one-time ticket
(`POST /v1/stream/tickets`, api/tickets.py) and opens the stream with that: no token in any URL.
A stream ends when its token is revoked.

Sizes: the snapshot lists at most `MAX_DOMAINS` domains and `MAX_REPLICAS` replicas per job in
full (a dashboard of 100K GPUs is a different page: use the REST listings with paging there)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import weakref
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from starlette.requests import Request

from ntp_manager.planner.layout import GroupDoc, LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.manager import Manager

MAX_DOMAINS = 64
MAX_REPLICAS = 256  # per job, in full (the rest are counted: `replicas_total`)
MAX_SLOW_RANKS = 32  # per job, fail-slow rows: flagged GPUs first, then the highest factors
POLL_S = 0.5


def _job_part(name: str, rec: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """A job's entry (its first MAX_REPLICAS replicas in full) and its boosted GPUs' power ratios.
    O(the job's GPUs): built once per layout version, in a worker thread (layouts never change)."""
    lay = rec.layout
    if lay is None:
        return ({"name": name, "version": None, "reason": "", "tp": None, "pending_reason": rec.pending_reason,
                 "replicas": [], "replicas_total": 0, "global_batch": None, "moves": None}, {})
    doc: LayoutDoc = lay.doc
    reps = []
    for r in doc.replicas[:MAX_REPLICAS]:
        groups = [{"domain": g.domain, "gpus": list(g.gpus), "power_ratio": g.power_ratio, "group": g.group,
                   "stage": g.stage, "tp": g.tp, "moved_from": _moved_from(doc, r.id, g)} for g in r.groups]
        reps.append({"id": r.id, "tp": r.tp, "local_batch": r.local_batch, "groups": groups})
    return ({"name": name, "version": lay.version, "reason": lay.reason,
             "tp": doc.tp,  # the healthy degree: a smaller stage is drawn reduced
             "pending_reason": rec.pending_reason, "replicas": reps, "replicas_total": len(doc.replica_ids),
             "global_batch": doc.global_batch, "moves": None if doc.moves is None else doc.moves._asdict()},
            dict(doc.boosted()))


def _moved_from(doc: LayoutDoc, replica: int, g: GroupDoc) -> str | None:
    """Where a group was before this layout ("r3/s1", "new"), or None when it stayed put (or the
    layout records no previous places)."""
    if not doc.tracks_moves or (g.prev_replica, g.prev_stage) == (replica, g.stage):
        return None
    return "new" if g.prev_replica is None else f"r{g.prev_replica}/s{g.prev_stage}"


_parts: weakref.WeakKeyDictionary[Manager, dict[str, tuple[Any, tuple[dict[str, Any], dict[str, float]]]]] = (
    weakref.WeakKeyDictionary()
)


async def _job_parts(manager: Manager) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    jobs, boosts = [], []
    cache = _parts.setdefault(manager, {})
    for name, rec in sorted(manager.world.jobs.items()):
        key = name
        lay = rec.layout
        stamp = ((lay.leader_epoch, lay.version) if lay else None, rec.pending_reason, lay.reason if lay else "")
        cached = cache.get(key)
        if cached is None or cached[0] != stamp:
            part = await offloop.run(_job_part, name, rec) if rec.layout else _job_part(name, rec)
            for gone in set(cache) - set(manager.world.jobs):
                del cache[gone]
            cached = cache[key] = (stamp, part)
        restored = manager.restores.newest(name)  # issue 22: "restored from step S"
        jobs.append({**cached[1][0], "restored": None if restored is None else {
            k: restored[k] for k in ("step", "checkpoint", "version", "at", "reason")}})
        boosts.append(cached[1][1])  # looked up for the GPUs shown only: a job may boost 100K GPUs
    return jobs, boosts


def _domains(nodes: list[Any], gpus: Any, boosts: list[dict[str, float]],
             owners: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """The first MAX_DOMAINS domains with their GPUs and the job owning each (None: the free pool),
    and how many domains there are. O(nodes + the GPUs shown): run it in a worker thread (`nodes`
    is a copy; `gpus` is only read)."""
    owners = owners or {}
    nodes_of: dict[str, list[Any]] = {}
    for n in nodes:  # nodes, not GPUs: a tenth of the work
        nodes_of.setdefault(n.domain, []).append(n)
    domains = []
    for did in sorted(nodes_of)[:MAX_DOMAINS]:
        gs = sorted((gpus[u] for n in nodes_of[did] for u in n.gpus), key=lambda g: (g.node, g.idx))
        domains.append({"id": did, "job": owners.get(did), "gpus": [
            {"uuid": g.uuid, "node": g.node, "idx": g.idx, "state": g.state, "reason": g.health_reason,
             "power_ratio": next((b[g.uuid] for b in boosts if g.uuid in b), None),
             "desired_w": (g.desired_mw or 0) // 1000, "enforced_w": (g.enforced_mw or 0) // 1000,
             "tdp_w": g.tdp_mw // 1000} for g in gs]})
    return domains, len(nodes_of)


async def dashboard_snapshot(manager: Manager) -> dict[str, Any]:
    """What the dashboard shows. Per-job parts are cached per layout version and the domains are
    drawn in a worker thread, so its cost on the event loop is a copy of the node list; state
    counts come from the gauges."""
    w = manager.world
    jobs, boosts = await _job_parts(manager)
    # fail-slow (issue 21): changes every step, so not cached with the layout part
    jobs = [{**j, "slow": manager.failslow_dashboard(j["name"], MAX_SLOW_RANKS)} for j in jobs]
    domains, domains_total = await offloop.run(_domains, list(w.nodes.values()), w.gpus, boosts, w.owners())
    events = [{"at": e["at"], "gpu": e["gpu"], "node": e["node"], "old": e["old_state"], "new": e["new_state"],
               "source": e["source"], "reasons": list(e["reasons"] or [])[:2]}
              for e in await manager.queries.recent_events(15)]
    return {"epoch": manager.epoch, "gpus_by_state": await manager.gpu_state_counts(), "domains": domains,
            "domains_total": domains_total, "jobs": jobs, "events": events,
            "breaker": {"open": manager.breaker_open, "reason": manager.breaker_reason}}


async def snapshot_events(manager: Manager, request: Request, token_id: str) -> AsyncIterator[bytes]:
    last = ""
    revoked = asyncio.Event()
    unwatch = manager.token_service.watch(token_id, revoked.set)
    try:
        yield b"retry: 2000\n\n"
        while not await request.is_disconnected() and not revoked.is_set():
            snap = await dashboard_snapshot(manager)
            body, digest = await asyncio.to_thread(_encoded, snap)
            if digest != last:
                last = digest
                yield f"event: snapshot\ndata: {body}\n\n".encode()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(revoked.wait(), POLL_S)
        if revoked.is_set():
            yield b"event: revoked\ndata: {}\n\n"
    finally:
        unwatch()


def _encoded(snap: dict[str, Any]) -> tuple[str, str]:
    """A snapshot's JSON and its digest (in a worker thread: it is O(the GPUs shown))."""
    body = json.dumps(snap, separators=(",", ":"))
    return body, hashlib.sha256(body.encode()).hexdigest()


DASHBOARD_HTML = (resources.files("ntp_manager.api") / "static" / "dashboard.html").read_text(encoding="utf-8")
