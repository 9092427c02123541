"""Unit-addressed checkpoints (worker/checkpoint/) in one process: the pure policies, and the
ranks of a layout simulated as one Checkpointer each (a shard does not need its TP group to be
saved or loaded; the attempt's name, which ranks otherwise agree on through their group, is given).

What is checked: a checkpoint taken under TP4 x DP2 (with Adam moments and step, and SGD
momentum) loads into TP3 + TP4, TP2 x DP3, TP1 and TP4 + TP2 + TP1 with every rank's parameters
and optimizer state *equal* (bitwise) to the same units of the unsharded reference; a corrupted
shard, a truncated file or an edited manifest makes the load fall back to the previous checkpoint
and say why; an attempt that some rank never finished is never listed or loaded; retention; a
checkpoint of another model is refused. The processes, the training after a restore and the
kill in the middle of a write are in test_checkpoint_dist.py."""

from __future__ import annotations

import copy
import json
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ntp_manager.contract.checkpoint_format import list_checkpoints
from ntp_manager.worker.checkpoint import (
    MANIFEST,
    Checkpointer,
    CheckpointError,
    NoCheckpoint,
    Retention,
    retention_plan,
    stretches,
    write_ranges,
)
from ntp_manager.worker.sync import SyncLayout, families_of, replicas_from
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan, unit_counts
from ntp_manager.worker.tp import parallelize
from tests.worker.ckpt_cases import CFG, TARGETS, TP4x2, batch, layout, make_opt, mismatches
from tests.worker.compare import ref_part, shard_info


# ---- pure policies ------------------------------------------------------------------------------
def test_write_ranges_cut_each_family_once_per_replica() -> None:
    # 6 heads over 2 replicas: [0, 3) and [3, 6); 90 MLP columns: [0, 45), [45, 90); 64 vocab: 32 each
    assert write_ranges(TP4x2, 1) == {"heads": (0, 3), "mlp": (0, 45), "vocab": (0, 32)}
    assert write_ranges(TP4x2, 6) == {"heads": (3, 6), "mlp": (45, 90), "vocab": (32, 64)}
    # three replicas: 6 heads -> 2 each, 90 -> 30 each, 64 -> 22, 21, 21
    lay = TARGETS["TP2xDP3"]
    assert [write_ranges(lay, r)["vocab"] for r in (0, 2, 4)] == [(0, 22), (22, 43), (43, 64)]


@pytest.mark.parametrize(("units", "lo", "hi", "expected"), [
    ([0, 1, 2], 0, None, [(0, 0, 3)]),
    ([3, 7], 0, None, [(3, 0, 1), (7, 1, 1)]),  # an extra rank: two stretches
    ([23, 24, 25, 53, 54], 24, 54, [(24, 1, 2), (53, 3, 1)]),  # cut to [24, 54)
    ([5, 4, 6], 0, None, [(4, 1, 1), (5, 0, 1), (6, 2, 1)]),  # consecutive units at non-consecutive places
    ([], 0, None, []),
])
def test_stretches_are_runs_of_units_and_positions(units: list[int], lo: int, hi: int | None,
                                                   expected: list[tuple[int, int, int]]) -> None:
    assert stretches(units, lo, hi) == expected


@pytest.mark.parametrize(("steps", "policy", "bad", "keep", "delete"), [
    ([10, 20, 30, 40], Retention(keep_last=2), [], (30, 40), (10, 20)),
    ([10, 20, 30, 40, 50], Retention(keep_last=1, keep_every=20), [], (20, 40, 50), (10, 30)),
    # 40 is bad: it does not count, so 20 and 30 are the newest two good ones; 40 goes
    ([10, 20, 30, 40], Retention(keep_last=2), [40], (20, 30), (10, 40)),
    # a bad multiple of keep_every is kept (evidence); it still does not count towards keep_last
    ([10, 20, 30, 40], Retention(keep_last=1, keep_every=40), [40], (30, 40), (10, 20)),
    ([], Retention(), [], (), ()),
])
def test_retention_plan(steps: list[int], policy: Retention, bad: list[int], keep: tuple[int, ...],
                        delete: tuple[int, ...]) -> None:
    d = retention_plan(steps, policy, bad)
    assert (d.keep, d.delete) == (keep, delete)
    assert set(d.reasons) == set(steps)


