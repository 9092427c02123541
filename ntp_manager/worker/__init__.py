"""Training-side library: layout client, NTP layers, NTP gradient sync and live resharding.

Imports torch; install with the `worker` extra. Nothing in the manager imports this package.

The public API (docs/worker.md):

    from ntp_manager.worker import Runtime, RuntimeConfig, plan_for, worker_env

    env = worker_env()                          # under `ntp-run`: store, layout source, job
    rt = env.runtime(lambda: MyModel(config), lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    rt.start()
    while rt.step < steps:
        rt.train_step(batch_fn, loss_fn)

or, without the runtime, `parallelize(model, plan_for(model), units, group=tp_group)`.

The names load on first use (PEP 562), so that `ntp-run` checks its arguments before torch is
imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ntp_manager.worker.checkpoint import Checkpointer, CheckpointError, RestoreInfo, Retention, retention_plan
    from ntp_manager.worker.data import MapSource, SampleSource, TokenStream
    from ntp_manager.worker.env import WorkerEnv, worker_env
    from ntp_manager.worker.optim import OptimizerError
    from ntp_manager.worker.pipeline import Pipeline, split_layers, stage_module
    from ntp_manager.worker.plans import ModelPlan, plan_for
    from ntp_manager.worker.precision import PrecisionError
    from ntp_manager.worker.recompute import RecomputeError
    from ntp_manager.worker.reshard import apply_reshard, reshard_moves
    from ntp_manager.worker.runtime import (
        DataSourceError,
        ReconfigurationError,
        Runtime,
        RuntimeConfig,
        StepResult,
        TimelineEvent,
    )
    from ntp_manager.worker.sources import (
        GrpcLayoutSource,
        LayoutSource,
        StoreLayoutSource,
        WorkerLayout,
        publish_layout,
    )
    from ntp_manager.worker.sync import NtpGradSync, ReplicaGroup, SyncLayout, families_of
    from ntp_manager.worker.tp import (
        ColwiseUnits,
        ReplicatedPerUnit,
        RowwiseUnits,
        ShardedModule,
        ShardStyle,
        parallelize,
    )

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ColwiseUnits",
    "DataSourceError",
    "GrpcLayoutSource",
    "LayoutSource",
    "MapSource",
    "ModelPlan",
    "NtpGradSync",
    "OptimizerError",
    "Pipeline",
    "PrecisionError",
    "RecomputeError",
    "ReconfigurationError",
    "ReplicaGroup",
    "ReplicatedPerUnit",
    "RestoreInfo",
    "Retention",
    "RowwiseUnits",
    "Runtime",
    "RuntimeConfig",
    "SampleSource",
    "ShardStyle",
    "ShardedModule",
    "StepResult",
    "StoreLayoutSource",
    "SyncLayout",
    "TimelineEvent",
    "TokenStream",
    "WorkerEnv",
    "WorkerLayout",
    "apply_reshard",
    "families_of",
    "parallelize",
    "plan_for",
    "publish_layout",
    "reshard_moves",
    "retention_plan",
    "split_layers",
    "stage_module",
    "unit_counts",
    "worker_env",
]

_WHERE = {
    "CheckpointError": "checkpoint", "Checkpointer": "checkpoint", "RestoreInfo": "checkpoint",
    "Retention": "checkpoint", "retention_plan": "checkpoint",
    "WorkerEnv": "env", "worker_env": "env",
    "MapSource": "data", "SampleSource": "data", "TokenStream": "data", "DataSourceError": "runtime",
    "ModelPlan": "plans", "plan_for": "plans", "OptimizerError": "optim",
    "PrecisionError": "precision", "RecomputeError": "recompute",
    "Pipeline": "pipeline", "split_layers": "pipeline", "stage_module": "pipeline",
    "apply_reshard": "reshard", "reshard_moves": "reshard",
    "ReconfigurationError": "runtime", "Runtime": "runtime", "RuntimeConfig": "runtime", "StepResult": "runtime",
    "TimelineEvent": "runtime",
    "GrpcLayoutSource": "sources", "LayoutSource": "sources", "StoreLayoutSource": "sources",
    "WorkerLayout": "sources", "publish_layout": "sources",
    "NtpGradSync": "sync", "ReplicaGroup": "sync", "SyncLayout": "sync", "families_of": "sync",
    "ColwiseUnits": "tp", "ReplicatedPerUnit": "tp", "RowwiseUnits": "tp", "ShardedModule": "tp",
    "ShardStyle": "tp", "parallelize": "tp", "unit_counts": "tp",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
