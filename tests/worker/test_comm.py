"""The transport seam (worker/comm.py): the backend choice and the shrink plan (pure, table-driven),
refusals at set-up, and the staged path on real gloo processes with CPU tensors (forced staging:
the copies a one-GPU machine runs with CUDA tensors). NCCL cases need >= 2 GPUs and skip without."""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ntp_manager.worker import comm
from ntp_manager.worker.comm import P2P, BackendError, CommFeatures, choose_backend, shrink_plan
from tests.fakes.procs import free_port, worker_context

CPU_ONLY = CommFeatures(gloo=True, nccl=False, cuda_devices=0)
ONE_GPU = CommFeatures(gloo=True, nccl=True, cuda_devices=1, eager_init=True)
EIGHT_GPUS = CommFeatures(gloo=True, nccl=True, cuda_devices=8, eager_init=True)
NO_NCCL_GPU = CommFeatures(gloo=True, nccl=False, cuda_devices=2)


# ---- backend choice (pure) ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("device", "requested", "local_ranks", "gpus", "feats", "backend", "staged"),
    [
        ("cpu", "auto", 8, 0, CPU_ONLY, "gloo", False),
        ("cpu", "gloo", 8, 8, EIGHT_GPUS, "gloo", False),  # CPU tensors even on a GPU host
        ("cuda", "auto", 8, 8, EIGHT_GPUS, "nccl", False),  # a GPU per rank
        ("cuda", "auto", 4, 8, EIGHT_GPUS, "nccl", False),
        ("cuda", "auto", 8, 1, ONE_GPU, "gloo", True),  # 8 ranks share one GPU: gloo, staged
        ("cuda", "auto", 8, 4, EIGHT_GPUS, "gloo", True),  # 8 ranks on 4 GPUs
        ("cuda", "gloo", 8, 8, EIGHT_GPUS, "gloo", True),  # asked for: staged
        ("cuda", "nccl", 8, 8, EIGHT_GPUS, "nccl", False),
        ("cuda", "auto", 2, 2, NO_NCCL_GPU, "gloo", True),  # no NCCL in this build
    ],
)
def test_choose_backend(device, requested, local_ranks, gpus, feats, backend, staged):
    got = choose_backend(device, requested, local_ranks, gpus, feats)
    assert (got.backend, got.device, got.staged) == (backend, device, staged), got
    assert got.reason


@pytest.mark.parametrize(
    ("device", "requested", "local_ranks", "gpus", "feats", "says"),
    [
        ("cpu", "nccl", 1, 0, CPU_ONLY, "cannot carry CPU tensors"),
        ("cpu", "nccl", 8, 8, EIGHT_GPUS, "cannot carry CPU tensors"),
        ("cuda", "auto", 1, 0, CPU_ONLY, "sees no CUDA device"),
        ("cuda", "gloo", 1, 1, CPU_ONLY, "sees no CUDA device"),  # CPU-only torch, whatever is said
        ("cuda", "nccl", 8, 1, ONE_GPU, "8 ranks share 1 GPU"),
        ("cuda", "nccl", 2, 2, NO_NCCL_GPU, "without NCCL"),
        ("tpu", "auto", 1, 0, CPU_ONLY, "device must be"),
        ("cpu", "mpi", 1, 0, CPU_ONLY, "backend must be"),
        ("cpu", "auto", 0, 0, CPU_ONLY, "at least one rank"),
        ("cpu", "auto", 1, 0, CommFeatures(gloo=False), "without it"),
        ("cuda", "auto", 8, 1, CommFeatures(gloo=False, nccl=True, cuda_devices=1), "no gloo"),
    ],
)
def test_choose_backend_refuses_what_cannot_work(device, requested, local_ranks, gpus, feats, says):
    with pytest.raises(BackendError, match=says):
        choose_backend(device, requested, local_ranks, gpus, feats)


@pytest.mark.parametrize(("local_rank", "visible", "index"), [(0, 1, 0), (5, 1, 0), (5, 8, 5), (5, 2, 1)])
def test_device_index(local_rank, visible, index):
    # one visible GPU (pinned by ntp-run, or shared): device 0; else the rank's own, round-robin
    assert comm.device_index(local_rank, visible) == index


