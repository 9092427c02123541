"""What a training script started by `ntp-run` (worker/run.py) finds in its environment.

    env = worker_env()
    rt = env.runtime(model_fn, optimizer_fn)          # plan_for(model) unless a plan is given
    rt.start()

`ntp-run` sets, for every rank process:

    NTP_STORE      host:port of the TCPStore it hosts (the runtime's process groups meet there)
    NTP_JOB        the job's name
    NTP_WORKER_ID  this rank's worker id (its GPU UUID under a manager)
    NTP_GPU_UUID   this rank's GPU (under a manager)
    NTP_MANAGER    the manager's gRPC address; absent when ntp-run publishes the layouts itself
    NTP_TOKEN      a worker-scope token for the manager
    NTP_TLS_CA / NTP_TLS_CERT / NTP_TLS_KEY   optional: the manager's CA, this node's client
                   certificate and key (TLS, mTLS: ntp-run's --tls-* flags)
    NTP_LOCAL_RANK / NTP_NPROC   this process's index among ntp-run's, and their number
    NTP_DEVICE     optional: "cpu" or "cuda" (default: cuda when torch sees a GPU)
    NTP_BACKEND    optional: "auto" (default: comm.choose_backend), "gloo" or "nccl"
    NTP_LOCAL_GPUS set by ntp-run when it pins each rank to a GPU: the distinct GPUs its ranks use
                   (each process then sees one, so torch's own count would say 1)
    NTP_LOG_FORMAT console or json: how the runtime's log lines look (ntp-run: console when its own
                   stderr is a terminal, else JSON lines)

Unless the script configured structlog itself, `worker_env()` does: to stderr, in NTP_LOG_FORMAT,
every line naming the worker (`worker=<id>`).

The layout source is the manager's watch stream (`GrpcLayoutSource`) with NTP_MANAGER, else the
layouts ntp-run publishes into the store (`StoreLayoutSource`). Either way step reports also go
into the store, where ntp-run follows the job's progress.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn

from ntp_manager.contract.logs import configure_logging
from ntp_manager.contract.tls import TlsFiles
from ntp_manager.worker.pipeline import Pipeline
from ntp_manager.worker.runtime import Runtime, RuntimeConfig, TimelineEvent
from ntp_manager.worker.sources import (
    GrpcLayoutSource,
    LayoutSource,
    RestoreNote,
    StepWork,
    StoreLayoutSource,
    WorkerLayout,
)
from ntp_manager.worker.tp import ShardStyle

REQUIRED = ("NTP_STORE", "NTP_JOB", "NTP_WORKER_ID")


def progress_key(job: str, worker: str) -> str:
    return f"ntp/{job}/progress/{worker}"


def pid_key(job: str, worker: str) -> str:
    return f"ntp/{job}/pid/{worker}"


class ReportingSource:
    """A layout source whose step reports also land in the store (`progress_key`: the step, its
    layout version, TP degree and global batch, as JSON), for ntp-run to follow. Everything else
    is the wrapped source's."""

    def __init__(self, inner: LayoutSource, store: Any, job: str, worker: str) -> None:
        self.inner, self.store, self.key = inner, store, progress_key(job, worker)

    def latest(self) -> WorkerLayout | None:
        return self.inner.latest()

    def get(self, version: int) -> WorkerLayout | None:
        return self.inner.get(version)

    def wait_newer(self, version: int, timeout: float) -> WorkerLayout | None:
        return self.inner.wait_newer(version, timeout)

    def ack(self, layout: WorkerLayout, ok: bool, detail: str = "", restored: RestoreNote | None = None) -> None:
        self.inner.ack(layout, ok, detail, restored)

    def report_step(self, layout: WorkerLayout, step: int, step_time_s: float, tokens: int,
                    work: StepWork | None = None) -> None:
        self.inner.report_step(layout, step, step_time_s, tokens, work)
        tp = layout.tp_of(layout.rank) if layout.rank is not None else 0
        self.store.set(self.key, json.dumps({"step": step, "version": layout.version, "tp": tp,
                                             "global_batch": layout.global_batch}))

    def close(self) -> None:
        self.inner.close()