def test_retention_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="keep_last must be a positive integer"):
        Retention(keep_last=0)
    with pytest.raises(ValueError, match="keep_every must be a non-negative integer"):
        Retention(keep_every=-1)


# ---- a job simulated in one process ---------------------------------------------------------------
def reference(kind: str, steps: int = 2, seed: int = 0) -> tuple[TinyGpt, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = TinyGpt(CFG)
    opt = make_opt(kind, m.parameters())
    for s in range(steps):
        opt.zero_grad()
        m.loss(*batch(s, 8)).backward()
        opt.step()
    return m, opt


def shard(ref: TinyGpt, ref_opt: torch.optim.Optimizer, kind: str, lay: SyncLayout, rank: int) -> tuple[Any, ...]:
    """What rank `rank` of `lay` holds when its state is the reference's: its units' slices."""
    m = copy.deepcopy(ref)
    plan = tp_plan(CFG)
    fams = families_of(plan, m)
    parallelize(m, plan, lay.units_of(rank), group=None)
    opt = make_opt(kind, m.parameters())
    info, full = shard_info(m), dict(ref.named_parameters())
    for name, p in m.named_parameters():
        opt.state[p] = {k: ref_part(v, name, info).clone() if v.dim() else v.clone()
                        for k, v in ref_opt.state[full[name]].items()}
    return m, opt, fams


def fresh(kind: str, lay: SyncLayout, rank: int) -> tuple[Any, ...]:
    """A rank of `lay` that knows nothing: another seed, an optimizer without state."""
    torch.manual_seed(1234 + rank)
    m = TinyGpt(CFG)
    plan = tp_plan(CFG)
    fams = families_of(plan, m)
    parallelize(m, plan, lay.units_of(rank), group=None)
    return m, make_opt(kind, m.parameters()), fams


def save_all(root: Path, step: int, kind: str, ref: Any, ref_opt: Any, lay: SyncLayout = TP4x2,
             data_state: dict[str, Any] | None = None, **kw: Any) -> Path:
    """Every rank of `lay` saves (attempt name agreed beforehand); returns the checkpoint's path."""
    handles = []
    ranks = [r for rep in lay.replicas for r in rep.ranks]
    for r in ranks:
        m, opt, fams = shard(ref, ref_opt, kind, lay, r)
        handles.append(Checkpointer(root, **kw).save(step, m, opt, lay, r, fams, attempt=f"s{step}",
                                                     data_state=data_state))
    for h in handles:
        h.written.result(30)
    assert handles[0].completed is not None and all(h.completed is None for h in handles[1:])
    return handles[0].completed.result(30)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_tp4x2_checkpoint_loads_bitwise_into_other_layouts(tmp_path: Path, kind: str) -> None:
    ref, ref_opt = reference(kind)
    path = save_all(tmp_path, 2, kind, ref, ref_opt, data_state={"epoch": 0, "offset": 16})
    doc = json.loads((path / MANIFEST).read_text())
    assert doc["layout"]["replicas"] == [{"ranks": [0, 1, 2, 3], "local_batch": 4},
                                         {"ranks": [4, 5, 6, 7], "local_batch": 4}]
    # each rank wrote its part: 8 rank directories, and (units first) q.weight is 6 heads x 8 features
    assert sorted(p.name for p in path.glob("r*")) == [f"r{r}" for r in range(8)]
    assert doc["tensors"]["model/blocks.0.attn.q.weight"] == {"shape": [48, 48], "dtype": "float32",
                                                              "family": "heads", "unit_size": 8}
    assert doc["tensors"]["model/blocks.0.attn.o.weight"]["shape"] == [48, 48]  # row-wise: stored transposed
    for name, lay in TARGETS.items():
        for r in [r for rep in lay.replicas for r in rep.ranks]:
            m, opt, fams = fresh(kind, lay, r)
            info = Checkpointer(tmp_path).load(m, opt, lay, r, fams)
            assert (info.step, info.data_state, info.skipped) == (2, {"epoch": 0, "offset": 16}, ())
            assert mismatches(m, opt, ref, ref_opt) == [], (name, r)


def test_rng_state_comes_back(tmp_path: Path) -> None:
    ref, ref_opt = reference("sgd")
    torch.manual_seed(7)
    random.seed(7)
    path = save_all(tmp_path, 2, "sgd", ref, ref_opt, layout([[0]], [8]))
    assert path.name == "step-000000000002"
    expected = (torch.rand(3), random.random())  # what comes next after the state saved with it
    m, opt, fams = fresh("sgd", TARGETS["TP1"], 0)
    Checkpointer(tmp_path).load(m, opt, TARGETS["TP1"], 0, fams)
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def _shard_file(path: Path) -> Path:
    """The biggest data file (rank 0's)."""
    return max(path.glob("r*/*.distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "edit the manifest", "delete a file"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: str) -> None:
    ref1, opt1 = reference("adamw", steps=1)
    ref2, opt2 = reference("adamw", steps=2)
    save_all(tmp_path, 1, "adamw", ref1, opt1)
    newest = save_all(tmp_path, 2, "adamw", ref2, opt2)
    victim = _shard_file(newest)
    if damage == "flip a byte":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
        expected = f"{victim.parent.name}/{victim.name}: sha256"
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-10])
        expected = "bytes, the manifest says"
    elif damage == "edit the manifest":
        doc = json.loads((newest / MANIFEST).read_text())
        doc["step"] = 2
        doc["data_state"] = {"tampered": True}
        (newest / MANIFEST).write_text(json.dumps(doc))
        expected = "manifest.json does not match its own hash"
    else:
        victim.unlink()
        expected = "FileNotFoundError"
    for r in range(3):  # into TP3: every rank falls back, and says why
        m, opt, fams = fresh("adamw", layout([[0, 1, 2]], [8]), r)
        info = Checkpointer(tmp_path).load(m, opt, layout([[0, 1, 2]], [8]), r, fams)
        assert info.step == 1
        assert len(info.skipped) == 1 and info.skipped[0][0] == "step-000000000002", info.skipped
        assert expected in info.skipped[0][1], info.skipped
        assert "restored from step 1 (step-000000000001); skipped step-000000000002: " in info.describe()
        assert mismatches(m, opt, ref1, opt1) == []


def test_no_verified_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    m, opt, fams = fresh("sgd", TARGETS["TP1"], 0)
    with pytest.raises(NoCheckpoint, match=r"no complete checkpoint in "):
        Checkpointer(tmp_path).load(m, opt, TARGETS["TP1"], 0, fams)
    ref, ref_opt = reference("sgd")
    path = save_all(tmp_path, 2, "sgd", ref, ref_opt, TARGETS["TP1"])
    _shard_file(path).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"step-000000000002: r0/__0_0\.distcp: 7 bytes"):
        Checkpointer(tmp_path).load(m, opt, TARGETS["TP1"], 0, fams)