def test_nccl_error_handling_that_kills_survivors_is_refused():
    comm.check_nccl_env({})  # unset: the runtime sets what it needs
    comm.check_nccl_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "1"})
    with pytest.raises(BackendError, match="tears the process down"):
        comm.check_nccl_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    with pytest.raises(BackendError, match="never raise"):
        comm.check_nccl_env({"TORCH_NCCL_BLOCKING_WAIT": "0"})


def test_runtime_config_refuses_at_set_up():
    from ntp_manager.worker.runtime import RuntimeConfig

    with pytest.raises(BackendError, match="backend must be"):
        RuntimeConfig(job="j", backend="mpi")
    with pytest.raises(BackendError, match="local_rank 3"):
        RuntimeConfig(job="j", local_rank=3, local_world_size=2)
    with pytest.raises(BackendError, match="cannot carry CPU tensors"):
        RuntimeConfig(job="j", backend="nccl").resolve(EIGHT_GPUS)
    with pytest.raises(BackendError, match="8 ranks share 1 GPU"):
        RuntimeConfig(job="j", device="cuda", backend="nccl", local_world_size=8).resolve(ONE_GPU)
    choice, device = RuntimeConfig(job="j", device="cuda", local_rank=5, local_world_size=8).resolve(ONE_GPU)
    assert (choice.backend, choice.staged, str(device)) == ("gloo", True, "cuda:0")
    choice, device = RuntimeConfig(job="j", device="cuda", local_rank=5, local_world_size=8).resolve(EIGHT_GPUS)
    assert (choice.backend, str(device)) == ("nccl", "cuda:5")
    # ntp-run pinned each rank to its GPU: it sees one, the host's ranks use eight
    pinned = CommFeatures(gloo=True, nccl=True, cuda_devices=1)
    choice, device = RuntimeConfig(job="j", device="cuda", local_rank=5, local_world_size=8,
                                   local_gpus=8).resolve(pinned)
    assert (choice.backend, str(device)) == ("nccl", "cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_runtime_with_cuda_but_no_cuda_is_refused_before_anything_starts():
    from ntp_manager.worker.runtime import Runtime, RuntimeConfig

    class NoSource:
        def close(self) -> None:
            raise AssertionError("nothing may start")

    with pytest.raises(BackendError, match="sees no CUDA device"):
        Runtime(lambda: torch.nn.Linear(2, 2), {}, lambda p: torch.optim.SGD(p, lr=0.1), NoSource(),  # type: ignore[arg-type]
                None, RuntimeConfig(job="j", device="cuda"))


def test_detect_features_matches_this_torch():
    f = comm.detect_features()
    assert f.gloo == dist.is_gloo_available() and f.nccl == dist.is_nccl_available()
    assert f.cuda_devices == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert f.split_group == hasattr(dist, "split_group") and f.shrink_group == hasattr(dist, "shrink_group")


# ---- shrink plan (pure) ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("old_world", "arrivals", "kind", "exclude"),
    [
        # TP4 + TP4, old rank 3 failed: ranks 0-2 and 4-7 become 0-6, in order
        ({"0.1": 8}, {i: ("0.1", o) for i, o in enumerate([0, 1, 2, 4, 5, 6, 7])}, "shrink", (3,)),
        ({"0.1": 8}, {i: ("0.1", o) for i, o in enumerate([0, 1, 2, 4, 5])}, "shrink", (3, 6, 7)),
        # a repaired rank joins: it holds nothing, so a fresh communicator
        ({"0.2": 7}, {**{i: ("0.2", i) for i in range(7)}, 7: None}, "fresh", ()),
        # same ranks, new version: new communicators per version
        ({"0.1": 4}, {i: ("0.1", i) for i in range(4)}, "fresh", ()),
        # order not kept (a shrink would number them differently)
        ({"0.1": 4}, {0: ("0.1", 1), 1: ("0.1", 0), 2: ("0.1", 2)}, "fresh", ()),
        # ranks hold different versions (one sat a version out)
        ({"0.1": 4, "0.2": 3}, {0: ("0.1", 0), 1: ("0.2", 1)}, "fresh", ()),
        # an old rank beyond the old world: inconsistent records
        ({"0.1": 2}, {0: ("0.1", 0), 1: ("0.1", 2)}, "fresh", ()),
        ({"0.1": 2}, {0: ("0.9", 0)}, "fresh", ()),
    ],
)
def test_shrink_plan(old_world, arrivals, kind, exclude):
    plan = shrink_plan(old_world, arrivals, can_shrink=True)
    assert (plan.kind, plan.exclude) == (kind, exclude), plan
    assert plan.reason


