"""What a worker's step report carries for fail-slow detection (issue 21 item 1, worker side)."""

from __future__ import annotations

import pytest

from ntp_manager.service.core import steps
from ntp_manager.worker.sources import StepWork, WorkerLayout, step_report


def test_lengths_come_from_the_batch_when_it_says_them() -> None:
    class B:
        sequence_lengths = [3, 5]

    assert StepWork.lengths_of(B()) == (3, 5)
    assert StepWork.lengths_of({"sequence_lengths": (7,)}) == (7,)
    assert StepWork.lengths_of(object()) is None and StepWork.lengths_of({"x": 1}) is None
    with pytest.raises(ValueError, match=">= 0"):
        StepWork.lengths_of({"sequence_lengths": [4, -1]})


def test_report_carries_compute_tokens_and_squares_and_passes_the_managers_checks() -> None:
    lay = WorkerLayout(3, ((2, 8),), 1, "", 7)
    rep = step_report("llm", "w1", "GPU-1", lay, 42, 0.9, 8, StepWork(0.6, 0.05, (100, 300, 600)))
    (r,) = rep.ranks
    assert (rep.step, rep.stamp.version, rep.stamp.leader_epoch, r.rank) == (42, 3, 7, 1)
    assert (r.compute_s, r.comm_wait_s) == (0.6, 0.05)
    assert (r.tokens, r.sequence_sq_sum) == (1000, 100**2 + 300**2 + 600**2)
    steps.check_report(rep)  # what the manager refuses, it does not refuse this
    bare = step_report("llm", "w1", "GPU-1", lay, 43, 0.9, 8).ranks[0]
    assert (bare.tokens, bare.compute_s, bare.sequence_sq_sum) == (8, 0.0, 0)  # not measured: 0, as before