def test_an_attempt_some_rank_never_finished_is_never_loaded(tmp_path: Path) -> None:
    ref1, opt1 = reference("sgd", steps=1)
    ref2, opt2 = reference("sgd", steps=2)
    lay = layout([[0, 1]], [8])
    save_all(tmp_path, 1, "sgd", ref1, opt1, lay)
    # step 2: only rank 0 (the coordinator) writes; rank 1 "died" before its part
    m, opt, fams = shard(ref2, opt2, "sgd", lay, 0)
    ck = Checkpointer(tmp_path, complete_timeout_s=0.5)
    h = ck.save(2, m, opt, lay, 0, fams, attempt="lost")
    assert h.completed is not None
    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not finish their part within"):
        h.completed.result(30)
    assert any("step 2: checkpoint not completed (it will never be loaded)" in f for f in ck.failures)
    assert [r.step for r in ck.complete()] == [1]
    assert (tmp_path / ".tmp-step-000000000002-lost" / "r0" / ".metadata").is_file()  # the partial data
    m, opt, fams = fresh("sgd", lay, 1)
    assert Checkpointer(tmp_path).load(m, opt, lay, 1, fams).step == 1
    # a later checkpoint's completion clears the leftover attempt
    save_all(tmp_path, 3, "sgd", ref2, opt2, lay)
    assert not list(tmp_path.glob(".tmp-*"))


