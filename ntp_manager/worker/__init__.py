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
"""

from ntp_manager.worker.env import WorkerEnv, worker_env
from ntp_manager.worker.plans import ModelPlan, plan_for
from ntp_manager.worker.reshard import apply_reshard, reshard_moves
from ntp_manager.worker.runtime import (
    ReconfigurationError,
    Runtime,
    RuntimeConfig,
    StepResult,
    TimelineEvent,
    unit_counts,
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
    RowwiseUnits,
    ShardedModule,
    ShardStyle,
    parallelize,
)

__all__ = [
    "ColwiseUnits",
    "GrpcLayoutSource",
    "LayoutSource",
    "ModelPlan",
    "NtpGradSync",
    "ReconfigurationError",
    "ReplicaGroup",
    "RowwiseUnits",
    "Runtime",
    "RuntimeConfig",
    "ShardStyle",
    "ShardedModule",
    "StepResult",
    "StoreLayoutSource",
    "SyncLayout",
    "TimelineEvent",
    "WorkerEnv",
    "WorkerLayout",
    "apply_reshard",
    "families_of",
    "parallelize",
    "plan_for",
    "publish_layout",
    "reshard_moves",
    "unit_counts",
    "worker_env",
]
