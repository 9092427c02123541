"""A job's checkpoints as the manager sees them: read from the directory its spec names.

The workers write unit-addressed checkpoints under the spec's `checkpoint.dir` (a shared
filesystem); the manager reads the same directory when it can see it (ntp_manager/contract/checkpoint_format.py:
names, manifests, sizes; no torch, no shard contents). Two uses:

- operators list them (`ntpctl checkpoints`, GET /v1/jobs/{name}/checkpoints): step, time,
  complete, verified, size, and why one does not verify;
- the planner is told the newest verified step, so that a layout in which no surviving GPU holds
  some unit carries the step the workers restore from (planner/restore.py).

File I/O never runs on the event loop: a listing runs in a worker thread, at most
`CONCURRENT` at a time, and is given up after `TIMEOUT_S` (a hung network filesystem must not
stall the API or the control loop; the thread finishes on its own). A manager that cannot see the
directory lists nothing and tells the planner nothing: the workers then pick the checkpoint
themselves (the newest that verifies).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from ntp_manager.contract.checkpoint_format import Listing, list_checkpoints
from ntp_manager.service.core.errors import FailedPrecondition, NotFound
from ntp_manager.service.core.kernel import Kernel

log = structlog.get_logger("ntp.checkpoints")

TIMEOUT_S = 5.0
CONCURRENT = 2
LIST_MAX = 1000


class Checkpoints:
    def __init__(self, kernel: Kernel, timeout_s: float = TIMEOUT_S) -> None:
        self.kernel = kernel
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(CONCURRENT)

    def _dir(self, job: str) -> str:
        rec = self.kernel.world.jobs.get(job)
        if rec is None:
            raise NotFound(f"unknown job {job!r}")
        policy = rec.spec.checkpoint
        if policy is None:
            raise FailedPrecondition(f"job {job!r} has no checkpoint block in its spec (checkpoint.dir)")
        return policy.dir

    async def _listing(self, root: str, limit: int, verified_only: bool) -> Listing:
        """The listing off the loop, bounded in time and in concurrent threads. Raises
        FailedPrecondition when the directory cannot be read or does not answer in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except TimeoutError:
            raise FailedPrecondition(f"checkpoint.dir {root}: earlier listings have not finished "
                                     f"(a slow or hung filesystem?)") from None
        work = asyncio.ensure_future(asyncio.to_thread(list_checkpoints, root, limit, verified_only=verified_only))
        work.add_done_callback(lambda _: self._slots.release())  # when the thread ends, not when we stop waiting
        try:
            return await asyncio.wait_for(asyncio.shield(work), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise FailedPrecondition(f"checkpoint.dir {root}: no answer within {self.timeout_s:g} s") from None
        except OSError as e:
            raise FailedPrecondition(f"checkpoint.dir {root}: {e.strerror or type(e).__name__}") from None

    async def list(self, job: str, limit: int = 100) -> dict[str, Any]:
        """The newest `limit` checkpoints of `job`, newest first. NotFound for an unknown job,
        FailedPrecondition without a checkpoint block or when the directory cannot be read."""
        root = self._dir(job)
        listing = await self._listing(root, max(1, min(limit, LIST_MAX)), False)
        return {"job": job, **listing.view(),
                "verified_means": "manifest intact (its own SHA-256) and every file present at its recorded size; "
                                  "shard contents are hashed by the workers when they load"}

    async def newest_verified(self, job: str) -> int | None:
        """The newest verified step of `job`'s checkpoints, or None (no checkpoint block, none
        verified, or the directory cannot be read: logged). Never raises for the directory."""
        rec = self.kernel.world.jobs.get(job)
        if rec is None or rec.spec.checkpoint is None:
            return None
        try:
            return (await self._listing(rec.spec.checkpoint.dir, 1, True)).newest_verified()
        except FailedPrecondition as e:
            log.warning("checkpoints not readable", job=job, error=e.message)
            return None
