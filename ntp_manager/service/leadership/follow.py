"""Warm standbys: a manager that does not lead keeps its own copy of the world current.

The leader writes, inside every transaction that changes the world and under the same fence, one
world-log row (store/worldlog.py) with what it changed (service/core/changes.py). Every other
manager sharing the store:

- loads the world once when it starts standing by (`bootstrap`: the log's head first, then the
  world, then every row after that head: rows already reflected in the load only overwrite records
  with values a later row overwrites again);
- follows the log (woken by `NOTIFY ntp_world`, polling every `fleet_poll_s`), applying each row to
  its world in order; the jobs the rows name are read back (their layouts are stored already) once
  the log has been quiet for `SETTLE_S` (at the latest `SETTLE_MAX_S` after the first row that
  named one), and at a takeover (a job replanned many times in a burst, as while its cluster
  registers, is decoded once, not once per version);
- keeps the planner's cluster snapshot built and its planner process sent the cluster and the
  running layouts, once the log has been quiet for `SETTLE_S` (not row after row of a burst) and
  no sooner after the last time than `PRIME_SPACING` times what that took, so a takeover does not
  pay for them and a standby does not spend its time on them while a cluster registers;
- on taking the lease (`take_over`), applies what is left (the old leader can commit nothing once
  the lease is taken: its fence refuses) and leads on that world: no load.

Faults: a row it cannot apply is quarantined on this manager (kept with its reason in
`quarantined`, counted in `ntp_world_follow_quarantined_total`, logged as an error) and the world is
loaded again, never left wrong; so is a gap the leader's pruning left (this manager was behind by
more than the retention). A standby more than `fleet_follow_max_lag_rows` rows behind says so
(`behind`: /readyz, gRPC health NOT_SERVING for new clients, the balance sends it none) until it
has caught up. A takeover by a manager whose copy is not current (never loaded, being reloaded, a
job it could not read) loads the world as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from ntp_manager.clock import Clock
from ntp_manager.jsontext import parse
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.changes import Applied, BadRow, Checked, apply_checked, check, encode
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.state import World
from ntp_manager.service.core.tasks import cancel_all
from ntp_manager.service.leadership.loading import load_job
from ntp_manager.settings import Settings
from ntp_manager.store import worldlog
from ntp_manager.store.db import KeptConnection
from ntp_manager.topology import Cluster

log = structlog.get_logger("ntp.follow")

BATCH = 256  # rows read at once
SETTLE_S = 1.0  # the planner's snapshot is rebuilt and sent once the log has been quiet this long
# ... and no sooner after the last rebuild than this many times what it took: a standby spends at
# most about a tenth of its time on them. At 100,000 GPUs a rebuild and send is 1-2 s of CPU; while
# 12,500 agents registered (an hour's worth of quiet seconds in a minute) rebuilding at every quiet
# second took a quarter of a standby's CPU and tripled its cost per hello (bench/RESULTS.md).
PRIME_SPACING = 9.0
# ... and the jobs the rows named are read back no later than this after the first of them, even
# while rows keep coming (agents reconnecting after a manager died keep the log busy for a minute
# at 12,500 agents; a takeover then read a 100,000-GPU layout back on its critical path)
SETTLE_MAX_S = 5.0
INLINE = 512  # records a transaction writes below which its row is encoded on the loop (else in a thread)


class Ahead(Protocol):
    """What a standby does ahead of a takeover with its planner (service/planning/jobs.py's `Jobs`)."""

    async def prime(self, cluster: Cluster, docs: list[LayoutDoc]) -> int:
        """Send the planner process the cluster's shape and these layouts; how many pieces went."""
        ...

    async def verify(self) -> int:
        """Plan every job without publishing; how many plans were the running layout."""
        ...


def _decode(rows: list[tuple[int, str]]) -> list[tuple[int, Checked | str]]:
    """Parse and check each row's body (in a thread: a row of a hello burst is hundreds of kB and
    thousands of records); a body that cannot be read becomes the reason it is quarantined."""
    out: list[tuple[int, Checked | str]] = []
    for seq, raw in rows:
        try:
            body = parse(raw)
            if not isinstance(body, dict):
                raise BadRow("world-log body is not an object")
            out.append((seq, check(body)))
        except ValueError as e:  # BadRow included
            out.append((seq, str(e) if isinstance(e, BadRow) else f"world-log body is not JSON: {e}"))
    return out


class WorldLogWriter:
    """The leader's side: a `before_commit` hook of the kernel that appends the transaction's row."""

    def __init__(self, epoch: Callable[[], int]) -> None:
        self.epoch = epoch
        self.rows = 0

    async def __call__(self, tx: Tx) -> None:
        domains, nodes, gpus = tx.written()
        jobs = list(tx.jobs_touched)
        if len(nodes) + len(gpus) > INLINE:  # a burst: encoded off the loop (the lock is held: nothing changes them)
            body = await offloop.run(encode, domains, nodes, gpus, jobs)
        else:
            body = encode(domains, nodes, gpus, jobs)
        if body is not None:
            await worldlog.append(tx.session, body, self.epoch(), tx.now)
            self.rows += 1


class Follower:
    """Keeps `kernel.world` current from the world log while this manager does not lead."""

    def __init__(self, sm: async_sessionmaker[AsyncSession], engine: AsyncEngine, kernel: Kernel, settings: Settings,
                 clock: Clock, load: Callable[[], Awaitable[World]], registry: CollectorRegistry,
                 ahead: Ahead | None = None) -> None:
        self.sm, self.kernel, self.settings, self.clock, self.load = sm, kernel, settings, clock, load
        # sends the planner process the cluster's shape and the running layouts ahead of a takeover
        self.ahead = ahead
        self.primed = 0  # pieces sent that way
        self.verified = 0  # jobs whose plan was found to be their running layout (`Jobs.verify`)
        self._reader = engine.execution_options(isolation_level="AUTOCOMMIT")
        # the log's reads: one statement each on the driver, on a connection kept while following
        self._rows = KeptConnection(self._reader, settings.fleet_store_timeout_s, "the world log")
        self.cursor = 0  # the last row applied
        self.head = 0  # the newest row known to exist (NOTIFY payloads, reads)
        self.warm = False  # loaded, and following
        self.stale = False  # must load again (a quarantined row, a pruned gap)
        self.applied = 0  # rows applied
        self.loads = 0  # world loads (the first, and any again)
        self.quarantined: list[tuple[int, str]] = []  # (seq, reason), newest last, bounded
        self.jobs_read = 0
        self.wake = asyncio.Event()
        self._jobs: set[str] = set()  # named by rows applied, not read back yet
        # when the planner's snapshot is to be rebuilt and sent (0: nothing to do): a registration
        # burst adds GPUs row after row, and a rebuild per row cost O(GPUs) each time
        self._settle_at = 0.0
        self._prime_after = 0.0  # monotonic: no snapshot rebuilt and sent before then (PRIME_SPACING)
        self._pending_since = 0.0  # monotonic: the first row named a job or changed the shape since the last settle
        self._task: asyncio.Task[None] | None = None
        self._lag = Gauge("ntp_world_follow_lag_rows", "world-log rows this manager has not applied yet "
                          "(0 on the leader)", registry=registry)
        self._quarantine = Counter("ntp_world_follow_quarantined", "world-log rows this manager could not "
                                   "apply (its world was loaded again)", registry=registry)
        self._primes = Counter("ntp_world_follow_prepared", "times this standby rebuilt its planner's snapshot "
                               "and sent its planner process what changed, ahead of a takeover", registry=registry)
        self._prime_s = Counter("ntp_world_follow_prepare_seconds", "wall seconds spent on those preparations",
                                registry=registry)

    # ---- state ------------------------------------------------------------------------------
    @property
    def lag(self) -> int:
        """Rows behind the newest one known (a rolled-back transaction's gap counts as one)."""
        return max(0, self.head - self.cursor) if self._task is not None else 0

    @property
    def behind(self) -> bool:
        """Following, and not current enough to be given new clients."""
        if self._task is None:
            return False
        return not self.warm or self.stale or self.lag > self.settings.fleet_follow_max_lag_rows

    def view(self) -> dict[str, Any]:
        """What /readyz says of it."""
        return {"following": self._task is not None, "warm": self.warm, "cursor": self.cursor, "lag_rows": self.lag,
                "behind": self.behind, "quarantined": len(self.quarantined), "loads": self.loads}

    def notify(self, payload: str) -> None:
        """A `NOTIFY ntp_world` (its payload is the new row's number)."""
        with contextlib.suppress(ValueError):
            self.head = max(self.head, int(payload))
        self._lag.set(self.lag)
        self.wake.set()

    # ---- following --------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the world and follow the log from there (a standby starting)."""
        await self.bootstrap()
        self.start_following()

    def start_following(self) -> None:
        """Follow the log from the cursor (the world loaded already)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="world-follow")

    async def bootstrap(self) -> None:
        """The log's head, then the world as the store holds it, then every row after that head."""
        self.warm = False
        async with self._reader.connect() as c:
            first = await worldlog.head(c)
        world = await self.load()
        self.kernel.world = world
        self.cursor, self.head = first, max(self.head, first)
        self._jobs.clear()
        self.stale = False
        self.loads += 1
        while await self.step() == BATCH:
            pass
        await world.cluster_async()  # the planner's snapshot, built now rather than at a takeover
        await self.prime()
        self.warm = True
        log.info("following the world log", cursor=self.cursor, gpus=len(world.gpus), jobs=len(world.jobs))

    async def _run(self) -> None:
        poll = self.settings.fleet_poll_s
        while True:
            try:
                if self.stale:
                    await self.bootstrap()
                self.wake.clear()
                if await self.step() == BATCH:
                    continue
                if self._settle_at and time.monotonic() >= self._settle_at:
                    self._settle_at = self._pending_since = 0.0
                    await self._read_jobs()
                    if time.monotonic() < self._prime_after:
                        self._settle_at = self._prime_after  # rebuilt not long ago: later
                    else:
                        t0, cpu0 = time.monotonic(), time.process_time()
                        await self.prime()
                        took = time.monotonic() - t0
                        self._prime_after = time.monotonic() + PRIME_SPACING * took
                        self._primes.inc()
                        self._prime_s.inc(took)
                        log.info("planner prepared ahead of a takeover", seconds=round(took, 3),
                                 process_cpu_s=round(time.process_time() - cpu0, 3),
                                 next_in_s=round(PRIME_SPACING * took, 1))
            except (OSError, SQLAlchemyError) as e:
                log.warning("cannot read the world log", error=str(e).splitlines()[0][:200])
            wait = poll if not self._settle_at else max(0.0, min(poll, self._settle_at - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), wait)

    async def step(self) -> int:
        """Apply the next rows (up to BATCH); the jobs they name are read back, and the planner's
        snapshot rebuilt, once the log is quiet (`_run`). How many rows were read."""
        raw = await worldlog.read_after_kept(self._rows, self.cursor, BATCH)  # OSError: retried (`_run`)
        if raw and raw[0][0] > self.cursor + 1 and await worldlog.pruned_upto_kept(self._rows) > self.cursor:
            log.error("world-log rows this manager had not applied were pruned; loading the world again",
                      cursor=self.cursor)
            self.stale = True
            return 0
        w = self.kernel.world
        done = Applied()
        for seq, body in await offloop.run(_decode, raw):
            try:
                if isinstance(body, str):
                    raise BadRow(body)
                apply_checked(w, body, self.clock.monotonic(), done)
            except BadRow as e:
                self._quarantined(seq, str(e))
                return len(raw)
            self.cursor = seq
            self.applied += 1
        # a short read saw every row committed when it ran: nothing is known beyond the cursor (a
        # NOTIFY of a later row sets the head again, and wakes the loop)
        self.head = self.cursor if len(raw) < BATCH else max(self.head, self.cursor)
        self._lag.set(self.lag)
        if done.shape:
            w.invalidate()
        elif done.states:
            w.apply_states(done.states)
        self._jobs |= done.jobs
        if (done.shape or done.jobs) and self.warm:  # once the log is quiet (`_run`), or at the latest...
            now = time.monotonic()
            self._pending_since = self._pending_since or now
            self._settle_at = min(now + SETTLE_S, self._pending_since + SETTLE_MAX_S)
        elif not self.warm and len(raw) < BATCH:  # bootstrapping: the jobs now
            await self._read_jobs()
        return len(raw)

    async def prime(self) -> None:
        """The planner's snapshot is built, and the planner process gets the cluster's shape and
        every job's running layout now (each once), so that a takeover's first replans send only
        the GPUs' states; then every job is planned on this world (publishing nothing), so that a
        takeover's replan of a job whose plan is its running layout, with no GPU changed since, is
        answered without planning."""
        if self.ahead is None:
            return
        w = self.kernel.world
        try:
            cluster = await w.cluster_async()
            self.primed += await self.ahead.prime(cluster, [j.layout.doc for j in w.jobs.values() if j.layout])
            self.verified += await self.ahead.verify()
        except Exception as e:  # the takeover's replans do what was not done here: nothing is lost
            log.warning("could not prepare the planner ahead of a takeover", error=repr(e)[:200])

    def _quarantined(self, seq: int, reason: str) -> None:
        self.quarantined = [*self.quarantined[-99:], (seq, reason)]
        self._quarantine.inc()
        self.stale = True
        log.error("world-log row quarantined on this manager; loading the world again", seq=seq, reason=reason[:300])

    async def _read_jobs(self) -> int:
        """Read back the jobs the applied rows named (a job whose layout names a GPU of a row not
        applied yet is read again after the next rows); how many were read."""
        if not self._jobs:
            return 0
        w = self.kernel.world
        read = 0
        async with self.sm() as s:
            for name in sorted(self._jobs):
                try:
                    rec = await load_job(s, name, w, self.clock.monotonic())
                except (KeyError, ValueError) as e:
                    log.info("job not readable yet; read again after the next rows", job=name, error=type(e).__name__)
                    continue
                if rec is None:
                    w.jobs.pop(name, None)
                else:
                    w.jobs[name] = rec
                self._jobs.discard(name)
                self.jobs_read += 1
                read += 1
        return read

    # ---- taking over ------------------------------------------------------------------------
    async def stop(self) -> None:
        await self._halt()
        await self._rows.close()

    async def _halt(self) -> None:
        task, self._task = self._task, None
        await cancel_all([task])
        self._lag.set(0)

    async def take_over(self) -> bool:
        """This manager took the lease: stop following and apply every row left. True when the
        world is current (then every node counts as just seen and not connected, as after a load);
        False when it must be loaded (never warm, stale, or a job could not be read)."""
        was = self._task is not None
        await self._halt()  # its kept connection reads what is left, then is closed
        try:
            return await self._take_over(was)
        finally:
            await self._rows.close()

    async def _take_over(self, was: bool) -> bool:
        if not was or not self.warm or self.stale:
            return False
        t0 = time.process_time()
        try:
            while await self.step() == BATCH:
                pass
            await self._read_jobs()
        except (OSError, SQLAlchemyError) as e:
            log.warning("cannot read the world log on taking over; loading the world", error=str(e)[:200])
            return False
        if self.stale or self._jobs:
            return False
        now = self.clock.monotonic()
        for n in self.kernel.world.nodes.values():
            n.last_seen, n.connected = now, False
        log.info("taking over on the followed world", cursor=self.cursor, cpu_s=round(time.process_time() - t0, 4))
        return True