def test_shrink_plan_without_support_is_fresh():
    plan = shrink_plan({"0.1": 8}, {i: ("0.1", o) for i, o in enumerate([0, 1, 2, 4, 5, 6, 7])}, can_shrink=False)
    assert plan.kind == "fresh" and "cannot shrink" in plan.reason


def test_agree_reads_every_record_and_checks_backends():
    store = dist.HashStore()
    for new, old in enumerate([0, 1, 3]):
        comm.publish_held(store, "p", new, ("0.4", old, 4), "nccl")
    plan = comm.agree(store, "p", 3, "nccl", shrinkable=True)
    assert (plan.kind, plan.exclude, plan.old_version) == ("shrink", (2,), "0.4")
    comm.publish_held(store, "q", 0, None, "nccl")
    comm.publish_held(store, "q", 1, None, "gloo")
    with pytest.raises(BackendError, match="only 1 of 2 ranks chose backend 'nccl'"):
        comm.agree(store, "q", 2, "nccl", shrinkable=True)


def test_a_rank_counted_in_twice_counts_once() -> None:
    """A rank that comes to the same version twice (a restarted process reading the same layout,
    or a retry) overwrites its records: the backend check and the arrival keys count ranks, not
    calls (a counter once read 'only 10 of 6 ranks chose gloo' here)."""
    store = dist.HashStore()
    for _ in range(3):
        comm.publish_held(store, "r", 0, None, "gloo")
    keys = comm.arrival_keys("r", 2)
    store.set(keys[0], "1")
    store.set(keys[0], "1")
    assert not store.check(keys)  # rank 1 has not arrived, however often rank 0 did
    comm.publish_held(store, "r", 1, None, "gloo")
    store.set(keys[1], "1")
    assert store.check(keys)
    assert comm.agree(store, "r", 2, "gloo", shrinkable=False).kind == "fresh"
    comm.publish_held(store, "r", 0, None, "nccl")  # a rank's newest record is the one that counts
    with pytest.raises(BackendError, match="only 1 of 2 ranks chose backend 'gloo'"):
        comm.agree(store, "r", 2, "gloo", shrinkable=False)


def test_a_rendezvous_is_settled_once_for_every_rank() -> None:
    """The first claim at a prefix holds whatever any rank claims after it, on the store kind the
    runtime meets in (a TCPStore, through a PrefixStore as torch wraps it) and a HashStore."""
    master = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                           timeout=dt.timedelta(seconds=10))
    for store in (master, dist.PrefixStore("job", master), dist.HashStore()):  # type: ignore[attr-defined]
        assert comm.settle(store, "v0.4", None) is None  # nobody decided yet
        assert comm.settle(store, "v0.4", "superseded") == "superseded"
        assert comm.settle(store, "v0.4", "go") == "superseded"  # a late rank that found everyone in
        assert comm.settle(store, "v0.4", None) == "superseded"
        assert comm.settle(store, "v0.5", "go") == "go"
        assert comm.settle(store, "v0.5", "timed out") == "go"
        with pytest.raises(ValueError, match="unknown rendezvous outcome"):
            comm.settle(store, "v0.6", "maybe")


