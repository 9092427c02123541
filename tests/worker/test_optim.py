"""The runtime's optimizer contract (worker/optim.py): what is refused before the first step, how
parameter groups' values correspond between ranks, and a checkpoint that carries the groups'
values, amsgrad's extra moment and an LR scheduler's position. The multi-process path (reshard,
a joiner's values from a peer) is test_runtime's parameter-groups case."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ntp_manager.worker.checkpoint import Checkpointer, CheckpointError
from ntp_manager.worker.optim import OptimizerError, check_optimizer, pack_values, set_group_values, unpack_values
from ntp_manager.worker.sync import families_of
from ntp_manager.worker.tiny_gpt import TinyGpt, tp_plan
from ntp_manager.worker.tp import parallelize
from tests.worker.ckpt_cases import CFG, TARGETS, batch, layout


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))


def groups(m: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    ps = list(m.parameters())
    return torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                              {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}], lr=0.01, **kw)


@pytest.mark.parametrize(("make", "words"), [
    (lambda m: torch.optim.RMSprop(m.parameters()), "RMSprop is not supported"),
    (lambda m: torch.optim.Adagrad(m.parameters()), "Adagrad is not supported"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, differentiable=True), "differentiable=True"),
    (lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01)), "lr is a tensor"),
    (lambda m: torch.optim.SGD([*m.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1),
     "not a parameter of the model"),
])
def test_what_the_runtime_cannot_carry_is_refused_before_the_first_step(make: Any, words: str) -> None:
    m = model()
    with pytest.raises(OptimizerError, match=words):
        check_optimizer(make(m), m)


def test_an_optimizer_with_state_is_refused_and_the_supported_ones_pass() -> None:
    m = model()
    used = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 4)).sum().backward()
    used.step()
    with pytest.raises(OptimizerError, match="fresh optimizer"):
        check_optimizer(used, m)
    for opt in (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
                torch.optim.Adam(m.parameters(), amsgrad=True), groups(m, amsgrad=True),
                torch.optim.SGD(list(m.parameters())[:1], lr=0.1)):  # a frozen parameter is in no group
        check_optimizer(opt, m)


def test_group_values_travel_and_groups_must_correspond() -> None:
    src, dst = groups(model()), groups(model())
    sched = torch.optim.lr_scheduler.LambdaLR(src, lambda s: 0.5 ** s)
    for _ in range(3):
        src.step()
        sched.step()
    dst_sched = torch.optim.lr_scheduler.LambdaLR(dst, lambda s: 0.5 ** s)
    unpack_values(pack_values(src, sched), dst, dst_sched, "rank 0")
    assert [g["lr"] for g in dst.param_groups] == [0.01 / 8] * 2 == [g["lr"] for g in src.param_groups]
    assert [g["weight_decay"] for g in dst.param_groups] == [0.1, 0.0]
    assert dst_sched.last_epoch == 3 and isinstance(dst.param_groups[0]["betas"], tuple)
    dst_sched.step()
    assert dst.param_groups[0]["lr"] == 0.01 / 16
    # groups cut by something a rank's shard changes: refused, naming both cuts
    one = torch.optim.AdamW(model().parameters(), lr=0.01)
    with pytest.raises(OptimizerError, match=r"groups of \[4\] parameters here but rank 0 has \[1, 3\]"):
        unpack_values(pack_values(src, None), one, None, "rank 0")
    with pytest.raises(OptimizerError, match="has LR scheduler state but this rank has no scheduler"):
        unpack_values(pack_values(src, sched), groups(model()), None, "rank 0")
    set_group_values(one, [{"lr": 0.5}], "the checkpoint")  # no counts given (a checkpoint's): values only
    assert one.param_groups[0]["lr"] == 0.5


def _rank(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, dict[str, str]]:
    torch.manual_seed(seed)
    m = TinyGpt(CFG)
    plan = tp_plan(CFG)
    fams = families_of(plan, m)
    parallelize(m, plan, TARGETS["TP1"].units_of(0), group=None)
    opt = groups(m, amsgrad=True)
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: math.cos(s / 10)), fams


def test_a_checkpoint_carries_group_values_amsgrad_and_the_schedule(tmp_path: Path) -> None:
    m, opt, sched, fams = _rank(0)
    for s in range(3):
        opt.zero_grad()
        m.loss(*batch(s, 8)).backward()
        opt.step()
        sched.step()
    h = Checkpointer(tmp_path).save(3, m, opt, TARGETS["TP1"], 0, fams, attempt="s3", background=False,
                                    scheduler=sched)
    assert h.completed is not None
    h.completed.result(30)  # the manifest is written and the directory renamed
    m2, opt2, sched2, _ = _rank(1)
    assert opt2.param_groups[0]["lr"] != opt.param_groups[0]["lr"]
    Checkpointer(tmp_path).load(m2, opt2, TARGETS["TP1"], 0, fams, scheduler=sched2)
    for g, g2 in zip(opt.param_groups, opt2.param_groups, strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in g2.items() if k != "params"}
    assert sched2.state_dict() == sched.state_dict()
    for p, p2 in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["max_exp_avg_sq"], opt2.state[p2]["max_exp_avg_sq"])
    # a rank without the scheduler the checkpoint has: refused, not restored half
    m3, opt3, _, _ = _rank(2)
    before = {n: p.detach().clone() for n, p in m3.named_parameters()}
    with pytest.raises(CheckpointError, match="LR scheduler"):
        Checkpointer(tmp_path).load(m3, opt3, TARGETS["TP1"], 0, fams)
    assert all(torch.equal(p, before[n]) for n, p in m3.named_parameters())  # refused before any tensor was read


def test_a_scheduler_the_runtime_would_step_wrongly_is_refused() -> None:
    from ntp_manager.worker.optim import check_scheduler
    m = model()
    opt, other = groups(m), groups(m)
    with pytest.raises(OptimizerError, match="bound to another optimizer"):  # e.g. built on rt.optimizer
        check_scheduler(torch.optim.lr_scheduler.LambdaLR(other, lambda s: 1.0), opt)
    with pytest.raises(OptimizerError, match="ReduceLROnPlateau is not supported"):
        check_scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(opt), opt)
    check_scheduler(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), opt)
    check_scheduler(None, opt)


def test_each_pipeline_stage_restores_its_own_groups_and_schedule(tmp_path: Path) -> None:
    """A two-stage checkpoint whose stages' optimizers differ (stage 1's groups run at another
    learning rate under another schedule, as a head with its own rate would): each stage restores
    its own values. (The manifest kept only the coordinator's, stage 0's: stage 1 got them.)"""
    from ntp_manager.worker.pipeline import stage_module

    def stage(s: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(seed)
        part = stage_module(TinyGpt(CFG), s, 2)
        ps = list(part.parameters())
        opt = torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
                                lr=0.01 * (s + 1))
        return part, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i * (s + 1)))

    saved = []
    for s in (1, 0):  # rank s holds stage s; rank 0 (the coordinator) completes the checkpoint
        part, opt, sched = stage(s, 0)
        for _ in range(2):
            opt.step()
            sched.step()
        h = Checkpointer(tmp_path).save(2, part, opt, layout([[s]], [8]), s, {}, attempt="s2", background=False,
                                        scheduler=sched, job_ranks=[0, 1])
        saved.append((s, opt, sched, h))
    done = saved[-1][3].completed
    assert done is not None
    done.result(30)
    for s, opt, sched, _ in saved:
        part2, opt2, sched2 = stage(s, 1)
        Checkpointer(tmp_path).load(part2, opt2, layout([[s]], [8]), s, {}, strict=False, scheduler=sched2)
        assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups], f"stage {s}"
        assert sched2.state_dict() == sched.state_dict(), f"stage {s}"
