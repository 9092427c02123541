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
import os
import pickle
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import UTC, datetime
from typing import Any

import structlog

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec
from ntp_manager.planner.layout import COLUMNS, HEADER, LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.service.planning import planning
from ntp_manager.store import layout_codec as codec
from ntp_manager.topology import Cluster, Domain, Gpu, PowerLimits

log = structlog.get_logger(__name__)

KEEP = 16  # layouts each side keeps under tokens (least recently used dropped)
NO_POS = -(2**63)  # a GPU the manager has no position for (the codec then refuses it)
KEEP_SHAPES = 2  # cluster shapes (~20-30 MB each at 100K GPUs) each side keeps
Variant = tuple[GpuState, PowerLimits, "float | None"]


class Missing(Exception):
    """The worker does not hold a piece the call named by token (`args[0]`: "shape" or "doc")."""


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
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_worker_init)
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
        if kill:
            for p in list(pool._processes.values()):
                p.kill()
        pool.shutdown(wait=False, cancel_futures=True)

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
            await self._call(_ready)
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
            shape_msg = await asyncio.to_thread(_shape_blobs, cluster, pos_of) if shape_new else None
            self.calls += 1
            self.shapes_sent += shape_new
            variants = await self._variants_of(cluster)
            prev: tuple[int, list[bytes] | None, int, int] | None = None
            if previous is not None:
                doc_tok, doc_new = self._sent.token(self._sent.docs, previous.doc)
                blobs = await asyncio.to_thread(pack_doc, previous.doc, cluster) if doc_new else None
                self.docs_sent += doc_new
                prev = (doc_tok, blobs, previous.version, previous.chain)
            out_tok = next(self._sent.tokens)
            try:
                res = await self._call(_work, shape_tok, shape_msg, variants, spec, prev, reason, out_tok, drafting,
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
            doc = await asyncio.to_thread(unpack_doc, blobs, cluster)
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
        shape_msg = await asyncio.to_thread(_shape_blobs, cluster, pos_of) if shape_new else None
        sends: list[tuple[int, list[bytes]]] = []
        for doc in docs:
            tok, new = self._sent.token(self._sent.docs, doc)
            if new:
                sends.append((tok, await asyncio.to_thread(pack_doc, doc, cluster)))
        if shape_msg is None and not sends:
            return 0
        variants = await self._variants_of(cluster)
        try:
            await self._call(_prime, shape_tok, shape_msg, variants, sends)
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


def cluster_shape(cluster: Cluster) -> object:
    """The object every snapshot with the same GPUs shares (its look-ups)."""
    shape = cluster._shape
    assert shape is not None
    return shape


def _shape_blobs(cluster: Cluster, pos_of: codec.PosOf) -> list[bytes]:
    """The cluster's shape, pickled piece by piece: name, domain ids, sizes, UUIDs, nodes, GPU
    indices, and (for encoding) the manager's position of every GPU (NO_POS where it has none)."""
    nodes, idx = [], array("i")
    for g in cluster.gpus():
        nodes.append(g.node)
        idx.append(g.index)
    pos = array("q")
    for u in cluster.flat_uuids:
        try:
            pos.append(pos_of(u))
        except KeyError:
            pos.append(NO_POS)
    return [pickle.dumps(x, pickle.HIGHEST_PROTOCOL) for x in
            (cluster.name, cluster.domain_ids, cluster.domain_sizes, cluster.flat_uuids, tuple(nodes))] + \
        [idx.tobytes(), pos.tobytes()]


MAX_VARIANTS = 4096  # a table of variants grows (append only) up to this, then starts again


def gpu_variants(cluster: Cluster, known: Sequence[Variant] = ()
                 ) -> tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]]:
    """Every GPU's (state, power envelope, speed) as an index (4 bytes) into a table of the
    distinct ones, and the domains' power budgets. The table starts as `known` (the last one sent)
    and only grows: a state that appears for the first time (the first failed GPU) is added at the
    end, so the codes of every other GPU stay as they were and the planner process rebuilds only
    the domains whose GPUs changed (renumbered from the start, the whole 100,000-GPU snapshot was
    rebuilt there: most of a takeover's first replan)."""
    table: dict[Variant, int] = {v: i for i, v in enumerate(known)}
    out = array("I")
    for g in cluster.gpus():
        key = (g.state, g.power, g.speed)
        k = table.get(key)
        if k is None:
            k = table[key] = len(table)
        out.append(k)
    return out.tobytes(), tuple(table), tuple(d.power_budget_w for d in cluster.domains)


