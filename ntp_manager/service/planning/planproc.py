"""Planning in a process of its own, so that the planner's object churn never holds the event loop.

A worker thread (service/core/offloop.py) keeps the loop answering only while it gives the GIL up, and
planning a job of 100K one-GPU replicas makes and frees about a million Python objects (the
planner's per-replica records, the layout's records while it is compared and encoded): freeing a
list of them, or a garbage collection over them, is one C call that holds the GIL whichever
thread makes it. That held the manager's loop 0.1-1.6 s per replan on the bench VM. So the whole
replan (plan, typed layout, comparison with the running one, stored body, audit summary) runs in
one long-lived worker process (a `ProcessPoolExecutor` of one, spawned: never a fork of a threaded
manager, and not the process-wide forkserver either, whose preload list belongs to whoever starts
it first: a test process's rank processes preload torch through it), and what crosses the pipe
is kept compact and cut in pieces that are each a short C call for this process:

- the cluster's shape (UUIDs, nodes, GPU indices, the manager's GPU positions) is sent once per
  shape (a registration makes a new one) and kept by the worker under a token; each call sends the
  GPUs' states, power envelopes and speeds as one index per GPU into a table of the distinct ones;
- a layout goes both ways as its columns, each pickled on its own, GPUs as positions in the
  cluster's flat order (4 bytes each) instead of UUID strings; the worker keeps the layouts it made
  (and the ones it was sent) under tokens, so a replan sends only the running layout's token;
- a token the worker no longer holds (it restarted, or evicted it) is answered with `Missing` and
  the call is repeated with the full piece.

Pickling and unpickling the pieces on this side run in a worker thread, one piece per C call, so
the loop gets the GIL between pieces. Where a process cannot be started (no `spawn`,
a sandbox), or `plan_process` is off, the same work runs in a thread as before (`offloop`), with
a warning. The planner is pure: both ways give the same layout, body and summary.

The worker ends when the manager does, however it ends (SIGKILL included: `_exit_with_parent`),
and with it the resource tracker that multiprocessing started for it.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import structlog

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.service.planning import planning
from ntp_manager.service.planning.planwire import (
    KEEP,
    KEEP_SHAPES,
    MAX_VARIANTS,
    Missing,
    Variant,
    cluster_shape,
    gpu_variants,
    gpu_variants_since,
    pack_doc,
    prime_worker,
    ready,
    shape_blobs,
    unpack_doc,
    work,
    worker_init,
)
from ntp_manager.store import layout_codec as codec
from ntp_manager.topology import Cluster

log = structlog.get_logger(__name__)

# the wire format and the worker's side: service/planning/planwire.py


# ---- this side ----------------------------------------------------------------------------------


# Tokens are unique for the life of this process, across workers: a record of what a worker holds
# is started afresh with each worker, but a call answered by the old one can still adopt its
# result into the new record; had the numbering restarted, that token could name another layout
# in the new worker, and a draft would use it as the previous layout.
_TOKENS = itertools.count(1)


class _Sent:
    """What this process has sent the current worker, by object identity (strong references, so
    an id is not reused while it is here): cluster shapes and layouts, each with its token."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.shapes: OrderedDict[int, tuple[object, int]] = OrderedDict()
        self.docs: OrderedDict[int, tuple[LayoutDoc, int]] = OrderedDict()
        self.tokens = _TOKENS

    def token(self, table: OrderedDict[int, Any], obj: Any) -> tuple[int, bool]:
        """`obj`'s token, and whether it is new (the worker has not been sent it)."""
        keep = KEEP_SHAPES if table is self.shapes else KEEP
        with self.lock:
            hit = table.get(id(obj))
            if hit is not None and hit[0] is obj:
                table.move_to_end(id(obj))
                return hit[1], False
            tok = next(self.tokens)
            table[id(obj)] = (obj, tok)
            while len(table) > keep:
                table.popitem(last=False)
            return tok, True

    def adopt(self, doc: LayoutDoc, tok: int) -> None:
        with self.lock:
            self.docs[id(doc)] = (doc, tok)
            while len(self.docs) > KEEP:
                self.docs.popitem(last=False)

    def forget(self, table: OrderedDict[int, Any], obj: Any) -> None:
        with self.lock:
            table.pop(id(obj), None)