def test_retention_keeps_the_newest_and_every_kth(tmp_path: Path) -> None:
    ref, ref_opt = reference("sgd", steps=1)
    for step in (10, 20, 30, 40, 50):
        save_all(tmp_path, step, "sgd", ref, ref_opt, TARGETS["TP1"], retention=Retention(keep_last=2, keep_every=20))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000000000020", "step-000000000040", "step-000000000050"]


def test_the_same_step_saved_again_replaces_the_old_one(tmp_path: Path) -> None:
    """After a restore from an older checkpoint the job reaches the same steps again."""
    ref1, opt1 = reference("sgd", steps=1)
    ref2, opt2 = reference("sgd", steps=2)
    save_all(tmp_path, 5, "sgd", ref1, opt1, TARGETS["TP1"])
    m, opt, fams = shard(ref2, opt2, "sgd", TARGETS["TP1"], 0)
    h = Checkpointer(tmp_path).save(5, m, opt, TARGETS["TP1"], 0, fams, attempt="again")
    assert h.completed is not None
    h.completed.result(30)
    m, opt, fams = fresh("sgd", TARGETS["TP1"], 0)
    Checkpointer(tmp_path).load(m, opt, TARGETS["TP1"], 0, fams)
    assert mismatches(m, opt, ref2, opt2) == []
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000000005"]


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    ref, ref_opt = reference("sgd")
    save_all(tmp_path, 2, "sgd", ref, ref_opt, TARGETS["TP1"])
    other = GptConfig(vocab=64, seq=16, d_model=48, heads=6, mlp=96, layers=2)
    m = TinyGpt(other)
    plan = tp_plan(other)
    fams = families_of(plan, m)
    lay = SyncLayout(replicas_from([[0]], [8]), unit_counts(other))
    parallelize(m, plan, lay.units_of(0), group=None)
    with pytest.raises(CheckpointError, match=r"does not fit this model: model/blocks.0.mlp.up.weight: the "
                                              r"checkpoint has \{'shape': \[90, 48\]"):
        Checkpointer(tmp_path).load(m, make_opt("sgd", m.parameters()), lay, 0, fams)


def test_state_it_cannot_store_is_refused_at_save(tmp_path: Path) -> None:
    ref, ref_opt = reference("sgd")
    m, opt, fams = shard(ref, ref_opt, "sgd", TARGETS["TP1"], 0)
    ck = Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="data_state must be a JSON document"):
        ck.save(2, m, opt, TARGETS["TP1"], 0, fams, attempt="x", data_state={"sampler": object()})
    rms = torch.optim.RMSprop(m.parameters())  # the Runtime refuses it at set-up (optim.py); the checkpointer too
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    rms.step()
    with pytest.raises(ValueError, match=r"optimizer state 'square_avg' of .* \(RMSprop\): checkpoints store"):
        ck.save(2, m, rms, TARGETS["TP1"], 0, fams, attempt="y")
    with pytest.raises(ValueError, match="attempt must be"):
        ck.save(2, m, opt, TARGETS["TP1"], 0, fams, attempt="../escape")
    assert not list(tmp_path.iterdir())


def test_the_layouts_restore_step_bounds_the_checkpoint_loaded(tmp_path: Path) -> None:
    """`Layout.restore_step` (the manager's choice): newer checkpoints are passed over."""
    ref1, opt1 = reference("sgd", steps=1)
    ref2, opt2 = reference("sgd", steps=2)
    save_all(tmp_path, 1, "sgd", ref1, opt1, TARGETS["TP1"])
    save_all(tmp_path, 2, "sgd", ref2, opt2, TARGETS["TP1"])
    m, opt, fams = fresh("sgd", TARGETS["TP1"], 0)
    assert Checkpointer(tmp_path).load(m, opt, TARGETS["TP1"], 0, fams, max_step=1).step == 1
    assert mismatches(m, opt, ref1, opt1) == []
    with pytest.raises(CheckpointError, match=r"no complete checkpoint at or before step 0 .*newer: \[2, 1\]"):
        Checkpointer(tmp_path).load(m, opt, TARGETS["TP1"], 0, fams, max_step=0)