def gpu_variants_since(cluster: Cluster, before: Cluster,
                       sent: tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]]
                       ) -> tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]]:
    """`gpu_variants(cluster, sent's table)` from what was sent for `before`, a snapshot of the
    same GPUs: only the domains that are not `before`'s own objects (those a state change
    replaced) are read again. O(domains + the changed domains' GPUs) instead of O(GPUs)."""
    blob, known, _ = sent
    codes = array("I")
    codes.frombytes(blob)
    table: dict[Variant, int] = {v: i for i, v in enumerate(known)}
    offsets = cluster.domain_offsets
    for k, (d, old) in enumerate(zip(cluster.domains, before.domains, strict=True)):
        if d is old:
            continue
        for i, g in enumerate(d.gpus, offsets[k]):
            key = (g.state, g.power, g.speed)
            c = table.get(key)
            if c is None:
                c = table[key] = len(table)
            codes[i] = c
    return codes.tobytes(), tuple(table), tuple(d.power_budget_w for d in cluster.domains)


def pack_doc(doc: LayoutDoc, cluster: Cluster) -> list[bytes]:
    """A layout as pickled pieces: its header, then each column, GPUs as flat cluster positions."""
    offsets = cluster.domain_offsets
    index = cluster._index
    flat = array("i", [offsets[d] + i for d, i in map(index.__getitem__, doc.gpus)])
    out = [pickle.dumps(tuple(getattr(doc, n) for n in HEADER), pickle.HIGHEST_PROTOCOL)]
    for c in COLUMNS:
        out.append(flat.tobytes() if c == "gpus" else pickle.dumps(getattr(doc, c), pickle.HIGHEST_PROTOCOL))
    return out


def unpack_doc(blobs: Sequence[bytes], cluster: Cluster) -> LayoutDoc:
    """`pack_doc`'s inverse (on a cluster with the same shape)."""
    header = pickle.loads(blobs[0])
    cols = []
    for c, b in zip(COLUMNS, blobs[1:], strict=True):
        if c == "gpus":
            flat = array("i")
            flat.frombytes(b)
            cols.append(tuple(map(cluster.flat_uuids.__getitem__, flat)))
        else:
            cols.append(pickle.loads(b))
    return LayoutDoc.from_columns(header, tuple(cols))


# ---- the worker process -------------------------------------------------------------------------


class _Shape:
    def __init__(self, blobs: Sequence[bytes]) -> None:
        self.name, self.domain_ids, self.sizes, self.uuids, self.nodes = (pickle.loads(b) for b in blobs[:5])
        self.indices = array("i")
        self.indices.frombytes(blobs[5])
        self.positions = array("q")
        self.positions.frombytes(blobs[6])
        self.flat = {u: i for i, u in enumerate(self.uuids)}
        self.last: tuple[array[int], tuple[Variant, ...], tuple[float | None, ...], Cluster] | None = None

    def pos_of(self, uuid: str) -> int:
        p = self.positions[self.flat[uuid]]
        if p == NO_POS:
            raise KeyError(uuid)
        return p

    def cluster(self, variants: tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]]) -> Cluster:
        """The snapshot these states make, rebuilding only the domains whose GPUs changed."""
        blob, table, budgets = variants
        codes = array("I")
        codes.frombytes(blob)
        last = self.last
        if last is not None and last[0] == codes and last[1] == table and last[2] == budgets:
            return last[3]
        # the table only grows (gpu_variants): a code means the same variant as long as the last
        # table is a prefix of this one
        old = last[3] if last is not None and table[:len(last[1])] == last[1] else None
        domains: list[Domain] = []
        start = 0
        for k, (did, n) in enumerate(zip(self.domain_ids, self.sizes, strict=True)):
            end = start + n
            if old is not None and last is not None and last[0][start:end] == codes[start:end] \
                    and last[2][k] == budgets[k]:
                domains.append(old.domains[k])
            else:
                gpus = []
                for i in range(start, end):
                    state, power, speed = table[codes[i]]
                    gpus.append(Gpu(self.uuids[i], self.nodes[i], did, self.indices[i], state, power, speed))
                domains.append(Domain(did, tuple(gpus), budgets[k]))
            start = end
        c = Cluster(self.name, tuple(domains), old._shape if old is not None else None)
        self.last = (codes, table, budgets, c)
        return c