# ---- the staged path, real gloo processes ------------------------------------------------------
def _staged_worker(rank: int, world: int, port: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=dt.timedelta(seconds=60))
    comm.configure(force_staging=True)
    out: dict[str, Any] = {}
    # all-reduce of a non-contiguous view: the staged copy must land back in the view
    base = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
    view = base.t()
    assert comm.route(view, None) == "host"
    comm.all_reduce(view)
    out["all_reduce"] = base.tolist()
    w = comm.all_reduce(torch.full((5,), float(rank)), async_op=True)
    w.wait()
    w.wait()  # a second wait does nothing
    # point to point, several messages per pair in one exchange, both directions
    peer = 1 - rank
    sends = [torch.full((n,), 10.0 * rank + n) for n in (3, 1000, 3)]
    recvs = [torch.zeros(n) for n in (3, 1000, 3)]
    ptrs = {t.data_ptr() for t in sends + recvs}
    ops = [P2P(True, t, peer) for t in sends] + [P2P(False, t, peer) for t in recvs]
    comm.wait_all(comm.exchange(ops))
    out["recv"] = [t[0].item() for t in recvs]
    out["sends_kept"] = all(t[0].item() == 10.0 * rank + t.numel() for t in sends)
    # the staging buffers are separate host memory, never the tensors themselves
    out["aliased"] = any(b.data_ptr() in ptrs for bufs in comm._pool.free.values() for b in bufs)
    out["pinned"] = any(b.is_pinned() for bufs in comm._pool.free.values() for b in bufs)
    t = torch.full((4,), float(rank + 7))
    comm.broadcast(t, src=1)
    out["broadcast"] = t.tolist()
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    comm.all_gather(every, torch.tensor([rank, rank * 2.0], dtype=torch.float64))
    out["all_gather"] = [e.tolist() for e in every]
    # the same messages again reuse pooled buffers
    hits = comm.stats.pool_hits
    ops = [P2P(True, t, peer) for t in sends] + [P2P(False, t, peer) for t in recvs]
    comm.wait_all(comm.exchange(ops))
    out["reused"] = comm.stats.pool_hits - hits
    out["staged_ops"] = comm.stats.staged_ops
    q.put((rank, out))
    dist.destroy_process_group()


def test_forced_staging_on_gloo_moves_the_right_bytes():
    q = worker_context().SimpleQueue()
    mp.start_processes(_staged_worker, args=(2, free_port(), q), nprocs=2, join=True, start_method="forkserver")
    res = dict(q.get() for _ in range(2))
    full = [[3.0 * x for x in range(r * 4, r * 4 + 4)] for r in range(3)]  # rank 0's x1 plus rank 1's x2
    for rank, out in res.items():
        peer = 1 - rank
        assert out["all_reduce"] == full
        assert out["recv"] == [10.0 * peer + 3, 10.0 * peer + 1000, 10.0 * peer + 3]
        assert out["sends_kept"]
        assert not out["aliased"]
        assert out["pinned"] == torch.cuda.is_available()  # CPU torch cannot pin: never asked to
        assert out["broadcast"] == [8.0] * 4
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 2.0]]
        assert out["reused"] >= 3  # the second round's messages found buffers of their sizes
        assert out["staged_ops"] >= 12


# ---- NCCL, >= 2 GPUs ---------------------------------------------------------------------------
two_gpus = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                                   and dist.is_nccl_available()),
                              reason="NCCL paths need >= 2 CUDA GPUs and a torch with NCCL")