class PlanProcess:
    """The manager's planner process (started on first use; shared by every manager of this
    process). `draft` and `plan` are `planning.draft` and `planning.plan_layout` run there."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pool: ProcessPoolExecutor | None = None
        self._running: set[Future[Any]] = set()
        self._sent = _Sent()
        self._variants: tuple[Cluster, tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]]] | None = None
        self.calls = 0  # plans and drafts sent to the worker
        self.shapes_sent = 0  # cluster shapes sent with them (a replan ships only the states when 0)
        self.docs_sent = 0  # running layouts sent with them

    # -- the pool --
    def _executor(self) -> ProcessPoolExecutor | None:
        if not self.enabled:
            return None
        if self._pool is None:
            try:
                ctx = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=worker_init)
            except (OSError, ValueError, NotImplementedError, ImportError) as e:
                log.warning("planner process unavailable: planning in a thread", error=repr(e))
                self.enabled = False
                return None
        return self._pool

    def close(self, kill: bool = False) -> None:
        """Let the worker go (`kill`: at once, even mid-plan), and the record of what it holds."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        self._sent = _Sent()
        killed = list(pool._processes.values()) if kill else []
        for p in killed:
            p.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        if killed:
            for p in killed:
                p.join(5)
            _seal(pool, force=True)  # a pool whose worker was killed before it was sealed

    def stop(self) -> None:
        """At a manager's shutdown: a plan still running in the worker (a replan or dry run whose
        caller is gone) would hold the interpreter's exit until it ends, so the worker is killed
        then; an idle one stays for the next manager of this process."""
        if any(not f.done() for f in list(self._running)):
            self.close(kill=True)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        pool = self._executor()
        assert pool is not None
        try:
            # in a thread: the first submit starts the worker process, which waits for it to run
            try:
                fut = await asyncio.to_thread(pool.submit, fn, *args)
            except RuntimeError:  # "cannot schedule new futures after shutdown"
                if pool is self._pool:
                    raise
                # stop() (another manager's shutdown) closed the pool between our lookup and the
                # submit: as for a call it cancelled in the queue, a new worker serves this one
                log.info("planner process stopped before a call reached it: a new one serves it")
                raise Missing("restarted") from None
            _seal(pool)
            self._running.add(fut)
            fut.add_done_callback(self._running.discard)
            try:
                return await asyncio.wrap_future(fut)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not fut.cancelled() or (task is not None and task.cancelling()):
                    raise  # our caller was cancelled
                # the pool was shut down (stop() at another manager's shutdown) while this call
                # still waited in its queue: not our caller's cancellation, so a new worker serves
                # it (the old pool is gone already: closing again could hit a successor)
                log.info("planner process stopped before it took a call: a new one serves it")
                raise Missing("restarted") from None
        except BrokenProcessPool:  # the worker died (killed, out of memory): one new one, from scratch
            log.warning("planner process died: starting a new one", exc_info=True)
            if pool is self._pool:  # not a successor another call has started already
                self.close()
            raise Missing("restarted") from None

    async def warm(self) -> None:
        """Start the worker process now, ahead of the first plan (a standby does, so that its first
        replans as the new leader do not wait for a process to start and import the planner)."""
        if self._executor() is None:
            return
        try:
            await self._call(ready)
        except Exception as e:  # it is started again on first use
            log.warning("could not start the planner process ahead of use", error=repr(e))

    # -- the work --
    async def plan(self, cluster: Cluster, spec: JobSpec, pos_of: codec.PosOf, fail: tuple[str, ...] = ()) -> LayoutDoc:
        """`planning.plan_layout(cluster, spec, fail)`: PlanError or TopologyError as it raises.
        (`pos_of`: the manager's GPU positions, sent with a new cluster shape for later drafts.)"""
        if self._executor() is None:
            return await offloop.run(planning.plan_layout, cluster, spec, fail)
        if fail:  # up to 100K GPUs, a record each: in a thread
            cluster = await offloop.run(cluster.with_states, dict.fromkeys(fail, GpuState.FAILED))
        out = await self._run(cluster, spec, None, "", pos_of, drafting=False)
        return out[0]

    async def draft(self, cluster: Cluster, spec: JobSpec, previous: LayoutRec | None, pos_of: codec.PosOf,
                    reason: str = "", checkpoint_step: int | None = None) -> planning.Draft:
        """`planning.draft(...)`, in the planner process (in a thread where there is none)."""
        if self._executor() is None:
            return await offloop.run(planning.draft, cluster, spec, previous, pos_of, reason, checkpoint_step)
        doc, rest = await self._run(cluster, spec, previous, reason, pos_of, drafting=True, step=checkpoint_step)
        unchanged, encoded, summary, why, restore = rest
        return planning.Draft(doc, unchanged, None if encoded is None else planning.Encoded(*encoded), summary, why,
                              restore)

    async def _run(self, cluster: Cluster, spec: JobSpec, previous: LayoutRec | None, reason: str,
                   pos_of: codec.PosOf, drafting: bool, step: int | None = None) -> tuple[LayoutDoc, Any]:
        shape = cluster_shape(cluster)
        for attempt in range(3):
            shape_tok, shape_new = self._sent.token(self._sent.shapes, shape)
            shape_msg = await offloop.run(shape_blobs, cluster, pos_of) if shape_new else None
            self.calls += 1
            self.shapes_sent += shape_new
            variants = await self._variants_of(cluster)
            prev: tuple[int, list[bytes] | None, int, int] | None = None
            if previous is not None:
                doc_tok, doc_new = self._sent.token(self._sent.docs, previous.doc)
                blobs = await offloop.run(pack_doc, previous.doc, cluster) if doc_new else None
                self.docs_sent += doc_new
                prev = (doc_tok, blobs, previous.version, previous.chain)
            out_tok = next(self._sent.tokens)
            try:
                res = await self._call(work, shape_tok, shape_msg, variants, spec, prev, reason, out_tok, drafting,
                                       step)
            except Missing as e:
                if e.args and e.args[0] == "doc" and previous is not None:
                    self._sent.forget(self._sent.docs, previous.doc)
                else:
                    self._sent.forget(self._sent.shapes, shape)
                if attempt == 2:
                    raise RuntimeError("planner process kept losing what it was sent") from None
                continue
            blobs, rest = res
            doc = await offloop.run(unpack_doc, blobs, cluster)
            self._sent.adopt(doc, out_tok)
            return doc, rest
        raise AssertionError("unreachable")

    async def prime(self, cluster: Cluster, pos_of: codec.PosOf, docs: Sequence[LayoutDoc]) -> int:
        """Send the worker this cluster's shape and these layouts now, ahead of any plan (a standby
        following the leader does, so that its first replans as the new leader ship only the
        GPUs' states). Each is sent once (by identity, as `_run` does); how many pieces were sent.
        A worker lost meanwhile is not an error: the next plan sends what it needs."""
        if self._executor() is None:
            return 0
        shape_tok, shape_new = self._sent.token(self._sent.shapes, cluster_shape(cluster))
        shape_msg = await offloop.run(shape_blobs, cluster, pos_of) if shape_new else None
        sends: list[tuple[int, list[bytes]]] = []
        for doc in docs:
            tok, new = self._sent.token(self._sent.docs, doc)
            if new:
                sends.append((tok, await offloop.run(pack_doc, doc, cluster)))
        if shape_msg is None and not sends:
            return 0
        variants = await self._variants_of(cluster)
        try:
            await self._call(prime_worker, shape_tok, shape_msg, variants, sends)
        except (Missing, RuntimeError):
            self._sent.forget(self._sent.shapes, cluster_shape(cluster))
            for doc in docs:
                self._sent.forget(self._sent.docs, doc)
            return 0
        return (shape_msg is not None) + len(sends)

    async def _variants_of(self, cluster: Cluster) -> tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]]:
        last = self._variants
        if last is not None and last[0] is cluster:
            return last[1]
        if last is not None and len(last[1][1]) < MAX_VARIANTS and cluster_shape(last[0]) is cluster_shape(cluster):
            v = await offloop.run(gpu_variants_since, cluster, last[0], last[1])
        else:
            v = await offloop.run(gpu_variants, cluster, last[1][1] if last is not None and
                                  len(last[1][1]) < MAX_VARIANTS else ())
        self._variants = (cluster, v)
        return v