_shapes: OrderedDict[int, _Shape] = OrderedDict()
_docs: OrderedDict[int, LayoutDoc] = OrderedDict()


def _worker_init() -> None:
    import gc

    _exit_with_parent()
    gc.freeze()  # the imported modules are never garbage; later collections skip them


def _exit_with_parent() -> None:
    """In the worker: end this process as soon as the manager that started it has ended, however
    it ended. A manager that exits normally shuts its pool down, but a SIGKILLed one (or one that
    leaves by `os._exit`) cannot, and the worker would wait on its call queue for ever: it holds
    that queue's write end itself, so it never sees end of file there. The resource tracker (and
    the forkserver, when the worker came from one) stays up while any process it served holds its
    pipe (this worker does), so they all stayed behind, adopted by init. `parent_process().sentinel`
    is a pipe whose only write end the parent holds (multiprocessing keeps it for this, with spawn
    and forkserver alike): it reads as closed once the manager is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing (no parent to outlive)
        return

    def watch() -> None:
        parent.join()  # returns once the sentinel is closed: the manager has ended
        os._exit(0)

    threading.Thread(target=watch, name="planner-parent-watch", daemon=True).start()


def _ready() -> None:
    """In the worker: nothing (`warm` waits for the worker to have started and imported this)."""


def _keep(table: OrderedDict[int, Any], tok: int, value: Any, keep: int = KEEP) -> None:
    table[tok] = value
    table.move_to_end(tok)
    while len(table) > keep:
        table.popitem(last=False)


def _prime(shape_tok: int, shape_msg: list[bytes] | None,
           variants: tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]],
           docs: list[tuple[int, list[bytes]]]) -> None:
    """In the worker: keep a shape and layouts under their tokens (`PlanProcess.prime`)."""
    if shape_msg is not None:
        _keep(_shapes, shape_tok, _Shape(shape_msg), KEEP_SHAPES)
    shape = _shapes.get(shape_tok)
    if shape is None:
        raise Missing("shape")
    cluster = shape.cluster(variants)
    for tok, blobs in docs:
        _keep(_docs, tok, unpack_doc(blobs, cluster))


def _work(shape_tok: int, shape_msg: list[bytes] | None,
          variants: tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]], spec: JobSpec,
          prev: tuple[int, list[bytes] | None, int, int] | None, reason: str, out_tok: int,
          drafting: bool, step: int | None) -> tuple[list[bytes], Any]:
    """In the worker: plan (and with `drafting`, compare and encode) on the shape `shape_tok`."""
    if shape_msg is not None:
        _keep(_shapes, shape_tok, _Shape(shape_msg), KEEP_SHAPES)
    shape = _shapes.get(shape_tok)
    if shape is None:
        raise Missing("shape")
    _shapes.move_to_end(shape_tok)
    cluster = shape.cluster(variants)
    previous: LayoutRec | None = None
    if prev is not None:
        doc_tok, blobs, version, chain = prev
        if blobs is not None:
            _keep(_docs, doc_tok, unpack_doc(blobs, cluster))
        pdoc = _docs.get(doc_tok)
        if pdoc is None:
            raise Missing("doc")
        previous = LayoutRec("", version, 0, pdoc, "", datetime.now(UTC), 0.0, chain)
    if drafting:
        d = planning.draft(cluster, spec, previous, shape.pos_of, reason, step)
        doc, rest = d.doc, (d.unchanged, None if d.encoded is None else
                            (d.encoded.body, d.encoded.base_version, d.encoded.chain), d.summary, d.why, d.restore)
    else:
        doc, rest = planning.plan_layout(cluster, spec), None
    _keep(_docs, out_tok, doc)
    return pack_doc(doc, cluster), rest


_shared: dict[bool, PlanProcess] = {}


def shared(enabled: bool = True) -> PlanProcess:
    """The planner process of this process (one worker for every manager in it), or a planner
    that works in threads (`enabled` False)."""
    p = _shared.get(enabled)
    if p is None:
        p = _shared[enabled] = PlanProcess(enabled)
    return p
