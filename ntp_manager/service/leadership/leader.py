"""Leadership: which manager acts, at which epoch, and where the others send their clients.

PostgreSQL: any number of managers run against one database; one leads through the lease row
(store/lease.py). The leader renews every `lease_renew_s` from a thread of its own, with its own
event loop and connection (a busy main pool or loop never delays a renewal: `keep`); a standby
reads the row, learns who leads and where (clients of the standby are sent there), and tries to
take the lease over when it has expired, bumping the epoch. Every write transaction runs `fence`
(kernel.py): it reads the epoch in that transaction and refuses to commit unless it is this
manager's, so a leader that was paused (SIGSTOP, a long GC, a partition from the database) and
wakes up after a takeover commits nothing. Its sessions carry an idle-in-transaction timeout of one
lease, and a new leader that finds the row lock held by the manager it replaces ends that manager's
sessions, so a leader paused inside a transaction cannot hold the lease row forever.

A leader that finds its lease gone (the row has another epoch, or no renewal got through for a
whole lease) stops: `lost` is set and the process exits for its supervisor to start it again as a
standby, as Kubernetes' controllers do. Leading again in the same process would mean resetting
every component's memory; a fresh process is simpler and certain.

SQLite: one manager. A lock file next to the database (flock: released by the kernel however the
process ends) keeps a second one out with a clear error; the lease row still records the epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import structlog
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from ntp_manager.service.core.errors import ServiceError
from ntp_manager.settings import Settings
from ntp_manager.store import db, lease
from ntp_manager.store.db import application_name

log = structlog.get_logger("ntp.leader")

LOOP_STUCK_S = 30.0  # a leader whose event loop has not turned for this long (or a lease) stops renewing
WARM_CHECK_S = 10.0  # a standby's renewal connection is checked this often


@dataclass(frozen=True)
class LeaderInfo:
    epoch: int
    holder: str
    http: str  # host:port of its REST API ("" when it did not say)
    grpc: str  # host:port of its gRPC server


class NotLeader(ServiceError):
    """This manager does not lead (a standby, or a leader whose lease was taken over): the request
    goes to the leader, named in the message when known."""

    http_status = 503
    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str, leader: LeaderInfo | None = None) -> None:
        super().__init__(message)
        self.leader = leader


class AnotherManager(RuntimeError):
    """A second manager on a SQLite database."""


class Leadership:
    def __init__(self, settings: Settings, engine: AsyncEngine) -> None:
        self.settings = settings
        self.me = settings.leader_id
        url = settings.effective_database_url
        self.postgres = url.startswith("postgresql")
        # the lease has a small pool of its own on PostgreSQL; SQLite shares the manager's engine
        self.engine = (db.make_engine(url, application_name(self.me) + " lease", settings.lease_ttl_s, pool_size=2)
                       if self.postgres else engine)
        self.epoch = 0
        self.leading = False
        self.leader: LeaderInfo | None = None  # who leads, as last read (self when leading)
        self.view: lease.LeaseView | None = None  # the lease row as last read
        self.view_mono = 0.0  # when
        self.http = settings.advertise_http or ""
        self.grpc = settings.advertise_grpc or ""
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.refused = 0  # write transactions the fence refused (tests and metrics)
        self.renewed_mono = 0.0  # when the last renewal that got through was sent
        self._lock_file: IO[str] | None = None
        self._keeper: _RenewalThread | None = None  # PostgreSQL
        self._loop_mono = time.monotonic()  # when the manager's event loop last turned (`_tick`)

    # ---- start ------------------------------------------------------------------------------
    def advertise(self, http: str, grpc: str) -> None:
        """The addresses clients of a standby are sent to (the settings' advertise_* win)."""
        self.http = self.settings.advertise_http or http
        self.grpc = self.settings.advertise_grpc or grpc

    def lock_sqlite(self) -> None:
        """SQLite: take the database's lock file, or raise AnotherManager naming who holds it."""
        if self.postgres:
            return
        path = make_url(self.settings.effective_database_url).database
        if not path or path == ":memory:":
            return
        lock_path = Path(path).with_name(Path(path).name + ".lock")
        f = open(lock_path, "a+")  # noqa: SIM115 (held until close())
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise AnotherManager(
                f"another manager ({holder}) is running on the SQLite database {path}; SQLite holds one manager. "
                "To run several managers (one leads, the others stand by), use PostgreSQL (NTP_DATABASE_URL)"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{self.me} pid {os.getpid()}\n")
        f.flush()
        self._lock_file = f

    async def try_acquire(self) -> bool:
        """Take the lease when it is free (always on SQLite); True when this manager now leads."""
        try:
            async with self.engine.begin() as conn:
                if self.postgres:  # a paused old leader inside a transaction must not block this forever
                    ms = max(1, int(self.settings.lease_renew_s * 1000))
                    await conn.exec_driver_sql(f"SET LOCAL lock_timeout = {ms}")
                sent = time.monotonic()
                epoch = await lease.acquire(conn, self.me, self.settings.lease_ttl_s, self.http, self.grpc)
        except (OperationalError, DBAPIError) as e:
            old = self.view.holder if self.view is not None else ""
            if self.postgres and _lock_timeout(e) and old and old != self.me:
                # the lease is free but its row is locked: the manager that held it is paused in a
                # transaction; end its sessions (its transactions roll back) and try again next time
                async with self.engine.begin() as conn:
                    ended = await lease.terminate_sessions(conn, application_name(old))
                log.warning("the lease row is locked by the manager that held it; ended its sessions",
                            holder=old, sessions=ended)
                return False
            raise
        if epoch is None:
            return False
        self.epoch, self.leading, self.renewed_mono = epoch, True, sent
        self.leader = LeaderInfo(epoch, self.me, self.http, self.grpc)
        log.info("leading", epoch=epoch, holder=self.me)
        return True

    async def refresh(self) -> lease.LeaseView | None:
        """Read the lease; remember who leads (for redirects)."""
        async with self.engine.connect() as conn:
            view = await lease.read(conn)
        self.view, self.view_mono = view, time.monotonic()
        if view is not None and view.live and not self.leading:
            self.leader = LeaderInfo(view.epoch, view.holder, view.http, view.grpc)
        elif view is not None and not view.live and not self.leading:
            self.leader = None
        return view

    def in_touch(self) -> bool:
        """This manager reached the store within the last lease: a renewal got through (leading)
        or the lease was read (standing by). Always on SQLite (a local file)."""
        if not self.postgres:
            return True
        last = max(self.view_mono, self.renewed_mono)
        return last > 0 and time.monotonic() - last <= self.settings.lease_ttl_s

    async def wait_for_turn(self) -> None:
        """Stand by until this manager takes the lease: read it every `lease_renew_s` (or sooner,
        when it is about to expire) and try to take it once it has expired."""
        ttl, period = self.settings.lease_ttl_s, self.settings.lease_renew_s
        while True:
            wait = period
            try:
                view = await self.refresh()
                if view is None or not view.live:
                    if await self.try_acquire():
                        return
                elif view.remaining_s is not None:
                    wait = min(period, max(0.02, view.remaining_s + 0.01))
            except (OSError, OperationalError, DBAPIError) as e:
                log.warning("cannot read the lease", error=str(e).splitlines()[0][:200])
            await asyncio.sleep(min(wait, ttl))

    # ---- leading ----------------------------------------------------------------------------
    async def keep(self) -> None:
        """Renew the lease every `lease_renew_s` while leading; set `lost` when it is gone: a
        renewal finds another epoch, or none got through for a whole lease.

        On PostgreSQL the renewals run in a thread of their own, with an event loop and a database
        connection of their own. On the manager's loop a renewal waited behind every callback ready
        before it: with thousands of agent streams and watches on a machine short of CPU, a new
        leader catching up (100,000 GPUs loaded, the outbox replayed) went seconds between turns of
        its loop, and lost a lease of 6 s that nobody else wanted (bench/RESULTS.md). A thread
        waits only for the GIL, which the loop's thread gives up every switch interval. A process
        that is stopped (SIGSTOP) or cut off from the database still loses the lease: its renewals
        stop, or do not get through."""
        self._loop_mono = time.monotonic()
        tick = asyncio.ensure_future(self._tick())
        try:
            if not self.postgres:
                await self._keep(self.engine, self.lose)
                return
            if self._keeper is None or self._keeper.ended.done():  # none yet, or it failed while waiting
                self._keeper = _RenewalThread(self, asyncio.get_running_loop())
            self._keeper.start_keeping()
            try:
                await asyncio.shield(self._keeper.ended)
            finally:
                if not self._keeper.ended.done():  # cancelled (the manager stops): end the thread
                    await self._end_keeper()
        finally:
            tick.cancel()

    def start_renewals(self) -> None:
        """PostgreSQL: start the renewal thread now (a manager starting; `keep` starts it otherwise).
        A standby's thread waits with its connection open, so that the first renewal after a
        takeover does not pay for a new connection on a process busy loading the world (the bench
        saw it 3.3 s late)."""
        if self.postgres and self._keeper is None:
            self._keeper = _RenewalThread(self, asyncio.get_running_loop())

    async def _tick(self) -> None:
        """Mark the manager's event loop as turning: the renewal thread stops renewing for a loop
        that has not turned for `max(lease_ttl_s, LOOP_STUCK_S)` (wedged; not merely slow)."""
        while True:
            self._loop_mono = time.monotonic()
            await asyncio.sleep(min(1.0, self.settings.lease_renew_s))

    async def _end_keeper(self) -> None:
        """End the renewal thread and wait (a little) until it has: no renewal may follow a release."""
        keeper = self._keeper
        if keeper is None:
            return
        keeper.end()
        await asyncio.to_thread(keeper.thread.join, 2.0)

    async def _keep(self, engine: AsyncEngine, lose: Callable[[str], None]) -> None:
        """The renewal loop of `keep`, on whichever loop runs it: renewals through `engine`, and
        `lose(reason)` once the lease is gone (then it returns).

        A renewal is never waited on past the end of the lease it would extend: when the database
        is cut off by a partition that drops packets (rather than refusing them), the call hangs
        for as long as TCP retries, while a standby takes the lease over as soon as it expires. A
        leader that waited for it would go on holding its agents' streams and its watchers as if
        it led, and they would never move to the new leader. The call is left to end on its own
        (cancelled, not awaited: a call on a dead connection may not end soon)."""
        ttl, period = self.settings.lease_ttl_s, self.settings.lease_renew_s
        while self.leading:
            await asyncio.sleep(period)
            if not self.leading:
                return
            sent = time.monotonic()
            stuck = sent - self._loop_mono
            if stuck > max(ttl, LOOP_STUCK_S):
                lose(f"the manager's event loop has not turned for {stuck:.0f} s: it is wedged")
                return
            # until the lease ends as this manager reckons it (it counts from when the last renewal
            # that got through was sent, so it ends here no later than in the database); a loop held
            # past it still gets one short try: nobody may have taken the lease meanwhile
            left = self.renewed_mono + ttl - sent
            if left <= 0:
                left = min(period, ttl / 4)
            call = asyncio.ensure_future(self._renew(engine, ttl))
            try:
                done, _ = await asyncio.wait({call}, timeout=left)
            finally:
                if not call.done():  # given up on (or this loop cancelled: the manager stops)
                    call.cancel()
                    call.add_done_callback(_consume)
            if not done:
                lose(f"no renewal got through for {ttl:g} s (lease_ttl_s; the last one has been waiting "
                     f"{time.monotonic() - sent:.1f} s): another manager may lead now")
                return
            try:
                ok = call.result()
            except (OSError, SQLAlchemyError) as e:
                log.warning("lease renewal failed", error=str(e).splitlines()[0][:200])
                if time.monotonic() - self.renewed_mono >= ttl:
                    lose(f"no renewal got through for {ttl:g} s (lease_ttl_s): another manager may lead now")
                    return
                continue
            if not ok:
                lose(f"the lease of epoch {self.epoch} was taken over")
                return
            if sent - self.renewed_mono >= ttl:  # paused past the lease, but nobody took it: still ours
                log.warning("renewed a lease that had expired", epoch=self.epoch,
                            late_s=round(sent - self.renewed_mono, 3))
            self.renewed_mono = sent

    async def _renew(self, engine: AsyncEngine, ttl: float) -> bool:
        async with engine.begin() as conn:
            return await lease.renew(conn, self.me, self.epoch, ttl)

    def lose(self, reason: str) -> None:
        if not self.leading:
            return
        self.leading = False
        self.leader = None
        self.lost_reason = reason
        log.error("lost the lease; this manager stops acting", epoch=self.epoch, reason=reason)
        self.lost.set()

    async def fence(self, session: AsyncSession) -> None:
        """Inside a write transaction: refuse it unless this manager leads at the epoch the
        database holds (store/lease.py: the epoch stays share-locked until the commit)."""
        if not self.leading:
            self.refused += 1
            raise self.not_leader()
        current = await lease.fence(session)
        if current != self.epoch:
            self.refused += 1
            self.lose(f"a write found epoch {current} in the database, not this manager's {self.epoch}")
            raise self.not_leader()

    async def give_up(self, reason: str) -> None:
        """A takeover that cannot go on (its state would not load): give the lease up now, so that
        the next standby takes it at once rather than when it expires, and stop as a leader that
        lost it does (`lost`: the process exits for its supervisor)."""
        await self.release()
        self.lost_reason = reason
        log.error("gave the lease up; this manager stops", epoch=self.epoch, reason=reason)
        self.lost.set()

    def not_leader(self) -> NotLeader:
        who = self.leader
        if self.leading:  # it has just taken the lease and is loading: no address to go to, back off
            return NotLeader(f"this manager has just become the leader (epoch {self.epoch}) and is loading "
                             "the state; try again shortly")
        if who is None:
            return NotLeader("this manager is not the leader and no leader is known yet; try again shortly")
        return NotLeader(f"this manager is a standby; the leader is {who.holder} (epoch {who.epoch}) "
                         f"at http {who.http or '?'}, grpc {who.grpc or '?'}", who)

    async def release(self) -> None:
        """Give the lease up now (a clean stop): a standby takes over without waiting for it to expire."""
        if not self.leading:
            return
        self.leading = False
        await self._end_keeper()
        with contextlib.suppress(OSError, OperationalError, DBAPIError):
            async with self.engine.begin() as conn:
                await lease.release(conn, self.me, self.epoch)
            log.info("released the lease", epoch=self.epoch)

    async def close(self) -> None:
        await self._end_keeper()
        if self.postgres:
            await self.engine.dispose()
        if self._lock_file is not None:
            self._lock_file.close()  # the flock goes with it
            self._lock_file = None


def _consume(task: asyncio.Future[bool]) -> None:
    """Retrieve the outcome of a renewal given up on, so that its error is not reported as lost."""
    if not task.cancelled():
        task.exception()


def _lock_timeout(e: Exception) -> bool:
    orig = getattr(e, "orig", None)
    return "LockNotAvailable" in type(orig).__name__ or "lock timeout" in str(e).lower()


class _RenewalThread:
    """The leader's renewals on PostgreSQL (`Leadership.keep`): a thread with an event loop and a
    database connection of its own. Started with the manager, it waits until `go` (this manager
    leads), checking its connection every WARM_CHECK_S, then renews until the lease is lost or
    released or `stop` is set. `ended` (a future of the manager's loop) resolves when it ends."""

    def __init__(self, lead: Leadership, main: asyncio.AbstractEventLoop) -> None:
        self.lead, self.main = lead, main
        self.go, self.stop = threading.Event(), threading.Event()
        self.ended: asyncio.Future[None] = main.create_future()
        # the thread's own loop and the event that wakes it when `go` or `stop` is set (`signal`)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._body, name=f"lease-renewal-{lead.me}"[:60], daemon=True)
        self.thread.start()

    def _lose(self, reason: str) -> None:
        with contextlib.suppress(RuntimeError):  # the manager's loop has closed (the process exits)
            self.main.call_soon_threadsafe(self.lead.lose, reason)

    def _finish(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    def _body(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception as e:  # reported, and the lease treated as lost
            log.error("the lease renewal thread failed", error=repr(e)[:200])
            self._lose(f"the lease renewal thread failed: {e!r}"[:300])
        finally:
            with contextlib.suppress(RuntimeError):
                self.main.call_soon_threadsafe(self._finish)

    def start_keeping(self) -> None:
        """This manager leads: renew from now on (called on the manager's loop)."""
        self.go.set()
        self._signal()

    def end(self) -> None:
        """Stop renewing and end the thread (called on the manager's loop)."""
        self.stop.set()
        self._signal()

    def _signal(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the thread's loop has closed: nothing waits
                loop.call_soon_threadsafe(wake.set)

    async def _until(self, event: threading.Event, timeout: float) -> bool:
        """Wait until `event` or `stop` is set (woken by `_signal`, not polling: a poll every 50 ms
        was a third of an idle manager's CPU), or `timeout`."""
        wake = self._wake
        assert wake is not None
        end = time.monotonic() + timeout
        while not (event.is_set() or self.stop.is_set()):
            left = end - time.monotonic()
            if left <= 0:
                break
            wake.clear()
            if event.is_set() or self.stop.is_set():  # set before the clear: its wake-up is gone
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), left if math.isfinite(left) else None)
        return event.is_set()

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        s = self.lead.settings
        engine = db.make_engine(s.effective_database_url, application_name(self.lead.me) + " renew",
                                s.lease_ttl_s, pool_size=1)
        try:
            while not self.stop.is_set() and not self.go.is_set():
                with contextlib.suppress(Exception):  # checked again later; a renewal reconnects anyway
                    async with asyncio.timeout(s.lease_ttl_s), engine.connect() as c:
                        await c.exec_driver_sql("SELECT 1")
                await self._until(self.go, WARM_CHECK_S)
            if self.stop.is_set():
                return
            keeping = asyncio.ensure_future(self.lead._keep(engine, self._lose))
            stopping = asyncio.ensure_future(self._until(self.stop, float("inf")))
            await asyncio.wait({keeping, stopping}, return_when=asyncio.FIRST_COMPLETED)
            for t in (keeping, stopping):
                t.cancel()
            await asyncio.gather(keeping, stopping, return_exceptions=True)
        finally:
            with contextlib.suppress(Exception):  # a connection cut off may not close soon
                async with asyncio.timeout(1.0):
                    await engine.dispose()
