"""The one transport seam of the worker: every collective and point-to-point message of the
runtime (TP all-reduces, the NTP sync's transfers and bucket all-reduces, the reshard's moves, the
regroup exchanges and the peer fetch) goes through the functions here, which decide how the bytes
travel for the group's backend and the tensor's device.

- NCCL with device tensors: native, nothing copied. A CPU tensor on an NCCL group (the runtime's
  small commit votes and step counters) goes through a device copy, since NCCL carries device
  memory only. Point-to-point messages posted together go as one NCCL group
  (`batch_isend_irecv`), so a ring of sends cannot deadlock on NCCL's in-order streams.
- gloo with device (CUDA) tensors: staged through host buffers -- device -> host before a send or
  all-reduce, host -> device after a receive. gloo's point-to-point path hands the tensor's data
  pointer to a socket, which for device memory fails (`writev ... Bad address`, issue 15), so no
  device tensor ever reaches it. Host buffers are pinned (only where CUDA is available: CPU builds
  cannot pin) and reused per (size, dtype) through a small pool. The copies are synchronous: a
  device -> host copy completes before the send reads the buffer, and a host -> device copy
  completes before the buffer goes back to the pool, so no buffer is reused under a copy in flight.
- gloo with CPU tensors: native, unless staging is forced (`configure(force_staging=True)` or
  NTP_COMM_FORCE_STAGING=1, for tests): then the staged path above runs with CPU tensors, copying
  into separate host buffers (never aliases of the tensor), so CI exercises the exact code a GPU
  without NCCL runs.

`choose_backend` (pure) decides the backend for a device and a host's ranks and refuses, with the
reason, a combination that cannot work. `shrink_plan` (pure) decides whether a new layout's
communicator can be shrunk from the old one (NCCL's ncclCommShrink, `dist.shrink_group`) instead of
being created from nothing. `detect_features` feature-tests the installed torch (attributes and
signatures, never version strings).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from ntp_manager.worker.comm_setup import (  # set-up decisions, kept importable from here
    NCCL_ENV,
    BackendChoice,
    BackendError,
    CommFeatures,
    CommPlan,
    agree,
    arrival_keys,
    can_shrink,
    check_nccl_env,
    choose_backend,
    detect_features,
    device_index,
    publish_held,
    settle,
    shrink_plan,
)

__all__ = [
    "NCCL_ENV",
    "BackendChoice",
    "BackendError",
    "CommFeatures",
    "CommPlan",
    "agree",
    "arrival_keys",
    "can_shrink",
    "check_nccl_env",
    "choose_backend",
    "detect_features",
    "device_index",
    "publish_held",
    "settle",
    "shrink_plan",
]

FORCE_STAGING_ENV = "NTP_COMM_FORCE_STAGING"
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"  # gloo_lazy_connections
POOL_BYTES = 512 << 20  # host staging buffers kept for reuse, at most
CHUNK_ENV = "NTP_COMM_CHUNK_BYTES"
CHUNK_BYTES = 16 << 20  # FlatExchange: bytes per message, at most (a peer pair's stream is cut into these)
CHUNK_LIMITS = (4 << 10, 1 << 30)  # the chunk sizes accepted
FLAT_POOL_BYTES = 512 << 20  # FlatExchange's chunk buffers kept across exchanges (and switches), at most


# ---- process-wide settings --------------------------------------------------------------------
class _Settings:
    def __init__(self) -> None:
        self.force_staging = os.environ.get(FORCE_STAGING_ENV, "") not in ("", "0")
        self.device: torch.device | None = None  # NCCL groups' device (None: the current CUDA device)
        self.chunk_bytes = _chunk_from_env(os.environ.get(CHUNK_ENV, ""))
        self.coalesce = True  # the reshard's moves through FlatExchange (False: one message per tensor slice)


def _chunk_from_env(raw: str) -> int:
    if not raw:
        return CHUNK_BYTES
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{CHUNK_ENV}={raw!r} is not a whole number of bytes") from None
    return _check_chunk(n, CHUNK_ENV)


def _check_chunk(n: int, name: str) -> int:
    lo, hi = CHUNK_LIMITS
    if not lo <= n <= hi:
        raise ValueError(f"{name}={n}: a message chunk must be between {lo} and {hi} bytes")
    return n


_settings = _Settings()


@dataclass
class Stats:
    staged_ops: int = 0  # operations that went through staging buffers
    staged_bytes: int = 0
    pool_hits: int = 0  # staging buffers reused from the pool
    p2p_messages: int = 0  # point-to-point messages posted (sends and receives), every path
    flat_bytes: int = 0  # bytes FlatExchange moved (sent and received)
    flat_messages: int = 0  # FlatExchange's messages (sent and received)
    flat_zero_copy: int = 0  # FlatExchange messages sent from / received into the tensors themselves


stats = Stats()


def configure(*, force_staging: bool | None = None, device: torch.device | str | None = None,
              pool_bytes: int | None = None, chunk_bytes: int | None = None, flat_pool_bytes: int | None = None,
              coalesce: bool | None = None) -> None:
    """Process-wide: `force_staging` runs gloo's staged path with CPU tensors too (tests);
    `device` is where NCCL groups carry CPU tensors; `pool_bytes` caps the staging buffers kept
    for reuse (a staged sync has its whole gradient chunk in flight at once, so a cap below that
    re-allocates pinned memory every step); `chunk_bytes` bounds FlatExchange's messages (also
    NTP_COMM_CHUNK_BYTES); `flat_pool_bytes` caps its chunk buffers kept across exchanges;
    `coalesce` False sends the reshard's moves one message per tensor slice (the old path, kept
    for comparison)."""
    if chunk_bytes is not None:
        _settings.chunk_bytes = _check_chunk(chunk_bytes, "chunk_bytes")
    if flat_pool_bytes is not None:
        _flat_pool.limit = flat_pool_bytes
    if coalesce is not None:
        _settings.coalesce = coalesce
    if force_staging is not None:
        _settings.force_staging = force_staging
    if device is not None:
        _settings.device = torch.device(device)
    if pool_bytes is not None:
        _pool.limit = pool_bytes


def staging_forced() -> bool:
    return _settings.force_staging


def _nccl_device() -> torch.device:
    if _settings.device is not None and _settings.device.type == "cuda":
        return _settings.device
    return torch.device("cuda", torch.cuda.current_device())


# ---- staging buffers --------------------------------------------------------------------------
class _Pool:
    """Free staging buffers by (elements, dtype, device). Pinned host memory where CUDA exists."""

    def __init__(self, limit: int = POOL_BYTES) -> None:
        self.limit = limit
        self.free: dict[tuple[int, torch.dtype, str], list[torch.Tensor]] = {}
        self.bytes = 0
        self.lock = threading.Lock()  # autograd runs a CUDA backward on its own thread

    def take(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (n, dtype, str(device))
        with self.lock:
            bufs = self.free.get(key)
            if bufs:
                buf = bufs.pop()
                self.bytes -= buf.numel() * buf.element_size()
                stats.pool_hits += 1
                return buf
        if device.type == "cpu":
            return torch.empty(n, dtype=dtype, pin_memory=torch.cuda.is_available())
        return torch.empty(n, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        size = buf.numel() * buf.element_size()
        with self.lock:
            if self.bytes + size > self.limit:
                return  # dropped: the pool keeps what fits
            self.free.setdefault((buf.numel(), buf.dtype, str(buf.device)), []).append(buf)
            self.bytes += size

    def clear(self) -> None:
        with self.lock:
            self.free.clear()
            self.bytes = 0


_pool = _Pool()
# FlatExchange's chunk buffers: a few sizes only (the chunk, or a power of two below it), so they
# stay useful from one layout to the next and are kept across switches (pinned memory is slow to
# allocate; a switch would otherwise pay for it every time)
_flat_pool = _Pool(FLAT_POOL_BYTES)


def release_buffers() -> None:
    """Forget the pooled staging buffers sized by the old layout's messages (a new layout has
    new message sizes; stale sizes would fill the pool and keep the new ones out). FlatExchange's
    chunk buffers are kept: their sizes do not depend on the layout."""
    _pool.clear()


def coalescing() -> bool:
    return _settings.coalesce


def chunk_bytes() -> int:
    return _settings.chunk_bytes


Route = Literal["direct", "host", "device"]


def backend_of(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def route(t: torch.Tensor, group: Any) -> Route:
    """How `t` travels on `group`: directly, staged through host memory (gloo with a device
    tensor, or forced), or through a device copy (NCCL with a CPU tensor)."""
    backend = backend_of(group)
    if backend == "nccl":
        return "device" if t.device.type == "cpu" else "direct"
    if t.device.type != "cpu" or _settings.force_staging:
        return "host"
    return "direct"


class _Staged:
    """A buffer standing in for `t` on the wire."""

    __slots__ = ("buf", "t")

    def __init__(self, t: torch.Tensor, where: Route, fill: bool) -> None:
        dev = torch.device("cpu") if where == "host" else _nccl_device()
        self.t = t
        self.buf = _pool.take(t.numel(), t.dtype, dev).view(t.shape)
        if fill:
            self.buf.copy_(t)  # synchronous: complete before the wire reads the buffer
        stats.staged_ops += 1
        stats.staged_bytes += t.numel() * t.element_size()

    def back(self) -> None:
        self.t.copy_(self.buf)  # synchronous (pinned -> device included): the buffer is free after

    def release(self) -> None:
        _pool.give(self.buf.view(-1))


class Work:
    """A pending operation; `wait()` completes it, copies staged results back and frees buffers.
    Waiting again does nothing."""

    def __init__(self, inner: Any, after: Callable[[], None] | None = None) -> None:
        self.inner, self.after, self.done = inner, after, False

    def wait(self) -> bool:
        if not self.done:
            if self.inner is not None:
                self.inner.wait()
            self.done = True
            if self.after is not None:
                self.after()
        return True


def _finish(staged: Sequence[_Staged], copy_back: Sequence[_Staged]) -> Callable[[], None]:
    def after() -> None:
        for s in copy_back:
            s.back()
        for s in staged:
            s.release()

    return after


# ---- collectives ------------------------------------------------------------------------------
@overload
def all_reduce(t: torch.Tensor, group: Any = ..., *, async_op: Literal[True]) -> Work: ...
@overload
def all_reduce(t: torch.Tensor, group: Any = ..., async_op: Literal[False] = ...) -> None: ...
def all_reduce(t: torch.Tensor, group: Any = None, async_op: bool = False) -> Work | None:
    """Sum `t` over `group` in place; with `async_op` a Work to wait on."""
    where = route(t, group)
    if where == "direct":
        w = dist.all_reduce(t, group=group, async_op=async_op)
        return Work(w) if async_op else None
    s = _Staged(t, where, fill=True)
    work = Work(dist.all_reduce(s.buf, group=group, async_op=True), _finish([s], [s]))
    if async_op:
        return work
    work.wait()
    return None


def broadcast(t: torch.Tensor, src: int, group: Any = None) -> None:
    """`t` from global rank `src` to every rank of `group`, in place."""
    where = route(t, group)
    if where == "direct":
        dist.broadcast(t, src=src, group=group)
        return
    mine = dist.get_rank() == src
    s = _Staged(t, where, fill=mine)
    dist.broadcast(s.buf, src=src, group=group)
    _finish([s], [] if mine else [s])()


def all_gather(out: list[torch.Tensor], t: torch.Tensor, group: Any = None) -> None:
    """Every rank's `t` into `out` (one tensor per rank of `group`, in group-rank order)."""
    where = route(t, group)
    if where == "direct" and all(route(o, group) == "direct" for o in out):
        dist.all_gather(out, t, group=group)
        return
    if where == "direct":
        where = "host" if backend_of(group) != "nccl" else "device"
    s = _Staged(t, where, fill=True)
    outs = [_Staged(o, where, fill=False) for o in out]
    dist.all_gather([o.buf for o in outs], s.buf, group=group)
    _finish([s, *outs], outs)()


