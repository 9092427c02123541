"""Layout watches on every manager (`LayoutFeed`): `WorkerService.WatchLayout` is served from the
layouts table, not from a world a manager would have to lead to hold.

The leader sends `NOTIFY ntp_layouts` (payload `epoch:version:job`) in the transaction that writes
a layout version; every manager LISTENs (service/leadership/shared.py's listener connection) and
reads the new version of the jobs it has watchers for, decodes it once (in a worker thread) and
wakes those watchers. It also polls the newest version of those jobs every `fleet_poll_s`, so a
notification lost (a listener reconnecting) delays a layout by one poll. The leader offers what
it publishes straight from its world (no read back), and the jobs it deleted. A leader change moves
nothing here: the watches stay on the manager that holds them and get the new leader's first
layout like any other. One manager alone (SQLite) serves its watches the same way: the layouts it
offers, the layouts table read on a miss; it has no notifications to listen for and no poll
(service/leadership/shared.py runs `run` only when several managers share PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ntp_manager.clock import Clock
from ntp_manager.service.core import offloop
from ntp_manager.service.core.errors import NotFound, Unavailable
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.settings import Settings
from ntp_manager.store import layout_codec
from ntp_manager.store.layouts import chain_length, decode_rows, newest_rows
from ntp_manager.store.models import GpuRow, JobRow, LayoutRow

log = structlog.get_logger("ntp.watch")

UNREACHABLE = "this manager cannot read layouts from its database right now; try another manager"


def notify_payload(job: str, epoch: int, version: int) -> str:
    return f"{epoch}:{version}:{job}"


def parse_payload(payload: str) -> tuple[str, int, int] | None:
    """(job, epoch, version) of a `ntp_layouts` notification; None when it is not one."""
    parts = payload.split(":", 2)
    if len(parts) != 3:
        return None
    try:
        return parts[2], int(parts[0]), int(parts[1])
    except ValueError:
        return None


class Held:
    """A layout watch this manager holds; `told`: the manager the balancer told it to move to."""

    __slots__ = ("told",)

    def __init__(self) -> None:
        self.told: str | None = None


@dataclass
class _Job:
    layout: LayoutRec | None = None
    gone: bool = False
    watchers: int = 0


class LayoutFeed:
    """The newest layout of each job some watch on this manager follows, read from PostgreSQL."""

    def __init__(self, sm: async_sessionmaker[AsyncSession], settings: Settings, clock: Clock) -> None:
        self.sm, self.settings, self.clock = sm, settings, clock
        self.jobs: dict[str, _Job] = {}
        self.changed = asyncio.Condition()
        self.closed = False
        self.loads = 0  # layout versions read from the database
        self.read_on_notify = 0  # of them, read because a notification named them
        self.read_on_poll = 0  # of them, found by the poll (a notification lost or late)
        self.offered = 0  # versions the leader offered from its world
        self.notified = 0  # notifications received
        self._due: set[str] = set()  # jobs a notification named, to read
        self._wake = asyncio.Event()
        self._uuid_at: dict[int, str] = {}
        self._uuids: set[str] = set()
        self._positions_lock = asyncio.Lock()
        self.position_reads = 0  # reads of every GPU's position done
        self._locks: dict[str, asyncio.Lock] = {}
        self._held: dict[Held, None] = {}  # the watches held here, oldest first
        # the database unreachable (or slower than fleet_store_timeout_s) since; past that timeout
        # the watches held here end with UNAVAILABLE, so that their workers go to another manager
        self._failing_since: float | None = None
        self.cut_off = False

    # ---- what wakes it ----------------------------------------------------------------------
    def notify(self, payload: str) -> None:
        """A `ntp_layouts` notification (the listener's callback)."""
        self.notified += 1
        parsed = parse_payload(payload)
        if parsed is None:
            self._due.update(self.jobs)
        else:
            job, epoch, version = parsed
            j = self.jobs.get(job)
            if j is None or (j.layout is not None and (epoch, version) <= (j.layout.leader_epoch, j.layout.version)):
                return
            self._due.add(job)
        self._wake.set()

    def offer(self, recs: Iterable[LayoutRec], alive: Container[str] | None = None) -> None:
        """Layouts the leader published (its world's): newer ones replace what is held, at once.
        With `alive` (the leader's jobs), a job followed here and not among them is gone."""
        woke = False
        if alive is not None:
            for name, held in self.jobs.items():
                if name not in alive and not held.gone:
                    held.gone = woke = True
        for rec in recs:
            j = self.jobs.get(rec.job)
            if j is None:
                continue
            if j.layout is None or (rec.leader_epoch, rec.version) > (j.layout.leader_epoch, j.layout.version):
                j.layout = rec
                self.offered += 1
                woke = True
        if woke:
            self.wake_all()

    def wake_all(self) -> None:
        async def notify() -> None:
            async with self.changed:
                self.changed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    def close(self) -> None:
        self.closed = True
        self.wake_all()

    async def run(self) -> None:
        """Read what notifications named; every `fleet_poll_s`, the newest versions of every job watched."""
        poll = self.settings.fleet_poll_s
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + poll
        while not self.closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_poll - loop.time()))
            self._wake.clear()
            try:
                polled: set[str] = set()
                if loop.time() >= next_poll:
                    next_poll = loop.time() + poll
                    async with asyncio.timeout(self.settings.fleet_store_timeout_s):
                        polled = await self.poll()
                due, self._due = self._due, set()
                for job in due | polled:
                    if job in self.jobs:
                        before = self.loads
                        await self.load(job)
                        if self.loads > before:
                            if job in due:
                                self.read_on_notify += 1
                            else:
                                self.read_on_poll += 1
            except (OSError, SQLAlchemyError, TimeoutError, layout_codec.CodecError) as e:
                reason = "took too long" if isinstance(e, TimeoutError) else str(e).splitlines()[0][:200]
                log.warning("cannot read layouts for the watches held here", error=reason)
                if not isinstance(e, layout_codec.CodecError):
                    self._failed(loop.time())
            else:
                self._failing_since = None
                self.cut_off = False

    def _failed(self, now: float) -> None:
        if self._failing_since is None:
            self._failing_since = now
        if not self.cut_off and now - self._failing_since >= self.settings.fleet_store_timeout_s:
            self.cut_off = True
            log.warning("the database is out of reach: the layout watches held here end (UNAVAILABLE)",
                        watches=self.held())
            self.wake_all()

    async def poll(self) -> set[str]:
        """Marks the jobs deleted; returns those whose newest version is newer than the one held."""
        names = list(self.jobs)
        newer: set[str] = set()
        if not names:
            return newer
        async with self.sm() as s:
            alive = set((await s.scalars(select(JobRow.name).where(JobRow.name.in_(names)))).all())
            newest = dict((await s.execute(select(LayoutRow.job, func.max(LayoutRow.version))
                                           .where(LayoutRow.job.in_(names)).group_by(LayoutRow.job))).all())
        gone = False
        for name in names:
            j = self.jobs.get(name)
            if j is None:
                continue
            if name not in alive:
                j.gone = gone = True
                continue
            v = newest.get(name)
            if v is not None and (j.layout is None or int(v) > j.layout.version):
                newer.add(name)
        if gone:
            self.wake_all()
        return newer

    # ---- reading layouts --------------------------------------------------------------------
    async def load(self, job: str) -> LayoutRec | None:
        """Read `job`'s newest version (when newer than the one held) and wake its watchers."""
        lock = self._locks.setdefault(job, asyncio.Lock())
        async with lock:
            j = self.jobs.setdefault(job, _Job())
            held = j.layout
            async with asyncio.timeout(self.settings.fleet_store_timeout_s), self.sm() as s:
                if not await s.scalar(select(func.count()).select_from(JobRow).where(JobRow.name == job)):
                    j.gone = True
                    self.wake_all()
                    return None
                j.gone = False
                newest = await s.scalar(select(func.max(LayoutRow.version)).where(LayoutRow.job == job))
                if newest is None or (held is not None and int(newest) <= held.version):
                    return held
                row = (await s.scalars(select(LayoutRow).where(LayoutRow.job == job,
                                                               LayoutRow.version == int(newest)))).one()
                if held is not None and row.base_version == held.version and row.body is not None:
                    rows, base = [row], held  # one delta on the version held
                else:
                    rows, base = await newest_rows(s, job), None
            doc = await self._decode(rows, base)
            last = rows[-1]
            rec = LayoutRec(last.job, last.version, last.leader_epoch, doc, last.reason, last.created_at,
                            self.clock.monotonic(), (base.chain + 1) if base is not None else chain_length(rows))
            cur = j.layout
            if cur is None or (rec.leader_epoch, rec.version) > (cur.leader_epoch, cur.version):
                j.layout = rec
                self.loads += 1
                self.wake_all()
            return j.layout

    async def _decode(self, rows: list[LayoutRow], base: LayoutRec | None) -> Any:
        for attempt in (0, 1):
            missed: list[int] = []
            table = self._uuid_at

            def uuid_at(pos: int, table: dict[int, str] = table, missed: list[int] = missed) -> str:
                try:
                    return table[pos]
                except KeyError:
                    missed.append(pos)
                    raise

            try:
                if base is not None:
                    assert rows[0].body is not None
                    return await offloop.run(layout_codec.decode, rows[0].body, uuid_at, base.doc)
                return (await offloop.run(decode_rows, rows, uuid_at))[-1]
            except layout_codec.CodecError:
                if attempt or not missed:
                    raise
                await self._load_positions()  # GPUs registered since the map was read
        raise AssertionError("unreachable")

    async def _load_positions(self) -> None:
        """Read every GPU's position (what stored layouts name GPUs by). One read at a time: a
        caller that waited while another read ran uses that one's result (a takeover's decode
        and a burst of watches on a fresh manager each asked for all 100,000 rows at once)."""
        done = self.position_reads
        async with self._positions_lock:
            if self.position_reads != done:
                return
            async with self.sm() as s:
                rows = (await s.execute(select(GpuRow.pos, GpuRow.uuid))).all()
            self._uuid_at = {int(p): str(u) for p, u in rows}
            self._uuids = set(self._uuid_at.values())
            self.position_reads += 1

    async def known_gpu(self, gpu: str) -> bool:
        """Whether `gpu` is registered: the map held, else one row looked up (a GPU registered
        since the map was read joins it; an unknown one costs one indexed lookup, not a read of
        every GPU)."""
        if gpu in self._uuids:
            return True
        async with self.sm() as s:
            pos = await s.scalar(select(GpuRow.pos).where(GpuRow.uuid == gpu))
        if pos is None:
            return False
        self._uuid_at[int(pos)] = gpu
        self._uuids.add(gpu)
        return True

    # ---- watchers ---------------------------------------------------------------------------
    async def _load_or_unavailable(self, job: str) -> LayoutRec | None:
        if self.cut_off:
            raise Unavailable(UNREACHABLE)
        try:
            return await self.load(job)
        except (OSError, SQLAlchemyError, TimeoutError) as e:
            raise Unavailable(UNREACHABLE) from e

    async def current(self, job: str) -> LayoutRec | None:
        """The newest layout of `job` held (read now when the job is not followed yet); NotFound
        for a job that does not exist, Unavailable when the database cannot be read."""
        if self.cut_off:
            raise Unavailable(UNREACHABLE)
        j = self.jobs.get(job)
        if j is None or j.gone:
            await self._load_or_unavailable(job)
            j = self.jobs[job]
            if j.gone:
                if j.watchers == 0:
                    self.jobs.pop(job, None)
                raise NotFound(f"job: unknown job {job!r}")
        return j.layout

    async def refreshed(self, job: str) -> LayoutRec | None:
        """The newest layout of `job`, read from the database now (a worker holds a newer stamp
        than this manager has seen: the notification may be on its way)."""
        rec = await self._load_or_unavailable(job)
        if self.jobs.get(job, _Job(gone=True)).gone:
            raise NotFound(f"job: unknown job {job!r}")
        return rec

    async def wait(self, job: str, newer_than: tuple[int, int], stop: Callable[[], bool] | None = None
                   ) -> LayoutRec | None:
        """Like Jobs.wait_layout: a layout of `job` newer than `newer_than`; None when closing or
        `stop()`; NotFound when the job is (or becomes) unknown."""
        await self.current(job)
        j = self.jobs[job]
        j.watchers += 1
        try:
            async with self.changed:
                while not self.closed and not (stop is not None and stop()):
                    if self.cut_off:
                        raise Unavailable(UNREACHABLE)
                    if j.gone:
                        raise NotFound(f"unknown job {job!r}")
                    lay = j.layout
                    if lay is not None and (lay.leader_epoch, lay.version) > newer_than:
                        return lay
                    await self.changed.wait()
            return None
        finally:
            j.watchers -= 1
            if j.watchers == 0 and (j.gone or self.closed):
                self.jobs.pop(job, None)

    def hold(self) -> Held:
        h = Held()
        self._held[h] = None
        return h

    def release(self, h: Held) -> None:
        self._held.pop(h, None)

    def held(self) -> int:
        """Layout watches this manager holds."""
        return len(self._held)

    def move(self, target: str, n: int) -> int:
        """Tell `n` watches (the newest not told yet) to move to `target`; how many were told."""
        told = 0
        for h in reversed(list(self._held)):
            if told >= n:
                break
            if h.told is None:
                h.told = target
                told += 1
        if told:
            log.info("layout watches told to move for balance", watches=told, to=target)
            self.wake_all()
        return told