def _seal(pool: ProcessPoolExecutor, force: bool = False) -> None:
    """Close this process's write end of the pool's result pipe once the pool's one worker runs
    (`force`: whether or not it does). A worker that dies while it writes a result (killed by
    `close`, or by the kernel for memory) leaves part of it in the pipe, and the pool's thread,
    which waits for the rest, then blocked for ever: the caller never heard back (no plan again)
    and the interpreter's exit waited on that thread. The pool never writes to that pipe here; it
    holds the write end only to hand it to the workers it starts, and with one worker and no
    `max_tasks_per_child` it starts no other. With only the worker's end open, its death reads as
    end of file: the pool breaks and its callers get BrokenProcessPool (a new worker serves them)."""
    # private to concurrent.futures and multiprocessing (as `_processes` above): where a Python
    # lays them out otherwise, nothing is sealed and a worker's death mid-send is as before
    results = getattr(pool, "_result_queue", None)
    writer = getattr(results, "_writer", None)
    if writer is None or (not force and not getattr(pool, "_processes", None)):
        return
    if not writer.closed:
        writer.close()


_shared: dict[bool, PlanProcess] = {}


def shared(enabled: bool = True) -> PlanProcess:
    """The planner process of this process (one worker for every manager in it), or a planner
    that works in threads (`enabled` False)."""
    p = _shared.get(enabled)
    if p is None:
        p = _shared[enabled] = PlanProcess(enabled)
    return p