def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
    """Picklable objects: torch moves them through the group's device itself (on NCCL, the
    current CUDA device, which the runtime sets)."""
    dist.all_gather_object(out, obj, group=group)


def broadcast_object_list(objs: list[Any], src: int, group: Any = None) -> None:
    dist.broadcast_object_list(objs, src=src, group=group)


# ---- point to point ---------------------------------------------------------------------------
@dataclass(frozen=True)
class P2P:
    send: bool  # True: send `tensor` to `peer`; False: receive into it from `peer`
    tensor: torch.Tensor
    peer: int  # global rank


def isend(t: torch.Tensor, dst: int, group: Any = None) -> Work:
    return exchange([P2P(True, t, dst)], group)[0]


def irecv(t: torch.Tensor, src: int, group: Any = None) -> Work:
    return exchange([P2P(False, t, src)], group)[0]


def exchange(ops: Sequence[P2P], group: Any = None) -> list[Work]:
    """Post point-to-point messages together; one Work per op, in order. On NCCL they form one
    group call (all issued at once, so no order of sends and receives across ranks can
    deadlock); on gloo each is its own message, staged where `route` says so. Both ends must
    list a pair's messages in the same order."""
    if not ops:
        return []
    staged: list[_Staged | None] = []
    for op in ops:
        where = route(op.tensor, group)
        staged.append(None if where == "direct" else _Staged(op.tensor, where, fill=op.send))
    bufs = [op.tensor if s is None else s.buf for op, s in zip(ops, staged, strict=True)]
    stats.p2p_messages += len(ops)
    if backend_of(group) == "nccl":
        p2p = [dist.P2POp(dist.isend if op.send else dist.irecv, b, op.peer, group)
               for op, b in zip(ops, bufs, strict=True)]
        inner: list[Any] = list(dist.batch_isend_irecv(p2p))
        if len(inner) != len(ops):  # NCCL coalesces the group into one work: wait on it for all
            inner = [inner[0] if inner else None] * len(ops)
    else:
        inner = [dist.isend(b, dst=op.peer, group=group) if op.send else dist.irecv(b, src=op.peer, group=group)
                 for op, b in zip(ops, bufs, strict=True)]
    out = []
    for op, s, w in zip(ops, staged, inner, strict=True):
        out.append(Work(w, None if s is None else _finish([s], [] if op.send else [s])))
    return out