def test_the_managers_listing_reads_what_the_workers_wrote(tmp_path: Path) -> None:
    """ntp_manager/contract/checkpoint_format.py (no torch): complete, verified (manifest hash, sizes), the
    reason one does not verify, an attempt that never completed."""
    ref1, opt1 = reference("sgd", steps=1)
    save_all(tmp_path, 1, "sgd", ref1, opt1, TARGETS["TP1"])
    bad = save_all(tmp_path, 2, "sgd", ref1, opt1, TARGETS["TP1"])
    good = save_all(tmp_path, 3, "sgd", ref1, opt1, TARGETS["TP1"])
    victim = _shard_file(bad)
    victim.write_bytes(victim.read_bytes()[:-10])
    (tmp_path / ".tmp-step-000000000004-abc").mkdir()
    listing = list_checkpoints(tmp_path, limit=3)
    assert listing.exists and listing.total == 4 and not listing.truncated
    assert [(c.step, c.complete, c.verified) for c in listing.items] == [(4, False, False), (3, True, True),
                                                                        (2, True, False)]
    doc = json.loads((good / MANIFEST).read_text())
    assert listing.items[1].bytes == doc["bytes"] > 0 and listing.items[1].at == doc["completed_at"]
    assert listing.items[2].problem == f"r0/{victim.name}: {victim.stat().st_size} bytes, the manifest says " \
                                      f"{victim.stat().st_size + 10}"
    assert "never completed" in listing.items[0].problem
    assert list_checkpoints(tmp_path, verified_only=True).newest_verified() == 3
    (tmp_path / "step-000000000009").mkdir()  # a manifest that is a FIFO is refused, not waited on
    os.mkfifo(tmp_path / "step-000000000009" / MANIFEST)
    (top,) = list_checkpoints(tmp_path, limit=1).items
    assert (top.step, top.verified, top.problem) == (9, False, "manifest.json unreadable: ValueError")
    assert not list_checkpoints(tmp_path / "nothing-yet").exists


def test_the_optimizer_step_waits_for_the_background_copy(tmp_path: Path) -> None:
    """The copy of the parameters and optimizer state runs on the writer thread while the next
    step's forward and backward run; optimizer.step() waits for it, so the checkpoint holds the
    state at save() even when the step comes at once."""
    ref, ref_opt = reference("adamw", steps=1)
    m, opt, fams = shard(ref, ref_opt, "adamw", TARGETS["TP1"], 0)
    ck = Checkpointer(tmp_path)
    gate = threading.Event()
    ck.test_hook = lambda stage, att: gate.wait(60) if stage == "snapshot" else None
    h = ck.save(1, m, opt, TARGETS["TP1"], 0, fams, attempt="bg")
    assert not h.snapshotted.done()  # save() returned before the copy
    opt.zero_grad()
    m.loss(*batch(1, 8)).backward()  # the next step's forward and backward go on meanwhile
    stepping = threading.Thread(target=opt.step)
    stepping.start()
    stepping.join(0.5)
    assert stepping.is_alive() and not h.snapshotted.done()  # held by the pre-step hook
    gate.set()
    stepping.join(60)
    assert not stepping.is_alive() and h.snapshotted.done()
    assert h.completed is not None
    h.completed.result(60)
    assert mismatches(m, opt, ref, ref_opt) != []  # the step did change the live state ...
    m2, opt2, fams2 = fresh("adamw", TARGETS["TP1"], 0)
    Checkpointer(tmp_path).load(m2, opt2, TARGETS["TP1"], 0, fams2)
    assert mismatches(m2, opt2, ref, ref_opt) == []  # ... and the checkpoint holds the state at save()
    other = opt.register_step_pre_hook(lambda *_: None)  # another hook after ours
    opt.step()  # a later step: the hook lets it through (and the table is not changed under the step)
    ck.fence()  # removes the hook
    assert list(opt._optimizer_step_pre_hooks) == [other.id]
