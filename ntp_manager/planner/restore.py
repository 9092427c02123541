"""Does a new layout need a checkpoint? Which units no surviving GPU holds, and the step to restore.

Pure: two layouts (planner/layout.py: the one running now and the new one), the job's unit
counts, and the newest verified checkpoint step the manager knows of (a fact it read; None when it
knows none) in; the step to restore from (or None) and a reason out.

Who holds what, as the workers place it (worker/sync.py): in the layout running now, replica r's
stage-s group of TP degree t holds, at TP index j, the units `ntp_map(U, t, d).assignment[j]` of
every family of U units, where d is the lowest TP degree of stage s over the replicas. A GPU of
the running layout survives when the new layout places it too (a GPU left out has no rank to serve
its shards from). Unit u of stage s is lost when, in every replica, the GPU that held it is not a
survivor: live recovery has no peer to fetch it from, and the workers restore a checkpoint.
Ranges, not units: O(GPUs x families) per call, whatever the unit counts.

The manager knows the spec's families (heads, MLP columns); a model may shard more (vocabulary
rows). The workers decide for themselves whether they must restore (they see every family); the
step here tells them which checkpoint to load when they do.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping
from itertools import pairwise

from ntp_manager.contract.ntp_map import ntp_map
from ntp_manager.planner.layout import LayoutDoc

Range = tuple[int, int]


def _uncovered(units: int, held: list[Range]) -> list[Range]:
    """Ranges of [0, units) that no range of `held` covers."""
    out, at = [], 0
    for a, b in sorted(held):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < units:
        out.append((at, units))
    return out


def lost_units(previous: LayoutDoc, new: LayoutDoc, units: Mapping[str, int]) -> dict[int, dict[str, list[Range]]]:
    """Stage -> family -> ranges of units that no GPU of `previous` that `new` still places holds
    (empty when every unit has a surviving holder). Families with no units are skipped."""
    survivors = set(new.gpus)
    st, gs, tps, every = previous.group_starts, previous.gpu_starts, previous.group_tps, previous.gpus
    # A group whose every GPU survives holds every unit of its stage (a group's ranks split all of
    # them between them): nothing of that stage is lost. So only the groups holding a GPU that is
    # gone count (after a failure, a handful), found by position with no record per group: a stage
    # loses nothing while it has more groups than such groups (a 96,000-GPU job's replan spent a
    # fifth of its time here when it went through every group).
    hit: dict[int, set[int]] = {}  # stage -> its groups holding a GPU that is gone
    for k in (k for k, u in enumerate(every) if u not in survivors):
        g = bisect_right(gs, k) - 1
        i = bisect_right(st, g) - 1
        hit.setdefault(g - st[i], set()).add(g)
    if not hit:
        return {}
    depths = Counter(b - a for a, b in pairwise(st))  # groups per replica -> replicas
    out: dict[int, dict[str, list[Range]]] = {}
    for stage in sorted(hit):
        if sum(n for depth, n in depths.items() if depth > stage) > len(hit[stage]):
            continue
        groups = [(tps[st[i] + stage], every[gs[st[i] + stage]:gs[st[i] + stage + 1]])
                  for i in range(len(previous.replica_ids)) if st[i] + stage < st[i + 1]]
        sync = min(tp for tp, _ in groups)
        for fam, n in units.items():
            if n <= 0:
                continue
            held: list[Range] = []
            for tp, gpus in groups:
                m = ntp_map(n, tp, sync)
                held += [rg for j, u in enumerate(gpus) if u in survivors for rg in m.assignment[j]]
            gone = _uncovered(n, held)
            if gone:
                out.setdefault(stage, {})[fam] = gone
    return out


def _ranges_text(rs: list[Range]) -> str:
    shown = ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in rs[:4])
    return shown + (f" and {len(rs) - 4} more ranges" if len(rs) > 4 else "")


def restore_step(previous: LayoutDoc | None, new: LayoutDoc, units: Mapping[str, int],
                 checkpoint_step: int | None) -> tuple[int | None, str]:
    """(the step the workers restore from, or None; the reason, "" when nothing is lost).

    `previous`: the layout running now (None: the job's first layout, nothing to lose); `new`: the
    layout about to be published; `units`: family -> unit count; `checkpoint_step`: the newest
    verified checkpoint the manager knows of (None: it knows none)."""
    if previous is None:
        return None, ""
    lost = lost_units(previous, new, units)
    if not lost:
        return None, ""
    stage, fams = next(iter(lost.items()))
    fam, rs = next(iter(fams.items()))
    what = f"no surviving GPU holds units {_ranges_text(rs)} of {fam!r} in stage {stage}"
    more = sum(len(f) for f in lost.values()) - 1
    if more:
        what += f" (and {more} more families or stages)"
    if checkpoint_step is None:
        return None, f"{what}; the manager knows no verified checkpoint: the workers look for one themselves"
    return checkpoint_step, f"{what}: restore from the checkpoint of step {checkpoint_step}"
