"""The planner process's side, and what crosses to it (service/planning/planproc.py runs it).

What crosses the pipe is kept compact and cut in pieces, each a short C call for the manager: a
cluster's shape once per shape (UUIDs, nodes, GPU indices, the manager's positions) kept by the
worker under a token; per call, every GPU's (state, power envelope, speed) as a 4-byte index into
a table of the distinct ones, a table that only grows (a state seen for the first time keeps every
other GPU's index); layouts as their columns, GPUs as positions in the cluster's flat order. The
worker keeps what it was sent and what it made under tokens; a token it no longer holds is
answered with `Missing`, and the call repeated with the full piece.

The worker builds its snapshot from the shape and the indices, rebuilding only the domains whose
GPUs' indices changed since its last call, and runs `planning.draft` (or `plan_layout`) on it.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import pickle
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec
from ntp_manager.planner.layout import COLUMNS, HEADER, LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.service.planning import planning
from ntp_manager.store import layout_codec as codec
from ntp_manager.topology import Cluster, Domain, Gpu, PowerLimits

KEEP = 16  # layouts each side keeps under tokens (least recently used dropped)
NO_POS = -(2**63)  # a GPU the manager has no position for (the codec then refuses it)
KEEP_SHAPES = 2  # cluster shapes (~20-30 MB each at 100K GPUs) each side keeps
Variant = tuple[GpuState, PowerLimits, "float | None"]
P = ParamSpec("P")
T = TypeVar("T")


class Missing(Exception):
    """The worker does not hold a piece the call named by token (`args[0]`: "shape" or "doc")."""


def cluster_shape(cluster: Cluster) -> object:
    """The object every snapshot with the same GPUs shares (its look-ups)."""
    shape = cluster._shape
    assert shape is not None
    return shape


def shape_blobs(cluster: Cluster, pos_of: codec.PosOf) -> list[bytes]:
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
    flat = array("i", map(cluster.flat_index.__getitem__, doc.gpus))
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


class Shape:
    def __init__(self, blobs: Sequence[bytes]) -> None:
        self.name, self.domain_ids, self.sizes, self.uuids, self.nodes = (pickle.loads(b) for b in blobs[:5])
        self.indices = array("i")
        self.indices.frombytes(blobs[5])
        self.positions = array("q")
        self.positions.frombytes(blobs[6])
        self.flat: Mapping[str, int] = {}  # UUID -> flat position: the first snapshot's index (`cluster`)
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
        # every snapshot of this shape shares the first one's look-ups (the same GPUs, in order)
        first = last[3] if last is not None else None
        c = Cluster(self.name, tuple(domains), first._shape if first is not None else None)
        if first is None:
            self.flat = c.flat_index  # also what pack_doc maps GPUs with: one table, not two
        self.last = (codes, table, budgets, c)
        return c


_shapes: OrderedDict[int, Shape] = OrderedDict()
_docs: OrderedDict[int, LayoutDoc] = OrderedDict()


def worker_init() -> None:
    _exit_with_parent()
    gc.freeze()  # the imported modules are never garbage; later collections skip them
    # Calls run with the collector off (`_no_gc`); between them, collect the young generation
    # rarely, as the manager does (server.py): a 96,000-GPU draft allocates ~90K tracked objects.
    gc.set_threshold(50_000, 20, 20)


def _no_gc(fn: Callable[P, T]) -> Callable[P, T]:
    """In the worker: `fn` with automatic garbage collection off while it runs. A draft makes
    little cyclic garbage, but with the collector on, the ~120 collections its allocations set off
    (a few of them of the oldest generation, which holds the cluster shapes and layouts kept here)
    were a sixth of a 96,000-GPU draft's CPU, in the middle of a takeover."""
    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return offloop.paused(functools.partial(fn, *args, **kwargs))
    return run


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


def ready() -> None:
    """In the worker: nothing (`warm` waits for the worker to have started and imported this)."""


def _keep(table: OrderedDict[int, Any], tok: int, value: Any, keep: int = KEEP) -> None:
    table[tok] = value
    table.move_to_end(tok)
    while len(table) > keep:
        table.popitem(last=False)


@_no_gc
def prime_worker(shape_tok: int, shape_msg: list[bytes] | None,
           variants: tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]],
           docs: list[tuple[int, list[bytes]]]) -> None:
    """In the worker: keep a shape and layouts under their tokens (`PlanProcess.prime`)."""
    if shape_msg is not None:
        _keep(_shapes, shape_tok, Shape(shape_msg), KEEP_SHAPES)
    shape = _shapes.get(shape_tok)
    if shape is None:
        raise Missing("shape")
    cluster = shape.cluster(variants)
    for tok, blobs in docs:
        _keep(_docs, tok, unpack_doc(blobs, cluster))


@_no_gc
def work(shape_tok: int, shape_msg: list[bytes] | None,
          variants: tuple[bytes, tuple[Variant, ...], tuple[float | None, ...]], spec: JobSpec,
          prev: tuple[int, list[bytes] | None, int, int] | None, reason: str, out_tok: int,
          drafting: bool, step: int | None) -> tuple[list[bytes], Any]:
    """In the worker: plan (and with `drafting`, compare and encode) on the shape `shape_tok`."""
    if shape_msg is not None:
        _keep(_shapes, shape_tok, Shape(shape_msg), KEEP_SHAPES)
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
