"""Settings shared by every test directory.

Hypothesis: no per-example deadline and no "too slow" health check. Both are wall-clock
assertions, and this suite runs under pytest-xdist on two loaded cores, where a property test's
example can take seconds for reasons that have nothing to do with the code under test. The
properties themselves are unchanged; the examples still run.

Order: the files that take longest run first (`make test` keeps this order for xdist's
`loadfile` scheduling with `--no-loadscope-reorder`), so that the suite does not end with one
worker busy on a two-minute file while the other has nothing left to do. Only the order changes:
every file still runs whole on one worker, and tests are independent.

Threads: one intra-op thread per process (OMP_NUM_THREADS / MKL_NUM_THREADS, unless the caller set
them), as `ntp-run` gives each rank (launch.py). The suite runs many rank processes at once on two
cores; with torch's default (a thread per core) their OpenMP threads spin against each other, and
the exactly-once run of test_samples.py took 95 CPU seconds instead of 35. Set here, before anything
imports torch or starts a process, so the forkserver and every subprocess inherit it."""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ntp", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ntp")

# longest first, as measured on the 2-core CI machine (a file's total, its fixtures included)
SLOW_FIRST = (
    "tests/worker/test_pipeline_runtime.py",
    "tests/worker/test_samples.py",
    "tests/integration/test_fleet.py",
    "tests/integration/test_wheel.py",
    "tests/worker/test_hf_runtime.py",
    "tests/integration/test_slurm.py",
    "tests/worker/test_checkpoint_dist.py",
    "tests/integration/test_service.py",
    "tests/worker/test_hf_models.py",
    "tests/integration/test_leader.py",
    "tests/integration/test_fleet_watch.py",
    "tests/integration/test_fuzz_api.py",
    "tests/e2e/test_slow_demo.py",
    "tests/worker/test_ntp_run.py",
    "tests/integration/test_ha.py",
    "tests/integration/test_crash_safety.py",
    "tests/integration/test_ownership.py",
    "tests/worker/test_runtime.py",
    "tests/e2e/test_many_jobs.py",
    "tests/worker/test_switch_failures.py",
    "tests/integration/test_ownership_property.py",
    "tests/e2e/test_demo.py",
    "tests/worker/test_data.py",
    "tests/worker/test_abort.py",
    "tests/unit/test_gpu_session.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order