def wait_all(works: Sequence[Any]) -> None:
    for w in works:
        w.wait()


# ---- coalesced point to point: the reshard's moves -----------------------------------------------
@dataclass
class _Stream:
    """Everything one rank sends to (or receives from) one peer in a FlatExchange: its tensors'
    bytes, back to back, in the order given; cut into chunks of at most `chunk` bytes."""

    peer: int
    send: bool
    tensors: list[torch.Tensor]  # the caller's tensors (for route and devices)
    pieces: list[torch.Tensor]  # their bytes: 1-D uint8, contiguous (a temporary for a strided receive)
    starts: list[int]  # byte offset of each piece in the stream
    total: int
    wire: torch.device  # where the chunks travel from (gloo: host memory; NCCL: a device)
    staged: bool  # comm's route for these tensors is not "direct" (counted as staged bytes)

    def chunks(self, size: int) -> int:
        return -(-self.total // size)

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """(piece, offset in piece, offset in chunk, bytes) covering stream bytes [lo, hi)."""
        out = []
        i = bisect.bisect_right(self.starts, lo) - 1
        pos = lo
        while pos < hi:
            while self.starts[i] + self.pieces[i].numel() <= pos:  # empty pieces are skipped
                i += 1
            off = pos - self.starts[i]
            n = min(hi, self.starts[i] + self.pieces[i].numel()) - pos
            out.append((i, off, pos - lo, n))
            pos += n
        return out


@dataclass
class _Chunk:
    stream: _Stream
    lo: int
    hi: int
    wire: torch.Tensor  # what goes on the wire: a pooled buffer, or a view of the tensor's bytes
    pooled: torch.Tensor | None  # the pooled buffer to give back (None: zero-copy)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (no copy)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


_side_streams: dict[torch.device, Any] = {}


def _side_stream(dev: torch.device) -> Any:
    if dev not in _side_streams:
        _side_streams[dev] = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
    return _side_streams[dev]


class FlatExchange:
    """Point-to-point messages coalesced per peer pair: everything this rank sends to one peer
    (and receives from it) travels as one byte stream, whatever the tensors' dtypes, cut into
    chunks of at most `chunk_bytes` -- one message per peer pair, direction and chunk instead of
    one per tensor. Chunk k of every stream goes in round k: under NCCL one `batch_isend_irecv`
    group call per round, under gloo an isend/irecv per chunk. While round k is on the wire the
    sends of round k+1 are packed and the receives of round k-1 unpacked.

    Chunk buffers come from a pool kept across exchanges (pinned host memory where CUDA exists).
    A chunk that is one contiguous stretch of one tensor already where the wire reads it (a CPU
    tensor on gloo without forced staging, a device tensor on NCCL) goes without a copy. Device
    <-> pinned host copies (CUDA tensors on gloo) run non-blocking on a side stream, each chunk's
    copies completed before its message is posted (sends) or its buffer reused (receives).

    Both ends must list a pair's tensors in the same order with the same sizes (the reshard
    computes both lists from the layouts); a receive target may be strided (it is received into
    a temporary and copied in at the end). `start()` posts round 0, `wait()` runs the rest."""

    def __init__(self, ops: Sequence[P2P], group: Any = None, chunk: int | None = None) -> None:
        self.group = group
        self.nccl = backend_of(group) == "nccl"
        self.chunk = _check_chunk(chunk, "chunk") if chunk is not None else _settings.chunk_bytes
        self.strided: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, contiguous temporary)
        by_pair: dict[tuple[int, bool], list[torch.Tensor]] = {}
        for op in ops:
            by_pair.setdefault((op.peer, op.send), []).append(op.tensor)
        self.streams = [self._stream(peer, send, ts) for (peer, send), ts in by_pair.items()]
        self.rounds = max((s.chunks(self.chunk) for s in self.streams), default=0)
        self.messages = sum(s.chunks(self.chunk) for s in self.streams)
        self.cuda_host = not self.nccl and any(t.device.type == "cuda" for s in self.streams for t in s.tensors)
        self._next = 0
        self._posted: tuple[list[_Chunk], list[Any]] | None = None
        self._staged: list[_Chunk] | None = None
        self._started = self._done = False

    def _stream(self, peer: int, send: bool, tensors: list[torch.Tensor]) -> _Stream:
        pieces, starts, pos = [], [], 0
        for t in tensors:
            if send:
                b = _bytes_of(t.contiguous())
            elif t.is_contiguous():
                b = _bytes_of(t)
            else:
                tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                self.strided.append((t, tmp))
                b = _bytes_of(tmp)
            pieces.append(b)
            starts.append(pos)
            pos += b.numel()
        first = tensors[0]
        cuda_first = first.device if first.device.type == "cuda" else None
        wire = (cuda_first or _nccl_device()) if self.nccl else torch.device("cpu")
        staged = any(route(t, self.group) != "direct" for t in tensors)
        return _Stream(peer, send, tensors, pieces, starts, pos, wire, staged)

    # -- one round ------------------------------------------------------------------------------
    def _take(self, n: int, wire: torch.device) -> torch.Tensor:
        size = self.chunk if n > self.chunk // 2 else max(4096, 1 << (n - 1).bit_length())
        return _flat_pool.take(size, torch.uint8, wire)

    def _prepare(self, k: int) -> list[_Chunk]:
        """Round k's chunks: buffers taken, sends packed (copies issued; on a side stream for
        CUDA tensors on gloo)."""
        out: list[_Chunk] = []
        side = None
        for s in self.streams:
            if k >= s.chunks(self.chunk):
                continue
            lo, hi = k * self.chunk, min(s.total, (k + 1) * self.chunk)
            segs = s.segments(lo, hi)
            if len(segs) == 1 and not s.staged and s.pieces[segs[0][0]].device == s.wire:
                i, off, _, n = segs[0]
                out.append(_Chunk(s, lo, hi, s.pieces[i][off : off + n], None))
                stats.flat_zero_copy += 1
                continue
            buf = self._take(hi - lo, s.wire)
            c = _Chunk(s, lo, hi, buf[: hi - lo], buf)
            out.append(c)
            if s.staged:
                stats.staged_ops += 1
                stats.staged_bytes += hi - lo
            if not s.send:
                continue
            for i, off, at, n in segs:
                src = s.pieces[i][off : off + n]
                if self.cuda_host and src.device.type == "cuda":
                    side = side or self._begin_side(src.device)
                    with torch.cuda.stream(side):
                        c.wire[at : at + n].copy_(src, non_blocking=True)
                else:
                    c.wire[at : at + n].copy_(src)
        if side is not None:
            side.synchronize()  # the packed bytes are in host memory before gloo reads them
        return out

    def _begin_side(self, dev: torch.device) -> Any:
        side = _side_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))  # what produced the tensors comes first
        return side

    def _post(self, chunks: list[_Chunk]) -> list[Any]:
        stats.p2p_messages += len(chunks)
        stats.flat_messages += len(chunks)
        stats.flat_bytes += sum(c.hi - c.lo for c in chunks)
        if self.nccl:
            ops = [dist.P2POp(dist.isend if c.stream.send else dist.irecv, c.wire, c.stream.peer, self.group)
                   for c in chunks]
            works = list(dist.batch_isend_irecv(ops)) if ops else []
            return works
        return [dist.isend(c.wire, dst=c.stream.peer, group=self.group) if c.stream.send
                else dist.irecv(c.wire, src=c.stream.peer, group=self.group) for c in chunks]

    def _complete(self, chunks: list[_Chunk], works: list[Any]) -> None:
        for w in works:
            w.wait()
        side = None
        for c in chunks:
            s = c.stream
            if not s.send and c.pooled is not None:
                for i, off, at, n in s.segments(c.lo, c.hi):
                    dst = s.pieces[i][off : off + n]
                    if self.cuda_host and dst.device.type == "cuda":
                        side = side or self._begin_side(dst.device)
                        with torch.cuda.stream(side):
                            dst.copy_(c.wire[at : at + n], non_blocking=True)
                    else:
                        dst.copy_(c.wire[at : at + n])
        if side is not None:
            side.synchronize()  # the buffers are free once the copies out of them are done
        for c in chunks:
            if c.pooled is not None:
                _flat_pool.give(c.pooled)

    # -- driving ----------------------------------------------------------------------------------
    def start(self) -> FlatExchange:
        """Post round 0 and pack round 1 (returns at once under gloo: the wire runs in the background)."""
        if self._started:
            return self
        self._started = True
        if self.rounds:
            self._advance()
        return self

    def _advance(self) -> None:
        chunks = self._staged if self._staged is not None else self._prepare(self._next)
        self._posted = (chunks, self._post(chunks))
        self._next += 1
        self._staged = self._prepare(self._next) if self._next < self.rounds else None

    def wait(self) -> None:
        """Run every round to the end; the receive targets hold their bytes after it returns."""
        if self._done:
            return
        self.start()
        while self._posted is not None:
            chunks, works = self._posted
            self._posted = None
            if self._staged is not None:
                # the next round goes on the wire before this one's bytes are copied out
                nxt = self._staged
                self._staged = None
                posted = (nxt, self._post(nxt))
                self._next += 1
                self._staged = self._prepare(self._next) if self._next < self.rounds else None
                self._complete(chunks, works)
                self._posted = posted
            else:
                self._complete(chunks, works)
        for t, tmp in self.strided:
            t.copy_(tmp)
        for dev in {t.device for s in self.streams for t in s.tensors if t.device.type == "cuda"}:
            if dev in _side_streams:
                torch.cuda.current_stream(dev).wait_stream(_side_streams[dev])
        self._done = True


