"""The pure planner: GPU health in, DP replicas with TP degrees, local batches and power caps out.

No I/O, no clock, no framework imports: the simulator and the live manager call the same code.
"""

from ntp_manager.planner.moves import MoveSummary, PreviousLayout, diff_assignments
from ntp_manager.planner.plan import GroupPlan, Plan, ReplicaPlan, SetAside, make_plan
from ntp_manager.planner.spec import PAPER_POWER_CURVE, JobSpec, PlanError, PowerModel, Scheme

__all__ = [
    "PAPER_POWER_CURVE",
    "GroupPlan",
    "JobSpec",
    "MoveSummary",
    "Plan",
    "PlanError",
    "PowerModel",
    "PreviousLayout",
    "ReplicaPlan",
    "Scheme",
    "SetAside",
    "diff_assignments",
    "make_plan",
]
