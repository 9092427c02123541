"""Ready data sources for the runtime's sample-addressed steps, and the sample cursor's place in a
checkpoint.

    source = MapSource(dataset, seed=0)                  # any torch Dataset (a `datasets` table too)
    source = TokenStream(documents, seq_len=128, seed=0)  # documents packed into fixed-length sequences
    while rt.step < steps:
        rt.train_step(loss_fn=loss_fn, samples=source)   # samples [cursor, cursor + global batch)

A source maps a *global sample index* -- the runtime's cursor counts samples trained so far, over
every layout -- to a sample, so which samples a step trains depends only on the cursor and the
step's global batch, never on how the batch is cut among replicas. Index i is sample i mod len of
epoch i // len; each epoch visits the samples in a permutation drawn from (seed, epoch), the same
on every rank and in every layout. `source(start, count)` returns samples [start, start + count)
collated into one batch; `prefetch(start, count)` reads them on a background thread (the runtime
calls it with the next step's range as soon as a step commits), and the next call for a range
inside it takes them from there. `position(i)` says which (epoch, position in the epoch) index i
is, `state(cursor)` the same as a JSON document for a checkpoint's data_state.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import default_collate

# the key a checkpoint's data_state carries the runtime's sample cursor under (the rest is the user's)
CURSOR_KEY = "ntp_sample_cursor"


@runtime_checkable
class SampleSource(Protocol):
    """What `Runtime.train_step(samples=...)` takes: global samples [start, start + count) as one
    batch. Optional: `__len__` (samples per epoch: a step whose global batch is larger fails with
    DataSourceError on every rank), `prefetch(start, count)` and a `name` for error messages."""

    def __call__(self, start: int, count: int) -> Any: ...


def with_cursor(data_state: dict[str, Any] | None, samples: int) -> dict[str, Any]:
    """The data_state a checkpoint stores: the user's, plus the sample cursor."""
    if data_state is not None and CURSOR_KEY in data_state:
        raise ValueError(f"data_state may not use the key {CURSOR_KEY!r}: the runtime stores its sample cursor there")
    return {**(data_state or {}), CURSOR_KEY: int(samples)}


def split_cursor(data_state: dict[str, Any] | None, step: int,
                 layout: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
    """(sample cursor, the user's data_state) of a checkpoint. A checkpoint written before the
    cursor existed gives step x the global batch it was taken under (exact when the global batch
    never changed before it)."""
    if data_state is None or CURSOR_KEY not in data_state:
        return step * sum(int(r["local_batch"]) for r in layout.get("replicas", [])), data_state
    rest = {k: v for k, v in data_state.items() if k != CURSOR_KEY}
    return int(data_state[CURSOR_KEY]), rest or None


def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (1 << 63))
    return torch.randperm(n, generator=g)