def _nccl_worker(rank: int, world: int, port: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    feats = comm.detect_features()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    comm.configure(device=device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=dt.timedelta(seconds=60))
    comm.init_default_group("nccl", dist.PrefixStore("v1", store), rank, world, dt.timedelta(seconds=60), device,
                            feats)
    out: dict[str, Any] = {"env": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    sub = dist.new_group(list(range(world)), timeout=dt.timedelta(seconds=60))  # split from the default (eager)
    x = torch.full((1000,), float(rank + 1), device=device)
    assert comm.route(x, sub) == "direct"
    comm.all_reduce(x, group=sub)
    out["all_reduce"] = x[0].item()
    cpu = torch.tensor([float(rank)], dtype=torch.float64)  # a CPU tensor on NCCL: through the device
    every = [torch.zeros_like(cpu) for _ in range(world)]
    comm.all_gather(every, cpu, group=sub)
    out["all_gather"] = [e.item() for e in every]
    # a ring of sends and receives in one exchange (one NCCL group call: no deadlock)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(10, device=device)
    comm.wait_all(comm.exchange([P2P(True, torch.full((10,), float(rank), device=device), nxt),
                                 P2P(False, got, prv)], sub))
    out["ring"] = got[0].item()
    # shrink: the last rank leaves, the others shrink the default communicator
    out["shrink"] = None
    if feats.shrink_group and comm.can_shrink() and world >= 2:
        if rank == world - 1:
            comm.leave("nccl", feats)
        else:
            comm.shrink_default_group([world - 1])
            y = torch.ones(1, device=device)
            dist.all_reduce(y)
            out["shrink"] = (dist.get_world_size(), y.item())
    q.put((rank, out))
    comm.leave("nccl", feats)


@two_gpus
def test_nccl_collectives_p2p_and_shrink():
    world = 2
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_nccl_worker, args=(world, free_port(), q), nprocs=world, join=True, start_method="spawn")
    res = dict(q.get() for _ in range(world))
    for rank, out in res.items():
        assert out["env"] == "2"
        assert out["all_reduce"] == sum(range(1, world + 1))
        assert out["all_gather"] == [float(r) for r in range(world)]
        assert out["ring"] == float((rank - 1) % world)
        if out["shrink"] is not None:
            assert out["shrink"] == (world - 1, float(world - 1))


def test_worker_env_passes_the_host_to_the_backend_choice():
    """ntp-run's variables reach RuntimeConfig: local rank and ranks, the GPUs they use (pinned
    ranks each see one), the backend asked for; a bad value is refused with its name."""
    from ntp_manager.worker.env import worker_env

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # noqa: F841 - held open
                           timeout=dt.timedelta(seconds=30))
    base = {"NTP_STORE": f"127.0.0.1:{port}", "NTP_JOB": "j", "NTP_WORKER_ID": "w5", "NTP_LOCAL_RANK": "5",
            "NTP_NPROC": "8", "NTP_DEVICE": "cpu"}
    env = worker_env({**base, "NTP_LOCAL_GPUS": "8"})
    cfg = env.config(collective_timeout_s=5)
    assert (cfg.backend, cfg.local_rank, cfg.local_world_size, cfg.local_gpus) == ("auto", 5, 8, 8)
    assert cfg.collective_timeout_s == 5
    assert cfg.resolve(CPU_ONLY)[0].backend == "gloo"
    with pytest.raises(RuntimeError, match="NTP_BACKEND must be"):
        worker_env({**base, "NTP_BACKEND": "mpi"})
    with pytest.raises(RuntimeError, match="NTP_LOCAL_GPUS must be a count"):
        worker_env({**base, "NTP_LOCAL_GPUS": "x"})
    env.source.close()


# ---- the version's default group connects lazily (gloo) ----------------------------------------
def _sockets() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def _lazy_default_worker(rank: int, world: int, port: int, q: Any) -> None:
    import time

    from ntp_manager.worker.runtime import is_comm_failure

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=60))
    before = _sockets()
    comm.init_default_group("gloo", dist.PrefixStore("v1", store), rank, world, dt.timedelta(seconds=60), None)
    by_default = _sockets() - before
    env_left = comm.LAZY_ENV in os.environ
    g = dist.new_group(list(range(world)), timeout=dt.timedelta(seconds=60))  # carries traffic: eager
    by_world = _sockets() - before - by_default
    x = torch.ones(1)
    comm.all_reduce(x, group=g)
    q.put((rank, "made", (by_default, by_world, env_left, x.item())))
    if rank == world - 1:
        # only now, with the queue's shared write lock released by put(): a kill right after the
        # message arrived could leave that lock held, and the survivors' reports block on it forever
        store.set("parked", "1")
        time.sleep(600)  # killed by the test
    store.wait(["killed"])
    t = time.monotonic()
    try:
        comm.all_reduce(x, group=g)
        q.put((rank, "no error", None))
    except Exception as e:  # the dead peer: a comm failure the runtime recovers from
        q.put((rank, "raised", (is_comm_failure(e), str(e).splitlines()[0][:200], time.monotonic() - t)))
    comm.leave("gloo")


