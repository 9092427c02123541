"""Slurm: drains the nodes whose GPUs need a person and resumes them once they are fine again (off
by default: `slurm_drain`; `slurm_dry_run` only logs and audits what it would do). The decisions
are service/operations/slurm_policy.py's; this module gathers the state, runs Slurm's own commands and audits.

How a pass goes (one task of its own: it never holds the planner or the event loop):
1. The nodes whose GPUs changed since the last pass (a commit hook collects them; all nodes after a
   start) and the nodes with a degraded GPU are judged again (`node_causes`, in a worker thread).
2. `sinfo -h -N -t drain -o "%N|%T|%E"` lists the drained and draining nodes with their reasons.
3. `decide` says what to drain and what to resume; each drain first writes its audit record (the
   record's id goes into the reason as a link: `audit <url>/v1/audit/<id>`), then runs
   `scontrol update NodeName=N State=DRAIN Reason=...`; a resume re-reads the node and runs
   `scontrol update NodeName=N State=RESUME` only if the reason is still ntp-manager's. The
   record's `after.result` says how it went (pending, drained or resumed, refused, failed).

What survives a restart (or a new leader) is read back from the audit log when the component
starts (`restore`): the nodes ntp-manager drained and has not resumed since, with the causes it
drained them for -- so a node someone resumed while those causes hold is not drained over that
decision -- and the drains within the rate cap's window. A node whose causes are gone is
forgotten (a later failure of the same GPU drains it again), and a resume re-judges the node's
GPUs just before it runs (a GPU may have failed since the pass decided).

Every command runs as a subprocess on the event loop's watcher (asyncio), bounded by
`slurm_timeout_s` (killed past it), and is retried with exponential backoff and jitter (tenacity)
up to `slurm_retries` times; each failure is logged with the command's output. A failure that
retrying cannot fix (Slurm does not know the node name) is refused at once: logged, audited
(`slurm.refused`) and not tried again until the node's causes change. A pass that fails leaves
everything for the next one (`slurm_poll_s` later, or sooner when GPUs change).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import os
import shutil
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy import select
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.operations.slurm_policy import (
    SINFO_FORMAT,
    Action,
    ActionKind,
    Cause,
    Decision,
    GpuFacts,
    SlurmNode,
    SlurmOptions,
    causes_key,
    decide,
    drain_reason,
    node_causes,
    owned,
    parse_sinfo,
)
from ntp_manager.settings import Settings
from ntp_manager.store.models import AuditRow

log = structlog.get_logger("ntp.slurm")

RESTORE_ROWS = 10_000  # newest slurm.drain / slurm.resume audit records read back at start
OUTPUT_LOGGED = 2000  # characters of a command's output kept in a log line or an error
ACTOR = "slurm-sync"
# what scontrol says when a node name is not in slurm.conf: retrying cannot help
UNKNOWN_NODE = "Invalid node name specified"


class SlurmError(Exception):
    """A Slurm command failed, timed out or is missing; `permanent`: retrying cannot help."""

    def __init__(self, message: str, output: str = "", permanent: bool = False) -> None:
        super().__init__(message)
        self.output = output
        self.permanent = permanent


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= OUTPUT_LOGGED else text[:OUTPUT_LOGGED] + "..."


class SlurmCommands:
    """Slurm's commands as coroutines, bounded in time and retried (see the module docstring).
    `bin_dir`: where scontrol and sinfo are (None: PATH); `conf`: SLURM_CONF for them."""

    def __init__(self, bin_dir: Path | None, conf: Path | None, timeout_s: float, retries: int, backoff_s: float,
                 sleep: Callable[[float], Any] = asyncio.sleep) -> None:
        self.bin_dir, self.conf = bin_dir, conf
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.sleep = sleep
        self.attempts = 0  # commands started (tests and status)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.conf is not None:
            env["SLURM_CONF"] = str(self.conf)
        return env

    async def run_once(self, args: Sequence[str]) -> str:
        """Run one Slurm command; its standard output. Raises SlurmError (not found, timed out,
        non-zero exit with its output)."""
        exe = str(self.bin_dir / args[0]) if self.bin_dir is not None else args[0]
        cmd = " ".join(args)
        self.attempts += 1
        try:
            proc = await asyncio.create_subprocess_exec(exe, *args[1:], stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE, env=self._env())
        except OSError as e:  # no such file, not executable
            raise SlurmError(f"cannot run {exe}: {e.strerror or e} (slurm_bin_dir, PATH)") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(TimeoutError):  # a process stuck in the kernel is not waited for
                await asyncio.wait_for(proc.wait(), 5.0)
            raise SlurmError(f"`{cmd}` did not finish within {self.timeout_s:g}s (killed)") from None
        text, errors = out.decode(errors="replace"), err.decode(errors="replace")
        if proc.returncode != 0:
            both = _short("\n".join(x for x in (errors, text) if x.strip()))
            raise SlurmError(f"`{cmd}` exited with status {proc.returncode}: {both}", both,
                             permanent=UNKNOWN_NODE in both)
        return text

    async def run(self, args: Sequence[str]) -> str:
        """`run_once`, retried with exponential backoff and jitter on failures retrying may fix;
        each failure is logged with its output. Raises the last SlurmError."""
        def logged(state: RetryCallState) -> None:
            e = state.outcome.exception() if state.outcome is not None else None
            log.warning("slurm command failed; retrying", command=" ".join(args), attempt=state.attempt_number,
                        error=str(e), next_in_s=round(state.upcoming_sleep, 2))

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential_jitter(multiplier=self.backoff_s, max=max(self.backoff_s, 30.0),
                                         jitter=self.backoff_s),
            retry=retry_if_exception(lambda e: isinstance(e, SlurmError) and not e.permanent),
            before_sleep=logged, sleep=self.sleep, reraise=True)
        out = ""
        async for attempt in retrying:
            with attempt:
                out = await self.run_once(args)
        return out

    async def drained(self) -> dict[str, SlurmNode]:
        """The drained and draining nodes with their reasons."""
        text = await self.run(["sinfo", "-h", "-N", "-t", "drain", "-o", SINFO_FORMAT])
        try:
            return parse_sinfo(text)
        except ValueError as e:
            raise SlurmError(str(e)) from None

    async def node(self, name: str) -> SlurmNode | None:
        """One node as sinfo shows it now, if drained or draining (None: it is not)."""
        text = await self.run(["sinfo", "-h", "-N", "-t", "drain", "-n", name, "-o", SINFO_FORMAT])
        try:
            return parse_sinfo(text).get(name)
        except ValueError as e:
            raise SlurmError(str(e)) from None

    async def drain(self, node: str, reason: str) -> None:
        await self.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    async def resume(self, node: str) -> None:
        await self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])


def _wall(t: datetime | None) -> float | None:
    return None if t is None else t.timestamp()


class SlurmSync:
    """The component (see the module docstring). `breaker_open` says whether the manager's circuit
    breaker is open; `audit_base` is the manager's REST address for the links in reasons ("" when
    unknown: the link is then the path alone)."""

    def __init__(self, kernel: Kernel, settings: Settings, breaker_open: Callable[[], bool],
                 audit_base: Callable[[], str], commands: SlurmCommands | None = None) -> None:
        self.kernel = kernel
        self.enabled = settings.slurm_drain
        self.dry_run = settings.slurm_dry_run
        self.poll_s = settings.slurm_poll_s
        self.degraded_after_s = settings.slurm_degraded_after_s
        self.options = SlurmOptions(settings.slurm_max_drains, settings.breaker_window_s)
        self.breaker_open = breaker_open
        self.audit_base = audit_base
        self.commands = commands or SlurmCommands(settings.slurm_bin_dir, settings.slurm_conf,
                                                  settings.slurm_timeout_s, settings.slurm_retries,
                                                  settings.slurm_backoff_s)
        self.wanted: dict[str, tuple[Cause, ...]] = {}  # node -> why it should be drained
        self.ours: dict[str, frozenset[str]] = {}  # nodes drained in this run -> their causes then
        self.refused: dict[str, frozenset[str]] = {}  # nodes Slurm does not know -> their causes then
        self.recent: list[float] = []  # monotonic times of drains made
        self.dry_seen: dict[str, tuple[str, frozenset[str]]] = {}  # dry run: what was reported per node
        self._watch: set[str] = set()  # nodes to judge again
        self._timed: set[str] = set()  # nodes with a degraded GPU: judged again every pass
        self._wake = asyncio.Event()
        self.passes = 0
        self.last_pass: datetime | None = None
        self.last_error: str | None = None
        self.last: Decision | None = None
        self.drained_now: dict[str, SlurmNode] = {}
        if self.enabled:
            if commands is None:
                self._find_commands(settings.slurm_bin_dir)
            kernel.after_commit.append(self.note)

    @staticmethod
    def _find_commands(bin_dir: Path | None) -> None:
        """Refuse at set-up, naming what is missing, when Slurm's commands cannot be found (rather
        than fail every pass): OSError, which the CLI prints as one line."""
        path = str(bin_dir) if bin_dir is not None else None
        missing = [c for c in ("scontrol", "sinfo") if shutil.which(c, path=path) is None]
        if missing:
            where = f"in slurm_bin_dir {bin_dir}" if bin_dir is not None else "on the PATH"
            raise OSError(f"slurm_drain is on but {' and '.join(missing)} cannot be found {where} "
                          "(install Slurm's client commands, or set slurm_bin_dir)")

    # ---- what changed --------------------------------------------------------------------------
    def note(self, tx: Tx) -> None:
        """After a commit: the nodes of the GPUs it changed are judged again at the next pass."""
        written = tx.gpus_written
        if not written:
            return
        gpus = self.kernel.world.gpus
        for u in written:
            rec = gpus.get(u)
            if rec is not None:
                self._watch.add(rec.node)
        self._wake.set()

    def watch_all(self) -> None:
        self._watch.update(self.kernel.world.nodes)
        self._wake.set()

    def _facts(self, node: str) -> list[GpuFacts]:
        w = self.kernel.world
        rec = w.nodes.get(node)
        if rec is None:
            return []
        out = []
        for u in list(rec.gpus):
            g = w.gpus.get(u)
            if g is not None:
                out.append(GpuFacts(g.uuid, g.idx, GpuState(g.health), g.health_source, g.health_reason,
                                    _wall(g.health_since), GpuState(g.admin) if g.admin else None, g.admin_reason))
        return out

    def _judge(self, nodes: list[str], now: float) -> dict[str, tuple[tuple[Cause, ...], bool]]:
        """Each node's causes, and whether it has a degraded GPU (judged again every pass). Runs in
        a worker thread: it reads the records, it changes nothing."""
        out = {}
        for n in nodes:
            facts = self._facts(n)
            out[n] = (node_causes(now, facts, self.degraded_after_s),
                      self.degraded_after_s > 0 and any(f.health == GpuState.DEGRADED for f in facts))
        return out

    async def restore(self) -> None:
        """Read back from the audit log what a restart would lose (module docstring): per node the
        newest `slurm.drain` (result drained) or `slurm.resume` (result resumed) record -- a drain
        puts the node in `ours` with the causes it was drained for -- and the drains made within
        the rate cap's window."""
        q = (select(AuditRow.at, AuditRow.action, AuditRow.target, AuditRow.after)
             .where(AuditRow.action.in_(("slurm.drain", "slurm.resume")))
             .order_by(AuditRow.id.desc()).limit(RESTORE_ROWS))
        async with self.kernel.sm() as session:
            rows = (await session.execute(q)).all()
        now, mono = self.kernel.clock.now(), self.kernel.clock.monotonic()
        seen: set[str] = set()
        for at, action, node, after in rows:
            result = after.get("result") if isinstance(after, dict) else None
            if action == "slurm.drain" and result == "drained":
                age = (now - at).total_seconds()
                if age < self.options.window_s:
                    self.recent.append(mono - max(0.0, age))
            if node in seen or result not in ("drained", "resumed"):
                continue
            seen.add(node)
            if action == "slurm.drain" and node not in self.ours:
                gpus = after.get("gpus") if isinstance(after, dict) else None
                self.ours[node] = frozenset(f"{g.get('gpu')}:{g.get('kind')}" for g in gpus or ()
                                            if isinstance(g, dict))
        self.recent.sort()
        if self.ours or self.recent:
            log.info("slurm drains read back from the audit log", drained_by_ntp_manager=sorted(self.ours),
                     drains_in_window=len(self.recent))

    # ---- the loop ------------------------------------------------------------------------------
    async def run_forever(self, stopping: Callable[[], bool]) -> None:
        """Passes until `stopping()`: woken by GPU changes, else every `slurm_poll_s`."""
        try:
            await self.restore()
        except Exception as e:  # the passes still run; what was lost is logged
            self.last_error = f"cannot read back the Slurm drains from the audit log: {type(e).__name__}: {e}"
            log.exception("slurm restore failed")
        self.watch_all()
        while not stopping():
            try:
                await self.sync_once()
            except Exception as e:  # never let one bad pass end the component
                self.last_error = f"{type(e).__name__}: {e}"
                log.exception("slurm pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            # let a burst of changes gather into one pass; Slurm is asked at most about once a second
            await asyncio.sleep(min(1.0, self.poll_s))

    async def sync_once(self) -> Decision | None:
        """One pass (see the module docstring); the decision, or None when Slurm could not be read."""
        self._wake.clear()
        nodes = sorted(self._watch | self._timed)
        self._watch.clear()
        judged = await asyncio.to_thread(self._judge, nodes, self.kernel.clock.now().timestamp())
        for n, (causes, timed) in judged.items():
            if causes:
                self.wanted[n] = causes
            else:
                self.wanted.pop(n, None)
            if timed:
                self._timed.add(n)
            else:
                self._timed.discard(n)
        for n in [n for n in self.ours if n not in self.wanted]:
            # its causes are gone (or it is gone): a later failure is a new decision, not one a
            # person already took by resuming the node
            del self.ours[n]
        self.passes += 1
        self.last_pass = self.kernel.clock.now()
        try:
            drained = await self.commands.drained()
        except SlurmError as e:
            self.last_error = str(e)
            log.error("cannot read Slurm's drained nodes", error=str(e))
            return None
        self.drained_now = drained
        mono = self.kernel.clock.monotonic()
        self.recent = [t for t in self.recent if mono - t < self.options.window_s]
        d = decide(mono, self.wanted, drained, self.kernel.world.nodes, self.recent, self.ours, self.refused,
                   self.breaker_open(), self.options)
        self.last = d
        self.last_error = None
        for node, why in d.held:
            log.debug("slurm node held", node=node, why=why)
        for a in d.actions:
            if self.dry_run:
                await self._dry(a)
            elif a.kind is ActionKind.DRAIN:
                await self._drain(a)
            else:
                await self._resume(a)
        return d

    # ---- actions -------------------------------------------------------------------------------
    def _link(self, audit_id: int) -> str:
        base = self.audit_base().rstrip("/")
        return f"{base}/v1/audit/{audit_id}"

    async def _audit(self, action: str, node: str, after: dict[str, Any], reason: str) -> int:
        """An audit record of its own transaction; its id."""
        async with self.kernel.exclusive(ACTOR) as tx:
            row = AuditRow(at=tx.now, actor=ACTOR, action=action, target=node, before=None, after=after,
                           reason=reason, request_id="")
            tx.session.add(row)
            await tx.session.flush()
            return int(row.id)

    async def _set_after(self, audit_id: int, after: dict[str, Any]) -> None:
        async with self.kernel.exclusive(ACTOR) as tx:
            row = await tx.session.get(AuditRow, audit_id)
            if row is not None:
                row.after = after

    async def _drain(self, a: Action) -> None:
        gpus = [{"gpu": c.gpu, "index": c.idx, "kind": str(c.kind), "detail": c.detail} for c in a.causes]
        after: dict[str, Any] = {"slurm_node": a.node, "gpus": gpus}
        audit_id = await self._audit("slurm.drain", a.node, {**after, "result": "pending"}, a.why)
        reason = drain_reason(a.causes, self._link(audit_id))
        after["slurm_reason"] = reason
        await self._set_after(audit_id, {**after, "result": "pending"})
        try:
            await self.commands.drain(a.node, reason)
        except SlurmError as e:
            await self._set_after(audit_id, {**after, "result": "refused" if e.permanent else "failed"})
            await self._failed("slurm.refused" if e.permanent else "slurm.drain_failed", a.node, e)
            if e.permanent:
                self.refused[a.node] = causes_key(a.causes)
            return
        await self._set_after(audit_id, {**after, "result": "drained"})
        self.ours[a.node] = causes_key(a.causes)
        self.drained_now[a.node] = SlurmNode(a.node, "drain", reason)  # until the next pass reads it
        self.refused.pop(a.node, None)
        self.recent.append(self.kernel.clock.monotonic())
        log.warning("slurm node drained", node=a.node, reason=reason)

    async def _resume(self, a: Action) -> None:
        # judge the node again: a GPU may have failed since the pass decided (its sinfo call, the
        # actions before this one and their audit writes all take time)
        causes = node_causes(self.kernel.clock.now().timestamp(), self._facts(a.node), self.degraded_after_s)
        if causes:
            self.wanted[a.node] = causes
            self._watch.add(a.node)
            log.info("slurm node not resumed: a GPU needs a person again", node=a.node,
                     causes=[c.text() for c in causes])
            return
        try:  # read it again just before: someone may have drained it over ntp-manager's reason
            now = await self.commands.node(a.node)
        except SlurmError as e:
            self.last_error = str(e)
            log.error("cannot read the node before resuming it", node=a.node, error=str(e))
            return
        if now is None or not owned(now.reason):
            log.info("slurm node not resumed: no longer ntp-manager's drain", node=a.node,
                     reason=now.reason if now else None)
            return
        after = {"slurm_node": a.node, "slurm_reason": now.reason}
        audit_id = await self._audit("slurm.resume", a.node, {**after, "result": "pending"}, a.why)
        try:
            await self.commands.resume(a.node)
        except SlurmError as e:
            await self._set_after(audit_id, {**after, "result": "failed"})
            await self._failed("slurm.resume_failed", a.node, e)
            return
        await self._set_after(audit_id, {**after, "result": "resumed"})
        self.ours.pop(a.node, None)
        self.drained_now.pop(a.node, None)
        log.warning("slurm node resumed", node=a.node, was=now.reason)

    async def _failed(self, action: str, node: str, e: SlurmError) -> None:
        self.last_error = str(e)
        log.error("slurm command failed", action=action, node=node, error=str(e))
        await self._audit(action, node, {"slurm_node": node, "output": e.output[:OUTPUT_LOGGED]}, str(e)[:1000])

    async def _dry(self, a: Action) -> None:
        """Dry run: log and audit what would be done, once per node and set of causes."""
        key = (str(a.kind), causes_key(a.causes))
        if self.dry_seen.get(a.node) == key:
            return
        self.dry_seen[a.node] = key
        action = "slurm.would_drain" if a.kind is ActionKind.DRAIN else "slurm.would_resume"
        audit_id = await self._audit(action, a.node, {"slurm_node": a.node, "dry_run": True}, a.why)
        if a.kind is ActionKind.DRAIN:
            reason = drain_reason(a.causes, self._link(audit_id))
            log.warning("dry run: would drain the slurm node", node=a.node, reason=reason)
        else:
            log.warning("dry run: would resume the slurm node", node=a.node, why=a.why)

    # ---- the view ------------------------------------------------------------------------------
    def status(self, limit: int) -> dict[str, Any]:
        """The view of GET /v1/slurm: each list holds at most `limit` entries, in node-name order;
        `counts` says how many there are in all (a rack event can want hundreds of nodes drained)."""
        d = self.last
        wanted = heapq.nsmallest(limit, self.wanted.items(), key=lambda kv: kv[0])
        ours = heapq.nsmallest(limit, (s for s in self.drained_now.values() if owned(s.reason)), key=lambda s: s.name)
        held = d.held if d else ()
        return {
            "enabled": self.enabled, "dry_run": self.dry_run, "passes": self.passes,
            "last_pass": self.last_pass.isoformat() if self.last_pass else None, "last_error": self.last_error,
            "wanted": {n: [c.text() for c in cs] for n, cs in wanted},
            "drained_by_ntp_manager": [{"node": s.name, "state": s.state, "reason": s.reason} for s in ours],
            "held": [{"node": n, "why": why} for n, why in heapq.nsmallest(limit, held)],
            "refused": heapq.nsmallest(limit, self.refused),
            "counts": {"wanted": len(self.wanted), "held": len(held), "refused": len(self.refused),
                       "drained_by_ntp_manager": sum(1 for s in self.drained_now.values() if owned(s.reason))},
            "limit": limit, "drains_in_window": len(self.recent),
            "max_drains": self.options.max_drains, "window_s": self.options.window_s,
        }
