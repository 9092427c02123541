"""Switching layouts: the failure path and the planned path (see the package doc).

    failure in a step -> _recover: leave the old groups -> _join_next: wait for the manager's next
    layout -> _join_chain -> _apply: rendezvous at the version's store prefix (_rendezvous), exchange
    who held what, settle a split commit (_roll_forward), plan every stage's moves (reshard_moves),
    make the TP groups, reshard (apply_reshard), give joiners the replicated state, new NTP syncs.

    a newer version seen at a commit -> _planned_switch: agree on a version every rank holds -> _apply.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ntp_manager.contract.ranks import locate, stage_ranks
from ntp_manager.worker import comm
from ntp_manager.worker.reshard import Move, apply_reshard, reshard_moves
from ntp_manager.worker.runtime.base import log
from ntp_manager.worker.runtime.config import ReconfigurationError, is_comm_failure
from ntp_manager.worker.runtime.joiners import _Joining, ensure_optimizer_state
from ntp_manager.worker.runtime.step import _Stepping
from ntp_manager.worker.sources import WorkerLayout
from ntp_manager.worker.sync import ReplicaGroup, SyncLayout
from ntp_manager.worker.tp import ShardedModule, parallelize

_STANDBY_ROUND_S = 60.0  # a spare logs that it still waits this often


class _Superseded(Exception):
    """A newer layout arrived while the ranks were meeting for this one: go on to `newer`."""

    def __init__(self, newer: WorkerLayout) -> None:
        self.newer = newer


def _agreed_cursor(info: list[tuple[float, ...]], survivors: dict[int, int]) -> int:
    """The sample cursor after the regroup: the survivors' (a rank one step behind that rolled
    forward counts its step's samples too, so the largest is every survivor's; the exchange's
    9th value, runtime/step.py)."""
    return max(int(info[nr][8]) for nr in survivors)


class _Switching(_Stepping, _Joining):
    """Leaving a layout and joining the next one, by failure or by agreement."""

    # ---- switching layouts ----------------------------------------------------------------------
    def _planned_switch(self, agreed: int) -> None:
        """Every member of the current group runs this after the same step. Agree on a version every
        rank holds (sources may skip versions), then switch to it."""
        lay = self.s.layout
        assert lay is not None
        while True:
            got = self.source.get(agreed) or self._wait_for(agreed)
            newest = self.source.latest()
            mine = torch.tensor([1.0 if got is not None else 0.0, float(newest.version if newest else -1)],
                                dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(lay.world)]
            comm.all_gather(every, mine, group=self.s.world)
            stacked = torch.stack(every)
            if bool((stacked[:, 0] > 0).all()):
                break
            agreed = int(stacked[:, 1].max().item())
        target = self.source.get(agreed)
        assert target is not None
        self._event("layout agreed", target.version, target.reason)
        self.switch_marks = [("layout agreed", time.time())]
        try:
            self._apply(target, planned=True)
        except _Superseded as e:
            self._event("layout received", e.newer.version, e.newer.reason)
            self._join_chain(e.newer)

    def _wait_for(self, version: int) -> WorkerLayout | None:
        deadline = time.monotonic() + self.cfg.reconfigure_timeout_s
        while time.monotonic() < deadline:
            got = self.source.get(version)
            if got is not None:
                return got
            newest = self.source.wait_newer(version - 1, 0.05)
            if newest is not None and newest.version > version:
                return None  # skipped: the next round agrees on a newer one
        raise ReconfigurationError(f"layout version {version} never arrived")

    def _recover(self, err: str) -> None:
        lay = self.s.layout
        assert lay is not None
        self._event("failure detected", lay.version, err)
        self.switch_marks = [("failure detected", time.time())]
        log.warning("collective failed; waiting for a new layout", version=lay.version, error=err)
        t = time.perf_counter()
        self._leave_group()
        self._mark("left old group")
        self._event("left old group", lay.version, f"{time.perf_counter() - t:.3f} s")
        self._join_next(lay.version, self.cfg.reconfigure_timeout_s)

    def _join_next(self, after: int, timeout: float) -> None:
        nxt = self.source.wait_newer(after, timeout)
        if nxt is None:
            raise ReconfigurationError(f"no layout newer than version {after} arrived within {timeout:.0f} s")
        self._join_received(nxt)

    def _join_received(self, nxt: WorkerLayout) -> None:
        self._event("layout received", nxt.version, nxt.reason)
        self._mark("layout received")
        self._join_chain(nxt)

    def _stand_by(self, after: int, timeout: float | None) -> None:
        """Wait for the next layout after version `after` and join it, as a rank no layout holds now
        (a fresh one, a spare): a spare is not a failure, so without a `timeout` it waits as long as
        it takes, saying so every minute; a source that can no longer deliver raises."""
        if timeout is not None:
            self._join_next(after, timeout)
            return
        waited = 0.0
        while True:
            nxt = self.source.wait_newer(after, _STANDBY_ROUND_S)
            if nxt is not None:
                self._join_received(nxt)
                return
            waited += _STANDBY_ROUND_S
            log.info("standing by: no layout includes this rank", after=after, waited_s=round(waited))

    def _join_chain(self, target: WorkerLayout) -> None:
        """Apply `target`, moving on to newer versions while a regroup cannot complete."""
        while True:
            try:
                self._apply(target)
                return
            except _Superseded as e:
                target = e.newer
                self._event("layout received", target.version, target.reason)  # moved on while meeting
            except Exception as e:
                if not is_comm_failure(e):
                    raise
                self._event("regroup failed", target.version, str(e).splitlines()[0][:160])
                self._leave_group()
                nxt = self.source.wait_newer(target.version, self.cfg.reconfigure_timeout_s)
                if nxt is None:
                    raise ReconfigurationError(
                        f"could not regroup at version {target.version} and no newer layout arrived") from e
                target = nxt
                self._event("layout received", target.version, target.reason)

    def _leave_group(self, keep: bool = False) -> None:
        """Destroy the current groups. References to them are dropped first: gloo closes a group's
        connections only when its last reference goes, and a closed connection is what tells peers
        still blocked in a collective with us to give up now rather than at their timeout. NCCL
        communicators are aborted (comm.leave). `keep` (NCCL, a planned switch, where torch can
        shrink): the sub-groups go, the version's default communicator stays for the next
        rendezvous to shrink (comm.shrink_plan decides; it is aborted there otherwise)."""
        if self.s.sync is not None:  # its gradient buffers serve the next layout's sync
            self.s.spare = self.s.sync.buffers()
            self.s.sync.release()
        self.s.sync = self.s.world = None
        self.s.syncs = []
        if self.s.model is not None:
            for m in self.s.model.modules():
                if isinstance(m, ShardedModule):
                    m.group = None
        lay = self.s.layout
        if keep and dist.is_initialized() and lay is not None and lay.rank is not None:
            if self._held is None:
                self._held = (f"{lay.epoch}.{lay.version}", lay.rank, lay.world)
            for r in self._groups:
                g = r()
                if g is not None:
                    dist.destroy_process_group(g)
                del g
        elif dist.is_initialized():
            self._held = None
            try:
                comm.leave(self.choice.backend, self.features)
            except Exception as e:  # a broken group may fail to tear down cleanly; it is dropped either way
                log.debug("destroying the old process group failed", error=str(e))
        comm.release_buffers()  # the next layout's messages have other sizes
        self._release_groups()

    def _release_groups(self) -> None:
        """Make sure no old group outlives the leave: a reference left somewhere (a reference cycle
        through a failed collective's traceback, say) would keep its connections open and leave a
        peer blocked on us until its timeout. Cheap when nothing is left; a full collection else."""
        left = [r for r in self._groups if r() is not None]
        self._groups = []
        if not left:
            return
        holders: set[str] = set()
        for r in left:
            g = r()
            holders.update(type(h).__name__ for h in (gc.get_referrers(g) if g is not None else ()))
            del g
        gc.collect()
        still = sum(r() is not None for r in left)
        log.warning("old process groups outlived the leave; collected", groups=len(left), held_by=sorted(holders),
                    still_alive=still)
        self._event("groups outlived leave", self.s.layout.version if self.s.layout else -1,
                    f"{len(left)} groups held by {sorted(holders)}; {still} still alive after a collection")

    def _rendezvous(self, target: WorkerLayout) -> None:
        assert target.rank is not None
        prefix = f"ntp/{self.cfg.job}/pg/v{target.epoch}.{target.version}"
        comm.publish_held(self.store, prefix, target.rank, self._held, self.choice.backend)
        arrivals = comm.arrival_keys(prefix, target.world)
        self.store.set(arrivals[target.rank], "1")  # by rank: a rank that comes twice is counted once
        self._meet(target, prefix, arrivals)
        self._mark("all arrived")
        shrinkable = self.choice.backend == "nccl" and self.features.shrink_group
        plan = comm.agree(self.store, prefix, target.world, self.choice.backend, shrinkable)
        self._mark("agreed")
        if plan.kind == "shrink" and self._held is not None and self._held[0] == plan.old_version:
            comm.shrink_default_group(plan.exclude)  # ncclCommShrink: no new communicator from nothing
            self._held = None
            if (dist.get_rank(), dist.get_world_size()) != (target.rank, target.world):
                raise ReconfigurationError(f"shrunk communicator gives rank {dist.get_rank()} of "
                                           f"{dist.get_world_size()}, the layout {target.rank} of {target.world}")
            self._event("communicator shrunk", target.version, plan.reason)
        else:
            if self._held is not None:
                self._held = None
                comm.leave(self.choice.backend, self.features)
            # torch.distributed imports PrefixStore without re-exporting it to type checkers (no `as`)
            comm.init_default_group(self.choice.backend, dist.PrefixStore(prefix, self.store),  # type: ignore[attr-defined]
                                    target.rank, target.world, self._timeout,
                                    self.device if self.device.type == "cuda" else None, self.features)
        self._mark("default group")
        # Nothing runs on the default group: after a failed collective torch 2.13 keeps a reference
        # to it that no collection frees, so its connections stay open after we leave, and a peer
        # blocked in a collective on it would wait for its timeout. Our own groups are released.
        self.s.world = dist.new_group(list(range(target.world)), timeout=self._timeout)
        self._track(self.s.world)
        self._mark("world group")

    def _meet(self, target: WorkerLayout, prefix: str, arrivals: list[str]) -> None:
        """Wait until the ranks of `target` settle its rendezvous (comm.settle): return on "go",
        raise _Superseded on "superseded", ReconfigurationError on "timed out". This rank claims
        "superseded" once it holds a newer layout (skipping the version even when every rank is
        in: one reshard instead of two), "go" once every rank counted itself in, "timed out" at
        its deadline; whichever claim came first holds for every rank. A rank that holds no newer
        layout yet when another gave the version up waits for one from its source."""
        deadline = time.monotonic() + self.cfg.rendezvous_timeout_s
        while True:
            newest = self.source.latest()
            claim: str | None = None
            if newest is not None and newest.version > target.version:
                claim = "superseded"
            elif self.store.check(arrivals):
                claim = "go"
            elif time.monotonic() > deadline:
                claim = "timed out"
            outcome = comm.settle(self.store, prefix, claim)
            if outcome == "go":
                return
            if outcome == "superseded":
                if newest is None or newest.version <= target.version:
                    newest = self.source.wait_newer(target.version, self.cfg.reconfigure_timeout_s)
                    if newest is None:
                        raise ReconfigurationError(
                            f"the ranks gave up version {target.version} for a newer layout, and none reached this "
                            f"rank within {self.cfg.reconfigure_timeout_s:.0f} s")
                raise _Superseded(newest)
            if outcome == "timed out":
                here = sum(bool(self.store.check([k])) for k in arrivals)
                raise ReconfigurationError(f"rendezvous for version {target.version} timed out: "
                                           f"{here} of {target.world} arrived")
            time.sleep(0.005)

    def _exchange_held(self, old: WorkerLayout | None, world: int) -> list[tuple[float, ...]]:
        """Every rank's record, gathered: old rank and the version it was a member of (-1 when
        fresh), committed steps; for `_roll_forward`: whether this rank holds the synced gradients
        of step `step` whose commit it did not see complete, the outcome (loss, norm) of the
        commit that made `step` where this rank made it, and its sample cursor. float64: every
        integer here is exact."""
        held = old is not None and old.rank is not None and self.s.model is not None
        if not held:
            self._uncommitted = None
        pending = self._uncommitted is not None and self._uncommitted.step == self.step
        last = self._last_commit if self._last_commit is not None and self._last_commit[0] == self.step else None
        norm = last[2] if last is not None else None
        mine = torch.tensor([old.rank if held and old else -1, old.version if held and old else -1, self.step,
                             float(pending), last[1] if last else 0.0, norm if norm is not None else 0.0,
                             float(last is not None), float(norm is not None), self.samples], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        comm.all_gather(every, mine, group=self.s.world)
        info = [tuple(float(x) for x in t.tolist()) for t in every]
        self._mark("exchanged ranks")
        return info

    def _stage_plans(
        self, target: WorkerLayout, survivors: Mapping[int, int], old_replicas: tuple[tuple[int, int], ...],
        old_degrees: tuple[tuple[int, ...], ...],
    ) -> tuple[dict[int, SyncLayout], dict[int, SyncLayout], dict[int, set[int]], dict[int, list[Move]]] | str:
        """Each stage: its old layout (new rank numbers for survivors, world + old rank for the
        gone), its new one, the survivors that held it, the moves. Checked on every rank before any
        message moves, so all refuse together: a string is the reason to restore instead."""
        world = target.world
        inverse = {r: nr for nr, r in survivors.items()}
        old_groups = stage_ranks(old_degrees)
        old_sl: dict[int, SyncLayout] = {}
        new_sl: dict[int, SyncLayout] = {}
        alive: dict[int, set[int]] = {}
        moves: dict[int, list[Move]] = {}
        for s in range(target.n_stages):
            units = self._info[s].units
            old_sl[s] = SyncLayout(tuple(ReplicaGroup(tuple(inverse.get(x, world + x) for x in old_groups[r][s]), b)
                                         for r, (_, b) in enumerate(old_replicas)), units)
            new_sl[s] = target.sync_layout(units, s)
            alive[s] = {nr for nr, r in survivors.items() if locate(old_degrees, r)[1] == s}
            if not alive[s]:
                return f"no surviving rank holds pipeline stage {s}: every rank that held its layers is gone"
            try:
                moves[s] = reshard_moves(old_sl[s], new_sl[s], alive[s])
            except ValueError as e:  # every holder of some unit of the stage is gone
                return f"pipeline stage {s}: {e}"
        return old_sl, new_sl, alive, moves

    def _replicate_to_joiners(self, target: WorkerLayout, alive: Mapping[int, set[int]], stage: int,
                              mine: tuple[Any, Any, Any], held: tuple[Any, Any, Any]) -> int:
        """Each stage's replicated values and their optimizer state, from one survivor to the ranks
        new to that stage; `mine` is this rank's (model, optimizer, scheduler) of its new stage,
        `held` of its old one. Returns how many ranks joined."""
        assert target.rank is not None
        rank = target.rank
        model, opt, sched = mine
        joiners = 0
        for s in range(target.n_stages):
            members = [r for g in target.group_ranks() for r in g[s]]
            new_here = [r for r in members if r not in alive[s]]
            if not new_here:
                continue
            joiners += len(new_here)
            staying = sorted(r for r in alive[s] if r in members)
            giver = staying[0] if staying else min(alive[s])
            if rank == giver:
                gm, go, gs = mine if stage == s else held
                assert gm is not None and go is not None
                self._send_replicated(gm, go, gs, giver, new_here)
            elif rank in new_here:
                self._send_replicated(model, opt, sched, giver, [rank])
        return joiners

    def _apply(self, target: WorkerLayout, planned: bool = False) -> None:
        """Leave the current group and join `target`'s: regroup, reshard every stage, ack.

        Pipelines: each stage is resharded on its own, from the survivors that held it (in any
        replica) to the ranks that hold it now. A rank that keeps its stage reshards in place; one
        whose group moved to another stage builds that stage's model, receives its shards, the
        replicated parameters and their optimizer state from that stage's survivors (DP peers),
        and meanwhile serves its old stage's shards to whoever needs them; a fresh rank is the
        same without the serving. When no survivor holds some stage (or some unit of it), every
        rank restores the newest checkpoint instead (`_restore_into`), or raises
        ReconfigurationError naming the stage when there is none; also when the pipeline depth
        changed."""
        old = self.s.layout
        self._attempt_nonce = None  # every rank of the new layout, fresh or not, starts without one
        if self.checkpointer is not None:  # a checkpoint's background copy reads the state a reshard changes
            self.checkpointer.fence()
        if target.n_stages > 1 and self.pipeline is None:
            raise ReconfigurationError(f"layout version {target.version} has {target.n_stages} pipeline stages but the "
                                       "Runtime has no pipeline: give it Runtime(..., pipeline=Pipeline(...))")
        # NCCL on a planned switch: keep the communicator, the next version may shrink it
        self._leave_group(keep=planned and target.rank is not None and self.choice.backend == "nccl"
                          and self.features.shrink_group and comm.can_shrink())
        if target.rank is None:
            self.s.spare = []
            self._event("no place", target.version, "this worker's GPU is not in the layout")
            self.s.layout = target
            self.source.ack(target, True, "no place")
            return
        self._rendezvous(target)
        rank, world, depth = target.rank, target.world, target.n_stages
        info = self._exchange_held(old, world)
        self._event("regrouped", target.version, f"world={world}")
        src_version = max((int(i[1]) for i in info if i[0] >= 0), default=-1)
        survivors = {nr: int(i[0]) for nr, i in enumerate(info) if i[0] >= 0 and int(i[1]) == src_version}
        steps = {int(info[nr][2]) for nr in survivors}
        if len(steps) > 1:
            agreed = self._roll_forward(info, survivors)
            if agreed is None:
                return self._restore_into(target, f"survivors disagree on the committed step ({sorted(steps)}) in a "
                                          "way a late commit cannot mend")
            steps = {agreed}
        self._uncommitted = None
        if not survivors and max(int(i[2]) for i in info) == 0:
            return self._restore_into(target, None)  # the job's first layout: a checkpoint, or a fresh model
        if not survivors:
            return self._restore_into(target, "no rank of the new layout holds the model state")
        self.step = steps.pop()
        self.samples = _agreed_cursor(info, survivors)
        src = min(survivors)
        obj: list[Any] = [(old.replicas, old.degrees) if rank == src and old else None]
        if len(survivors) < world:  # some rank holds no old layout (or an older one): the oldest survivor's
            comm.broadcast_object_list(obj, src=src, group=self.s.world)
        else:  # every rank held version src_version, whose replicas and degrees are the same for all
            assert old is not None
            obj = [(old.replicas, old.degrees)]
        self._mark("old layout")
        old_replicas: tuple[tuple[int, int], ...] = tuple((int(r[0]), int(r[1])) for r in obj[0][0])
        old_degrees = tuple(tuple(int(d) for d in st) for st in obj[0][1])
        if len(old_degrees[0]) != depth:
            raise ReconfigurationError(f"the pipeline depth changed from {len(old_degrees[0])} to {depth} stages: "
                                       "stages cannot be re-cut live; restart from a checkpoint")
        _, stage, _ = target.where(rank)
        old_stage = locate(old_degrees, survivors[rank])[1] if rank in survivors else None
        fresh = self._fresh_model(stage, depth) if old_stage != stage else None  # also reads every stage's plan
        plans = self._stage_plans(target, survivors, old_replicas, old_degrees)
        if isinstance(plans, str):
            return self._restore_into(target, plans)
        old_sl, new_sl, alive, moves = plans
        self._mark("checked")
        my_tp = self._tp_groups(target)
        self._mark("tp groups")
        held_model, held_opt, held_sched = self.s.model, self.s.opt, self.s.sched  # the old stage's, if held
        if fresh is not None:  # a fresh or stale rank, or a group that changed stage: values from peers
            model = fresh
            parallelize(model, self._info[stage].plan, new_sl[stage].units_of(rank), group=my_tp)
            self._fix(model, resharded=False)
            model.to(self.device)
            opt, sched = self._make_optimizer(model)
            if self.step > 0:
                ensure_optimizer_state(opt)
        else:
            assert held_model is not None and held_opt is not None
            model, opt, sched = held_model, held_opt, self.s.sched
        freed: list[torch.Tensor] = []  # the replaced shards' memory, for the new gradient buffers
        for s in range(depth):  # every rank the same order, so point-to-point pairs match
            if s == stage:
                opt = apply_reshard(model, opt, old_sl[s], new_sl[s], alive[s], rank, self._info[s].families, my_tp,
                                    group=self.s.world, moves=moves[s], freed=freed if fresh is None else None)
            elif s == old_stage:  # a source only: it holds none of this stage any more
                assert held_model is not None and held_opt is not None
                apply_reshard(held_model, held_opt, old_sl[s], new_sl[s], alive[s], rank, self._info[s].families,
                              None, group=self.s.world, moves=moves[s])
        self._mark("reshard moves")
        self._fix(model, resharded=True)
        if rank in alive[stage]:
            # This rank's model now holds `target`'s units of its stage, and its replicated values are
            # its own: from here on a failure (a joiner dying while it receives, say) must find it
            # described as a member of `target`, or the next regroup would move its units by the old
            # layout's unit lists and fill what it no longer holds with garbage. A joiner is marked
            # only once it has received the replicated values too (below).
            self.s.model, self.s.opt, self.s.sched, self.s.stage = model, opt, sched, stage
            self.s.layout, self.s.sync_layout = target, new_sl[stage]
        joiners = self._replicate_to_joiners(target, alive, stage, (model, opt, sched),
                                             (held_model, held_opt, held_sched))
        held_model = held_opt = held_sched = None
        self._mark("replicated")
        self.s.model, self.s.opt, self.s.sched, self.s.stage = model, opt, sched, stage
        self.s.sync = self._new_sync(model, target, rank, scratch=freed)
        del freed
        self._mark("sync")
        self.s.layout, self.s.sync_layout = target, new_sl[stage]
        self._event("reshard done", target.version,
                    f"tp={self.tp} stage={stage} joiners={joiners} survivors={len(survivors)}"
                    + (f" stage {old_stage}->{stage}" if old_stage is not None and old_stage != stage else ""))
        self.source.ack(target, True)

