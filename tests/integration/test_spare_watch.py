"""A spare rank waits for a layout that includes it without a deadline (worker/runtime
`standby_timeout_s` None), so its layout watch must say when none can come: once the manager
refuses the watch for good (the job was deleted), `GrpcLayoutSource.wait_newer` raises, naming
why, instead of returning None after every wait. Real manager, database and gRPC on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest

from ntp_manager.worker.sources import GrpcLayoutSource
from tests.integration.conftest import Service, submit_job
from tests.integration.test_service import JOB, start_agents


async def test_a_deleted_jobs_watch_raises_at_once_instead_of_timing_out(service: Service) -> None:
    svc = service
    agents = await start_agents(svc)
    await submit_job(svc, JOB)
    gpu = next(iter(svc.manager.world.jobs["llm"].layout.doc.gpus))
    src = await asyncio.to_thread(GrpcLayoutSource, svc.grpc, svc.tokens["worker"], "llm", gpu)
    try:
        lay = src.latest()
        assert lay is not None and lay.version == 1
        assert await asyncio.to_thread(src.wait_newer, 1, 0.2) is None  # nothing new: None, as before
        async with svc.client() as c:
            assert (await c.delete("/v1/jobs/llm")).status_code == 200
        t = time.monotonic()
        with pytest.raises(RuntimeError, match=r"ended the layout watch of 'llm': .*llm") as e:
            await asyncio.to_thread(src.wait_newer, 1, 600)
        assert time.monotonic() - t < 300, "the wait ran to its timeout"  # a guard, not a timing: 600 s is the bug
        assert "NOT_FOUND" in str(e.value) or "not found" in str(e.value).lower(), e.value
    finally:
        src.close()
        for a in agents:
            await a.close()