@dataclass
class WorkerEnv:
    job: str
    worker_id: str
    gpu_uuid: str
    store: Any  # a TCPStore client of ntp-run's store
    source: LayoutSource
    manager: str  # "" when ntp-run publishes the layouts
    local_rank: int
    nproc: int
    device: str
    backend: str
    local_gpus: int | None = None  # distinct GPUs this host's ranks use (None: what torch sees)

    def config(self, **overrides: Any) -> RuntimeConfig:
        """A RuntimeConfig for this job and device; `overrides` set any other field."""
        base: dict[str, Any] = dict(job=self.job, device=self.device, backend=self.backend,
                                    local_rank=self.local_rank % max(self.nproc, 1),
                                    local_world_size=max(self.nproc, 1), local_gpus=self.local_gpus)
        return RuntimeConfig(**{**base, **overrides})

    def runtime(
        self,
        model_fn: Callable[[], nn.Module],
        optimizer_fn: Callable[[Any], torch.optim.Optimizer],
        plan: Mapping[str, ShardStyle] | None = None,
        *,
        post_parallelize: Callable[[nn.Module], None] | None = None,
        on_event: Callable[[TimelineEvent], None] | None = None,
        pipeline: Pipeline | None = None,
        scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
        **cfg: Any,
    ) -> Runtime:
        """A Runtime on this environment's store and layout source. `plan` None: `plan_for` of
        the model; `pipeline`: for layouts of several stages (worker/pipeline.py); `scheduler_fn`:
        an LR scheduler of each optimizer (docs/worker.md); `cfg`: RuntimeConfig fields (timeouts,
        seed)."""
        return Runtime(model_fn, plan, optimizer_fn, self.source, self.store, self.config(**cfg), on_event=on_event,
                       post_parallelize=post_parallelize, pipeline=pipeline, scheduler_fn=scheduler_fn)


def worker_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """The environment ntp-run gave this process. Raises RuntimeError naming what is missing when
    the script was not started by ntp-run."""
    e = os.environ if environ is None else environ
    missing = [k for k in REQUIRED if not e.get(k)]
    if missing:
        raise RuntimeError(f"not started by ntp-run: {', '.join(missing)} not set (run: ntp-run --nproc N script.py)")
    host, _, port = e["NTP_STORE"].rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError(f"NTP_STORE must be host:port, not {e['NTP_STORE']!r}")
    job, worker = e["NTP_JOB"], e["NTP_WORKER_ID"]
    if not structlog.is_configured():
        configure_logging("auto", fields={"worker": worker})
    store = dist.TCPStore(host, int(port), is_master=False,  # type: ignore[attr-defined]
                          timeout=dt.timedelta(seconds=300))
    store.set(pid_key(job, worker), str(os.getpid()))
    manager, gpu = e.get("NTP_MANAGER", ""), e.get("NTP_GPU_UUID", "")
    inner: LayoutSource
    if manager:
        if not gpu:
            raise RuntimeError("NTP_MANAGER is set but NTP_GPU_UUID is not: under a manager every rank is a GPU")
        inner = GrpcLayoutSource(manager, e.get("NTP_TOKEN", ""), job, gpu, worker, tls=TlsFiles.from_env(e))
    else:
        inner = StoreLayoutSource(store, job, worker)
    device = e.get("NTP_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise RuntimeError(f"NTP_DEVICE must be cpu or cuda, not {device!r}")
    backend = e.get("NTP_BACKEND") or "auto"
    if backend not in ("auto", "gloo", "nccl"):
        raise RuntimeError(f"NTP_BACKEND must be auto, gloo or nccl, not {backend!r}")
    local_gpus = e.get("NTP_LOCAL_GPUS", "")
    if local_gpus and not local_gpus.isdigit():
        raise RuntimeError(f"NTP_LOCAL_GPUS must be a count, not {local_gpus!r}")
    return WorkerEnv(job=job, worker_id=worker, gpu_uuid=gpu, store=store,
                     source=ReportingSource(inner, store, job, worker), manager=manager,
                     local_rank=int(e.get("NTP_LOCAL_RANK", "0")), nproc=int(e.get("NTP_NPROC", "1")),
                     device=device, backend=backend, local_gpus=int(local_gpus) if local_gpus else None)
