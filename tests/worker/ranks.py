"""Driving rank processes in the runtime tests: the store the ranks meet in, with the first layout
already published (what a launcher and the manager would have done), and ending the processes a
test started, whatever became of them."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

from ntp_manager.worker.sources import publish_layout
from tests.fakes.procs import free_port


def store_with_layout(jobs: str | Sequence[str], doc: list[Any], timeout_s: float) -> tuple[int, Any]:
    """A master TCPStore on a free loopback port (ranks connect with `timeout_s`), holding
    version 1 ("start") of each job's layout, `doc` as `publish_layout` takes it. Returns the port
    and the store (a TCPStore)."""
    port = free_port()
    # torch.distributed does not re-export TCPStore to type checkers
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                          timeout=dt.timedelta(seconds=timeout_s))
    for job in [jobs] if isinstance(jobs, str) else jobs:
        publish_layout(store, job, 1, doc, "start")
    return port, store


def reap(procs: Iterable[BaseProcess], join_s: float = 30) -> None:
    """Gives each process still running `join_s` seconds to end, then kills it."""
    for p in procs:
        if p.is_alive():
            p.join(timeout=join_s)
        if p.is_alive():
            p.kill()