class _Prefetching:
    """Reading a range of samples on one background thread and serving sub-ranges of it. A
    subclass gives `_read(start, count)` (a list of samples) and `_collate(items)`."""

    name: str

    def __init__(self, prefetch: bool) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ntp-prefetch") if prefetch else None
        self._ahead: OrderedDict[tuple[int, int], Future[list[Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self.prefetch_hits = 0  # calls served from a prefetched range (tests, diagnostics)

    def _read(self, start: int, count: int) -> list[Any]:
        raise NotImplementedError

    def _collate(self, items: list[Any]) -> Any:
        raise NotImplementedError

    def prefetch(self, start: int, count: int) -> None:
        """Start reading samples [start, start + count) in the background (keeps the two newest ranges)."""
        if self._pool is None or count <= 0:
            return
        with self._lock:
            if (start, count) in self._ahead:
                return
            self._ahead[(start, count)] = self._pool.submit(self._read, start, count)
            while len(self._ahead) > 2:
                self._ahead.popitem(last=False)

    def __call__(self, start: int, count: int) -> Any:
        if start < 0 or count < 1:
            raise ValueError(f"{self.name}: no samples in [{start}, {start + count})")
        with self._lock:
            hit = next(((a, f) for (a, n), f in self._ahead.items() if a <= start and start + count <= a + n), None)
        if hit is not None:
            a, fut = hit
            items = fut.result()[start - a: start - a + count]  # a read that raised raises here
            self.prefetch_hits += 1
        else:
            items = self._read(start, count)
        return self._collate(items)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class MapSource(_Prefetching):
    """A map-style dataset (anything with `__len__` and `__getitem__`: a `torch.utils.data.Dataset`,
    a Hugging Face `datasets.Dataset`, a list) as a sample source: epoch e visits its samples in a
    permutation drawn from (seed, e) (`shuffle=False`: in order). `collate` makes a batch of a
    list of samples (default: torch's `default_collate`, which stacks tensors and turns a list of
    dicts -- a `datasets` row -- into a dict of batched columns). A dataset with `__getitems__`
    (torch's batched read; `datasets` has it) is read with one call per range."""

    def __init__(self, dataset: Any, *, seed: int = 0, shuffle: bool = True,
                 collate: Callable[[list[Any]], Any] | None = None, name: str | None = None,
                 prefetch: bool = True) -> None:
        super().__init__(prefetch)
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.name = name or f"MapSource({type(dataset).__name__})"
        self.n = len(dataset)
        if self.n < 1:
            raise ValueError(f"{self.name}: the dataset is empty")
        self.collate = collate or default_collate
        self._orders: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return self.n

    def position(self, i: int) -> tuple[int, int]:
        """(epoch, position in the epoch) of global sample index i."""
        e, p = divmod(i, self.n)
        return e, p

    def state(self, cursor: int) -> dict[str, Any]:
        e, p = self.position(cursor)
        return {"source": self.name, "seed": self.seed, "epoch": e, "position": p, "samples": cursor}

    def index(self, i: int) -> int:
        """The dataset index that global sample index i reads."""
        e, p = self.position(i)
        if not self.shuffle:
            return p
        with self._lock:
            order = self._orders.get(e)
            if order is None:
                order = self._orders[e] = _epoch_order(self.n, self.seed, e)
                while len(self._orders) > 2:
                    self._orders.popitem(last=False)
        return int(order[p])

    def _read(self, start: int, count: int) -> list[Any]:
        idx = [self.index(i) for i in range(start, start + count)]
        many = getattr(self.dataset, "__getitems__", None)
        return list(many(idx)) if many is not None else [self.dataset[j] for j in idx]

    def _collate(self, items: list[Any]) -> Any:
        return self.collate(items)


class TokenStream(_Prefetching):
    """Documents (each a sequence of token ids: a list, a 1-D tensor, or a row whose `key` column
    is one) packed into fixed-length sequences. Epoch e concatenates the documents in a
    permutation drawn from (seed, e), each followed by `eos` when given, and cuts the stream into
    sequences of `seq_len` tokens; sample k of the epoch is (inputs, targets) = tokens
    [k*seq_len, (k+1)*seq_len) and the same shifted by one. A batch is a pair of (count, seq_len)
    int64 tensors. The tail that does not fill a sequence is left out of the epoch (the next
    epoch's order is another). The documents' lengths are read once at construction (or given:
    `lengths`)."""

    def __init__(self, documents: Sequence[Any], seq_len: int, *, seed: int = 0, shuffle: bool = True,
                 eos: int | None = None, key: str | None = None, lengths: Sequence[int] | None = None,
                 name: str | None = None, prefetch: bool = True) -> None:
        super().__init__(prefetch)
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, not {seq_len}")
        self.docs, self.seq_len, self.seed, self.shuffle, self.eos, self.key = \
            documents, seq_len, seed, shuffle, eos, key
        self.name = name or f"TokenStream({type(documents).__name__}, seq_len={seq_len})"
        extra = 1 if eos is not None else 0
        lens = list(lengths) if lengths is not None else [len(self._doc(j)) for j in range(len(documents))]
        if len(lens) != len(documents):
            raise ValueError(f"{self.name}: {len(lens)} lengths for {len(documents)} documents")
        self._lens = torch.tensor([n + extra for n in lens], dtype=torch.int64)
        total = int(self._lens.sum())
        self.per_epoch = (total - 1) // seq_len if total > 0 else 0
        if self.per_epoch < 1:
            raise ValueError(f"{self.name}: {total} tokens make no sequence of {seq_len} (+1 for the targets)")
        self._epochs: OrderedDict[int, tuple[list[int], list[int]]] = OrderedDict()

    def _doc(self, j: int) -> Any:
        d = self.docs[j]
        return d[self.key] if self.key is not None else d

    def __len__(self) -> int:
        return self.per_epoch

    def position(self, i: int) -> tuple[int, int]:
        """(epoch, sequence in the epoch) of global sample index i."""
        e, p = divmod(i, self.per_epoch)
        return e, p

    def state(self, cursor: int) -> dict[str, Any]:
        e, p = self.position(cursor)
        return {"source": self.name, "seed": self.seed, "epoch": e, "position": p, "samples": cursor}

    def _epoch(self, e: int) -> tuple[list[int], list[int]]:
        """Epoch e's document order and the stream offset each of them starts at."""
        with self._lock:
            got = self._epochs.get(e)
            if got is None:
                order = _epoch_order(len(self._lens), self.seed, e) if self.shuffle else torch.arange(len(self._lens))
                starts = torch.cumsum(self._lens[order], 0) - self._lens[order]
                got = self._epochs[e] = (order.tolist(), starts.tolist())
                while len(self._epochs) > 2:
                    self._epochs.popitem(last=False)
            return got

    def tokens(self, i: int) -> torch.Tensor:
        """The seq_len + 1 tokens of global sample index i."""
        e, k = self.position(i)
        order, starts = self._epoch(e)
        lo, hi = k * self.seq_len, k * self.seq_len + self.seq_len + 1
        d = bisect.bisect_right(starts, lo) - 1
        parts: list[torch.Tensor] = []
        while lo < hi:
            doc = torch.as_tensor(self._doc(order[d]), dtype=torch.int64).reshape(-1)
            if self.eos is not None:
                doc = torch.cat([doc, torch.tensor([self.eos], dtype=torch.int64)])
            off = lo - starts[d]
            take = doc[off: off + hi - lo]
            parts.append(take)
            lo += len(take)
            d += 1
        return torch.cat(parts)

    def _read(self, start: int, count: int) -> list[Any]:
        return [self.tokens(i) for i in range(start, start + count)]

    def _collate(self, items: list[Any]) -> Any:
        t = torch.stack(items)
        return t[:, :-1], t[:, 1:]
