"""Global rank numbering of a job's GPUs, shared by the manager's layout export and the workers.

Ranks count replica by replica (in layout order), inside a replica stage by stage (pipeline order),
inside a stage TP index by TP index. A layout is described by `degrees`: for every replica, the TP
degree of each of its stages, e.g. `((4, 3), (4, 4))` for two 2-stage replicas whose first one runs
stage 1 at TP3. Every replica has the same number of stages (the job's pipeline depth).

    degrees ((4, 3), (4, 4)) -> replica 0: stage 0 ranks 0-3, stage 1 ranks 4-6;
                                replica 1: stage 0 ranks 7-10, stage 1 ranks 11-14

Pure: no I/O, no torch. The manager numbers the GPUs of a plan with it (service/views.py) and the
runtime finds its peers with it (worker/sources.py), so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

Degrees = Sequence[Sequence[int]]


def check_degrees(degrees: Degrees) -> int:
    """The pipeline depth of `degrees`. Raises ValueError for no replica, a replica without
    stages, replicas of different depth, or a degree below 1."""
    if not degrees:
        raise ValueError("a layout needs at least one replica")
    depth = len(degrees[0])
    for i, stages in enumerate(degrees):
        if len(stages) != depth or depth == 0:
            raise ValueError(f"replica {i} has {len(stages)} stages, replica 0 has {depth}: every replica of a "
                             "job is a pipeline of the same depth")
        if any(int(d) < 1 for d in stages):
            raise ValueError(f"replica {i}: TP degrees must be >= 1, got {list(stages)}")
    return depth


def stage_ranks(degrees: Degrees) -> list[list[range]]:
    """[replica][stage] -> that group's global ranks, in TP order."""
    check_degrees(degrees)
    out: list[list[range]] = []
    r = 0
    for stages in degrees:
        row = []
        for d in stages:
            row.append(range(r, r + int(d)))
            r += int(d)
        out.append(row)
    return out


def world_size(degrees: Degrees) -> int:
    return sum(int(d) for stages in degrees for d in stages)


def global_rank(degrees: Degrees, replica: int, stage: int, index: int) -> int:
    """The global rank of TP index `index` of `stage` of `replica`. Raises IndexError when the
    position is not in the layout."""
    if not 0 <= replica < len(degrees) or not 0 <= stage < len(degrees[replica]):
        raise IndexError(f"no stage {stage} of replica {replica} in a layout of {len(degrees)} replicas")
    if not 0 <= index < int(degrees[replica][stage]):
        raise IndexError(f"TP index {index} out of range for replica {replica} stage {stage} "
                         f"(degree {degrees[replica][stage]})")
    before = sum(int(d) for stages in degrees[:replica] for d in stages) + sum(
        int(d) for d in degrees[replica][:stage])
    return before + index


def locate(degrees: Degrees, rank: int) -> tuple[int, int, int]:
    """(replica, stage, TP index) of a global rank. Raises ValueError when the rank is not in
    the layout."""
    r = 0
    for ri, stages in enumerate(degrees):
        for si, d in enumerate(stages):
            if r <= rank < r + int(d):
                return ri, si, rank - r
            r += int(d)
    raise ValueError(f"rank {rank} is not in a layout of {r} ranks")