# ---- process groups ---------------------------------------------------------------------------
def init_default_group(backend: str, store: Any, rank: int, world: int, timeout: Any,
                       device: torch.device | None, features: CommFeatures | None = None) -> None:
    """The version's default group. NCCL: error handling as the runtime needs it (NCCL_ENV, set
    before the communicator exists), communicator creation bounded by `timeout` too (NCCL's
    non-blocking mode with torch's timeout for it: a peer that dies between the rendezvous and
    ncclCommInitRank would otherwise hang the others there), unless the user set these
    variables; and, where torch supports it, eager initialisation bound to the rank's device --
    then every sub-group is split from this communicator (ncclCommSplit) rather than initialised
    from nothing. gloo: the group connects lazily (`gloo_lazy_connections`): nothing runs on it."""
    feats = features or detect_features()
    kwargs: dict[str, Any] = {}
    if backend == "gloo":
        with gloo_lazy_connections():
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return
    if backend == "nccl":
        check_nccl_env(os.environ)
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(timeout.total_seconds()))))
        if feats.eager_init and device is not None:
            kwargs["device_id"] = device
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)


@contextlib.contextmanager
def gloo_lazy_connections() -> Iterator[None]:
    """gloo groups created inside connect their pairs on first use instead of all at creation
    (`TORCH_GLOO_LAZY_INIT`, read by every ProcessGroupGloo when it is built). Only for a group
    that carries nothing -- the version's default group, a full mesh of every rank that would
    cost a connection per pair (most of a version's connections) and is never used, so none of
    its pairs ever connects. Groups that carry traffic stay eager: the passive side of gloo's
    lazy connect ignores the timeout (tcp Device::connectAsListener, pytorch/gloo#520), so a
    survivor's first use of a lazy pair whose peer died can hang, where an eager pair fails as
    soon as the peer's socket closes (tests/worker/test_comm.py). A value the user set is left
    alone."""
    if LAZY_ENV in os.environ:
        yield
        return
    os.environ[LAZY_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_ENV, None)


def shrink_default_group(exclude: Sequence[int]) -> None:
    """Shrink the default group to its ranks minus `exclude` (ncclCommShrink with abort: pending
    operations with the dead rank are cancelled). Raises when the backend cannot."""
    flags = getattr(dist.distributed_c10d, "SHRINK_ABORT", 0)
    dist.shrink_group(list(exclude), group=None, shrink_flags=flags)


def leave(backend: str, features: CommFeatures | None = None) -> None:
    """Drop every group of this process. NCCL: abort the communicators where torch can (a hung
    peer would keep ncclCommDestroy waiting; abort returns at once; torch aborts them all within
    one NCCL group call), else destroy; gloo: destroy (its sockets close with the last
    reference). May raise for a broken group, which is dropped either way."""
    if not dist.is_initialized():
        return
    feats = features or detect_features()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if backend == "nccl" and feats.abort and abort is not None:
        try:
            abort()
            return
        except Exception:
            if not dist.is_initialized():
                return
    dist.destroy_process_group()
