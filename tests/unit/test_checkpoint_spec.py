"""A job spec may name where and how often its workers checkpoint; the values are checked strictly
(spec file and library alike) and bounded."""

from __future__ import annotations

from typing import Any

import pytest

from ntp_manager.planner.spec import CheckpointPolicy, PlanError
from ntp_manager.specfile import SpecError, job_from_dict

JOB = {"name": "j", "tp": 4, "replicas": 2, "local_batch": 8, "heads": 8}


def test_a_job_without_checkpoints_has_none() -> None:
    assert job_from_dict(dict(JOB)).checkpoint is None


def test_the_checkpoint_block_becomes_a_policy() -> None:
    job = job_from_dict({**JOB, "checkpoint": {"dir": "/shared/ckpt/j", "interval_steps": 500}})
    assert job.checkpoint == CheckpointPolicy("/shared/ckpt/j", 500, keep_last=3, keep_every=0)
    job = job_from_dict({**JOB, "checkpoint": {"dir": "/c", "interval_steps": 1, "keep_last": 1,
                                               "keep_every": 1000}})
    assert job.checkpoint == CheckpointPolicy("/c", 1, 1, 1000)


@pytest.mark.parametrize(("block", "message"), [
    ({"interval_steps": 10}, "checkpoint.dir: Field required"),
    ({"dir": "ckpt/j", "interval_steps": 10}, "checkpoint.dir: String should match pattern"),  # relative
    ({"dir": "/a\x00b", "interval_steps": 10}, "checkpoint.dir: String should match pattern"),
    ({"dir": "/" + "a" * 4096, "interval_steps": 10}, "checkpoint.dir: String should have at most 4096"),
    ({"dir": "/shared/../etc", "interval_steps": 10}, "checkpoint.dir must not contain '.' or '..'"),
    ({"dir": "//", "interval_steps": 10}, "checkpoint.dir must not be the root directory"),
    ({"dir": "/c"}, "checkpoint.interval_steps: Field required"),
    ({"dir": "/c", "interval_steps": 0}, "checkpoint.interval_steps: Input should be greater than or equal to 1"),
    ({"dir": "/c", "interval_steps": True}, "checkpoint.interval_steps: Input should be a valid integer"),
    ({"dir": "/c", "interval_steps": "10"}, "checkpoint.interval_steps: Input should be a valid integer"),
    ({"dir": "/c", "interval_steps": 2**31}, "checkpoint.interval_steps: Input should be less than or equal to"),
    ({"dir": "/c", "interval_steps": 5, "keep_last": 0}, "checkpoint.keep_last: Input should be greater than or"),
    ({"dir": "/c", "interval_steps": 5, "keep_every": -1}, "checkpoint.keep_every: Input should be greater than"),
    ({"dir": "/c", "interval_steps": 5, "every": 3}, "checkpoint.every: Extra inputs are not permitted"),
])
def test_bad_checkpoint_blocks_are_refused_with_the_field_named(block: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match="^job: " if "must" in message else "^job: checkpoint") as e:
        job_from_dict({**JOB, "checkpoint": block})
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize(("policy", "message"), [
    (CheckpointPolicy("rel", 5), "checkpoint.dir must be an absolute path"),
    (CheckpointPolicy("/c", 0), r"checkpoint.interval_steps must be an integer in \[1, "),
    (CheckpointPolicy("/c", 5, keep_last=True), r"checkpoint.keep_last must be an integer in \[1, 10000\], got True"),
    (CheckpointPolicy("/c\n", 5), "checkpoint.dir contains a control character"),
])
def test_the_library_checks_the_same(policy: CheckpointPolicy, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        policy.validate()
