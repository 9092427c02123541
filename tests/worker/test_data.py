"""The worker's data sources (worker/data.py) and what the runtime does with a bad one.

MapSource over a torch Dataset and over a Hugging Face `datasets` table, TokenStream over token
documents: the samples of a range do not depend on how it is cut (any layout), every epoch is a
permutation drawn from the seed, a prefetched range serves the calls inside it, the position
(epoch, index in it) is reported. The sample cursor's place in a checkpoint's data_state.

Bad input, with real rank processes on gloo: a source that raises on one rank, or one that holds
fewer samples than a global batch, ends the step on every rank with one DataSourceError naming the
source and the samples -- the other ranks do not wait for a layout that will never come. And the
example in examples/ trains on data it writes, under ntp-run, through a failure and a repair."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ntp_manager.worker.data import CURSOR_KEY, MapSource, TokenStream, split_cursor, with_cursor
from ntp_manager.worker.runtime import DataSourceError, Runtime, RuntimeConfig
from ntp_manager.worker.runtime.feed import Feed
from ntp_manager.worker.sources import StoreLayoutSource
from ntp_manager.worker.tiny_gpt import TinyGpt, tp_plan
from tests.fakes.procs import worker_context
from tests.worker.ranks import reap, store_with_layout
from tests.worker.test_runtime import CFG

ROOT = Path(__file__).resolve().parents[2]


class _Squares(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([i, i * i]), "id": torch.tensor(i)}


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return [int(v) for v in batch["id"]]


def test_map_source_epochs_are_seeded_permutations_whatever_the_cut() -> None:
    src = MapSource(_Squares(10), seed=3, prefetch=False)
    whole = _ids(src(0, 30))  # three epochs
    for e in range(3):
        assert sorted(whole[10 * e: 10 * e + 10]) == list(range(10))  # each epoch every sample once
    assert whole[:10] != whole[10:20] and whole[:10] != list(range(10))  # a new order per epoch, shuffled
    # any cut of the range into replicas' shares reads the same samples (the layout does not matter)
    for cuts in ([(0, 6), (6, 9), (15, 15)], [(0, 1), (1, 28), (29, 1)]):
        assert [i for a, n in cuts for i in _ids(src(a, n))] == whole
    assert _ids(MapSource(_Squares(10), seed=3, prefetch=False)(0, 30)) == whole  # the seed decides
    assert _ids(MapSource(_Squares(10), seed=4, prefetch=False)(0, 30)) != whole
    assert _ids(MapSource(_Squares(10), shuffle=False, prefetch=False)(8, 4)) == [8, 9, 0, 1]
    assert src.position(23) == (2, 3)
    assert src.state(23) == {"source": "MapSource(_Squares)", "seed": 3, "epoch": 2, "position": 3, "samples": 23}
    b = src(0, 4)
    assert b["x"].shape == (4, 2) and torch.equal(b["x"][:, 1], b["x"][:, 0] ** 2)  # default_collate of dicts


def test_a_prefetched_range_serves_the_calls_inside_it() -> None:
    src = MapSource(_Squares(50), seed=1)
    plain = MapSource(_Squares(50), seed=1, prefetch=False)
    src.prefetch(20, 8)
    assert _ids(src(20, 3)) == _ids(plain(20, 3)) and _ids(src(23, 5)) == _ids(plain(23, 5))
    assert src.prefetch_hits == 2
    assert _ids(src(40, 2)) == _ids(plain(40, 2)) and src.prefetch_hits == 2  # outside: read on the spot
    src.close()


def test_map_source_reads_a_hugging_face_datasets_table() -> None:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"input_ids": [[i, i + 1, i + 2] for i in range(12)],
                                        "label": list(range(12))}).with_format("torch")
    src = MapSource(table, seed=5, prefetch=False)
    b = src(4, 16)  # across the epoch boundary
    assert set(b) == {"input_ids", "label"} and b["input_ids"].shape == (16, 3)
    assert torch.equal(b["input_ids"][:, 0], b["label"])
    labels = [int(v) for v in src(0, 12)["label"]]
    assert sorted(labels) == list(range(12)) and labels != list(range(12))
    assert src.name == "MapSource(Dataset)" and len(src) == 12


def test_token_stream_packs_documents_into_sequences() -> None:
    docs = [list(range(100 * d, 100 * d + n)) for d, n in enumerate([5, 9, 3, 12, 7, 1])]
    eos = 999
    src = TokenStream(docs, seq_len=4, seed=2, eos=eos, prefetch=False)
    total = sum(len(d) + 1 for d in docs)
    assert len(src) == (total - 1) // 4
    x, y = src(0, len(src))
    assert x.shape == y.shape == (len(src), 4) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[1:, 0], y[:-1, -1])  # targets: the next token
    stream = [*x.reshape(-1).tolist(), int(y[-1, -1])]  # the epoch's tokens
    pieces: list[list[int]] = [[]]
    for t in stream:
        if t == eos:
            pieces.append([])
        else:
            pieces[-1].append(t)
    whole, tail = pieces[:-1], pieces[-1]
    # each document whole, once, followed by eos; the tail a document's start; another order
    assert len(whole) == len({tuple(d) for d in whole}) >= 5 and all(d in docs for d in whole)
    assert any(d[: len(tail)] == tail for d in docs if d not in whole)
    assert whole != docs[: len(whole)]
    # cut-independence and epochs: epoch 1's order is another
    assert torch.equal(torch.cat([src(3, 2)[0], src(5, 4)[0]]), src(3, 6)[0])
    assert not torch.equal(src(0, len(src))[0], src(len(src), len(src))[0])
    assert src.position(len(src) + 2) == (1, 2)
    # documents as a `datasets`-like table of rows, the lengths given
    rows = [{"ids": torch.tensor(d)} for d in docs]
    by_rows = TokenStream(rows, seq_len=4, seed=2, eos=eos, key="ids", lengths=[len(d) for d in docs],
                          prefetch=False)
    assert torch.equal(by_rows(0, len(src))[0], x)
    with pytest.raises(ValueError, match="make no sequence"):
        TokenStream([[1, 2]], seq_len=4)
    with pytest.raises(ValueError, match="the dataset is empty"):
        MapSource([])


def test_the_cursor_rides_in_a_checkpoints_data_state() -> None:
    assert with_cursor(None, 42) == {CURSOR_KEY: 42}
    assert split_cursor(with_cursor({"epoch": 1}, 42), 7, {}) == (42, {"epoch": 1})
    assert split_cursor(with_cursor(None, 42), 7, {}) == (42, None)
    # a checkpoint from before the cursor: its step x the global batch it was taken under
    assert split_cursor({"epoch": 1}, 7, {"replicas": [{"local_batch": 4}, {"local_batch": 2}]}) == (42, {"epoch": 1})
    with pytest.raises(ValueError, match="may not use the key"):
        with_cursor({CURSOR_KEY: 1}, 2)


def test_train_step_takes_one_of_the_two_forms() -> None:
    with pytest.raises(ValueError, match="one of them"):
        Feed(None, None, lambda: 0)
    with pytest.raises(ValueError, match="one of them"):
        Feed(lambda s, a, n: None, lambda a, n: None, lambda: 0)
    with pytest.raises(ValueError, match="must be callable"):
        Feed(None, [1, 2, 3], lambda: 0)
    feed = Feed(None, MapSource(_Squares(10), prefetch=False), lambda: 12)
    assert _ids(feed(5, 2, 3)) == _ids(MapSource(_Squares(10), prefetch=False)(14, 3))  # at the cursor
    with pytest.raises(DataSourceError, match=r"MapSource\(_Squares\) holds 10 samples, fewer than the global "
                                              r"batch of 16: samples \[12, 28\)"):
        feed.check(16)


# ---- bad input with real ranks ----------------------------------------------------------------------
JOB = "bad-data"


class _Breaks:
    """A source that raises for every range holding sample `at` (on the rank that reads it)."""

    name = "flaky-shards"

    def __init__(self, at: int, n: int = 1000) -> None:
        self.at, self.n, self.inner = at, n, MapSource(_Tokens(), prefetch=False)

    def __len__(self) -> int:
        return self.n

    def __call__(self, start: int, count: int) -> Any:
        if start <= self.at < start + count:
            raise OSError(f"shard for sample {self.at} is unreadable")
        return self.inner(start, count)


class _Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, CFG.vocab, (CFG.seq + 1,), generator=torch.Generator().manual_seed(i))
        return t[:-1], t[1:]


def _bad_worker(wid: str, port: int, q: Any, kind: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=120))
    # a collective timeout far beyond the test's deadline: a rank left waiting would fail the test
    cfg = RuntimeConfig(job=JOB, collective_timeout_s=600, reconfigure_timeout_s=600)
    rt = Runtime(lambda: TinyGpt(CFG), tp_plan(CFG), lambda ps: torch.optim.SGD(ps, lr=0.05), StoreLayoutSource(
        store, JOB, wid), store, cfg)
    src: Any = _Breaks(at=10) if kind == "raises" else MapSource(_Tokens(), prefetch=False)
    if kind == "short":
        src.n = 5  # fewer samples than the global batch of 6
    rt.start()
    try:
        while rt.step < 4:
            rt.train_step(loss_fn=lambda m, b: m.loss(*b), samples=src)
        q.put((wid, "no error", rt.step))
    except DataSourceError as e:
        q.put((wid, str(e), rt.step))
    rt.close()


@pytest.mark.parametrize("kind", ["raises", "short"])
def test_a_bad_data_source_fails_the_step_on_every_rank_with_one_clear_error(kind: str) -> None:
    """TP2 (w0, w1) + TP1 (w2), global batch 6: step 1 reads samples [6, 12); sample 10 is w2's
    (its replica's share is [10, 12)), and only w2's read raises. Or the source holds 5 samples."""
    port, _store = store_with_layout(JOB, [(["w0", "w1"], 4), (["w2"], 2)], 120)  # kept: the master
    ctx = worker_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_bad_worker, args=(w, port, q, kind)) for w in ("w0", "w1", "w2")]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        got = {}
        while len(got) < 3:
            wid, msg, step = q.get(timeout=max(1.0, deadline - time.monotonic()))
            got[wid] = (msg, step)
    finally:
        reap(procs)
    if kind == "raises":
        want = ("data source flaky-shards failed reading samples [10, 12) (step 1): OSError: shard for sample 10 "
                "is unreadable")
        assert got == {w: (want, 1) for w in ("w0", "w1", "w2")}, got
    else:
        assert {m for m, _ in got.values()} == {"data source MapSource(_Tokens) holds 5 samples, fewer than the "
                                                "global batch of 6: samples [0, 6) cannot be one step's"}, got
        assert {s for _, s in got.values()} == {0}
    assert all(p.exitcode == 0 for p in procs)


def test_the_example_trains_on_the_data_it_writes_through_a_failure(tmp_path: Path) -> None:
    """examples/train_on_data.py under ntp-run: 2 replicas x TP2 (global batch 8), a rank killed
    after step 2 (6), repaired after step 5 (8): the cursor runs on without a gap."""
    r = subprocess.run([sys.executable, "-m", "ntp_manager.worker.run", "--nproc", "4", "--replicas", "2",
                        "--fail-at", "2", "--repair-at", "5", "--max-restarts", "1", "examples/train_on_data.py",
                        "--steps", "8", "--data", str(tmp_path), "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "check ok" in r.stdout and "global batch   6" in r.stdout, r.stdout[-3000:]
    assert (tmp_path / "corpus.txt").exists()