@pytest.mark.timeout(120)
def test_the_default_group_connects_lazily_and_a_dead_peer_still_fails_at_once() -> None:
    """The version's default group carries nothing, so its gloo pairs connect lazily (on a first
    use that never comes): it opens fewer sockets than a full mesh, and the lazy setting does not
    leak to the groups made after it, which connect every pair at creation. So a peer killed
    after the groups are made still fails the survivors' next collective with a comm failure the
    runtime recovers from (the passive side of a lazy gloo connect to a dead peer ignores the
    timeout and can hang: pytorch/gloo#520)."""
    import signal

    world = 3
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    ctx = worker_context()
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_lazy_default_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        made = {r: out for r, _, out in (q.get() for _ in range(world))}
        store.wait(["parked"])
        os.kill(procs[-1].pid, signal.SIGKILL)
        procs[-1].join(30)
        store.set("killed", "1")
        after = {r: (what, out) for r, what, out in (q.get() for _ in range(world - 1))}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r, (by_default, by_world, env_left, total) in made.items():
        assert by_world >= world - 1, (r, by_world)  # eager: a connection to every peer (and a listener)
        assert by_default < world - 1, (r, by_default)  # lazy: no pair connected
        assert not env_left and total == world
    for r, (what, out) in after.items():
        assert what == "raised" and out[0], (r, what, out)  # a comm failure the runtime recovers from


# ---- FlatExchange: coalesced point to point ------------------------------------------------------
def _payload(src: int, dst: int) -> list[torch.Tensor]:
    """What rank `src` sends rank `dst`: mixed dtypes, an empty tensor, sizes around a 4 KiB chunk."""
    g = torch.Generator().manual_seed(100 * src + dst)
    return [torch.randn(37, 50, generator=g),  # 7400 bytes: crosses a chunk
            torch.randint(-(2**40), 2**40, (300,), generator=g),  # int64
            torch.empty(0),
            torch.randn(64, generator=g).to(torch.bfloat16),
            torch.rand(33, generator=g) > 0.5,  # bool: one byte each
            torch.randn(8, 16, generator=g)]


def _flat_comm_worker(rank: int, world: int, port: int, staged: bool, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=dt.timedelta(seconds=60))
    comm.configure(force_staging=staged, chunk_bytes=4096)
    out: dict[str, Any] = {}
    ops: list[P2P] = []
    got: dict[int, list[torch.Tensor]] = {}
    for peer in range(world):
        if peer == rank:
            continue
        ops += [P2P(True, t, peer) for t in _payload(rank, peer)]
        like = _payload(peer, rank)
        recv = [torch.zeros_like(t) for t in like]
        recv[-1] = torch.zeros(16, 8).t()  # a strided target: received into a temporary, copied in
        got[peer] = recv
        ops += [P2P(False, t, peer) for t in recv]
    msgs = comm.stats.p2p_messages
    ex = comm.FlatExchange(ops)
    ex.start().wait()
    ex.wait()  # a second wait does nothing
    out["messages"] = (comm.stats.p2p_messages - msgs, ex.messages, ex.rounds)
    out["ok"] = all(torch.equal(a, b) for peer, recv in got.items() for a, b in zip(recv, _payload(peer, rank),
                                                                                         strict=True))
    out["kept"] = comm._flat_pool.bytes
    comm.release_buffers()  # a switch: the chunk buffers stay
    out["kept_after_release"] = comm._flat_pool.bytes
    hits = comm.stats.pool_hits
    comm.FlatExchange(ops).start().wait()
    out["reused"] = comm.stats.pool_hits - hits
    out["zero_copy"] = comm.stats.flat_zero_copy
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("staged", [False, True])
def test_flat_exchange_moves_mixed_dtypes_in_chunks_per_peer_pair(staged: bool):
    """Three ranks, everyone to everyone: each pair's tensors (five dtypes, an empty one, a strided
    receive target) travel as one byte stream per direction cut into 4 KiB chunks, and arrive
    exactly; the chunk buffers survive release_buffers() and serve the next exchange."""
    world = 3
    q = worker_context().SimpleQueue()
    mp.start_processes(_flat_comm_worker, args=(world, free_port(), staged, q), nprocs=world, join=True,
                       start_method="forkserver")
    res = dict(q.get() for _ in range(world))
    per_pair = sum(t.numel() * t.element_size() for t in _payload(0, 1))
    chunks = -(-per_pair // 4096)
    for rank, out in res.items():
        assert out["ok"], rank
        posted, counted, rounds = out["messages"]
        assert posted == counted == 2 * (world - 1) * chunks  # per peer: a send and a receive stream
        assert rounds == chunks
        assert out["kept"] > 0 and out["kept_after_release"] == out["kept"]
        assert out["reused"] >= 2 * (world - 1)
        assert (out["zero_copy"] > 0) == (not staged)  # the 7400-byte tensor's chunk-sized stretch


def test_chunk_size_out_of_bounds_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="chunk_bytes=10: a message chunk must be between"):
        comm.configure(chunk_bytes=10)
    with pytest.raises(ValueError, match="NTP_COMM_CHUNK_BYTES='lots' is not a whole number"):
        comm._chunk_from_env("lots")
    with pytest.raises(ValueError, match="NTP_COMM_CHUNK_BYTES=1099511627776"):
        comm._chunk_from_env(str(1 << 40))
    assert comm._chunk_from_env("") == comm.CHUNK_BYTES


def _nccl_flat_worker(rank: int, world: int, port: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    feats = comm.detect_features()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    comm.configure(device=device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=dt.timedelta(seconds=60))
    comm.init_default_group("nccl", dist.PrefixStore("v1", store), rank, world, dt.timedelta(seconds=60), device,
                            feats)
    dist.barrier()
    calls: list[int] = []
    real = dist.batch_isend_irecv

    def spy(ops: list[Any]) -> Any:
        calls.append(len(ops))
        return real(ops)

    dist.batch_isend_irecv = spy  # type: ignore[assignment]
    out: dict[str, Any] = {}
    for chunk in (comm.CHUNK_BYTES, 4096):
        comm.configure(chunk_bytes=chunk)
        ops: list[P2P] = []
        got: dict[int, list[torch.Tensor]] = {}
        for peer in range(world):
            if peer != rank:
                ops += [P2P(True, t.to(device), peer) for t in _payload(rank, peer)]
                got[peer] = [torch.zeros_like(t, device=device) for t in _payload(peer, rank)]
                ops += [P2P(False, t, peer) for t in got[peer]]
        calls.clear()
        ex = comm.FlatExchange(ops)
        ex.start().wait()
        out[chunk] = (list(calls), ex.rounds, all(torch.equal(a.cpu(), b) for p, r in got.items()
                                                  for a, b in zip(r, _payload(p, rank), strict=True)))
    q.put((rank, out))
    comm.leave("nccl", feats)


@two_gpus
def test_nccl_flat_exchange_posts_one_group_call_per_round():
    """A switch's moves on NCCL: one batch_isend_irecv per round, holding one send and one receive
    per peer pair -- with the default chunk a single group call for the whole reshard."""
    world = 2
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_nccl_flat_worker, args=(world, free_port(), q), nprocs=world, join=True, start_method="spawn")
    res = dict(q.get() for _ in range(world))
    per_pair = sum(t.numel() * t.element_size() for t in _payload(0, 1))
    for rank, out in res.items():
        calls, rounds, ok = out[comm.CHUNK_BYTES]
        assert ok and rounds == 1 and calls == [2 * (world - 1)], (rank, calls)
        calls, rounds, ok = out[4096]
        assert ok and rounds == -(-per_pair // 4096) and calls == [2 * (world - 1)] * rounds, (rank, calls)
