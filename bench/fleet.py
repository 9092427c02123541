"""Fleet-mode benchmark (issue 30): three managers on PostgreSQL, every one
taking agent streams; simulated agents in load-generator processes of their own
(bench/fleet_load.py), so that what is measured is the managers.

Phases (the figures each one prints):
1. registration: N agents (8 GPUs each) spread over the three managers say hello; wall time until
   every agent is welcomed and until the leader has applied every hello (`nodes` holds N rows and
   the outbox cursor is at its head);
2. ingest, no job: every agent of the managers named sends K state-changing reports (GPU 0 degraded,
   healthy, ...; the next once the last is acknowledged), with 1, 2 and 3 ingesting managers (the
   leader last): acknowledged reports/s, the wall time until the leader applied them, and each
   manager's CPU per report (the leader's, in the phases it takes no agents' reports, is its CPU per
   report it consumes);
3. a job of N TP8 replicas; then `--rounds` leader failures, SIGKILL and SIGSTOP by turns, each
   once the managers' balance has spread the clients again (at most 60 s; a third each, as between
   real failovers): at the kill one agent on a standby reports a GPU failed; the time from the kill
   to the first layout at the new epoch (REST on the managers left) and to when the new leader wrote
   it (its row's stamp); a SIGSTOPped leader is woken and must exit 75; the failed manager is
   started again as a standby;
4. (run before the leader failures of 3, while each manager holds a third of the agents) a standby
   SIGKILLed: how long its agents were without a stream before another manager welcomed them, and
   when the last of them was welcomed (each generator stamps its welcomes);
5. the counters, against the database: acknowledged reports lost, reports applied twice, rows a
   deposed leader's sessions wrote after the takeover (a trigger logs each row's session), outbox
   rows quarantined.

With `--watchers N`, N layout watches (bench/fleet_watchers.py, in `--watcher-procs` processes of
their own) spread over the three managers once the job has its first layout; each failover round
then also reports the watch streams that reconnected although their manager lived (the goal: 0)
and how long until every watch had the new epoch's layout, and the standby kill how many watches
moved and how long they were without a stream.

Usage: python bench/fleet.py [--agents 2000] [--reports 3] [--rounds 4] [--procs 3]
                             [--watchers 0] [--watcher-procs 3]
                             [--lease-ttl 2] [--renew 0.4] [--balance-s 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cpu_of_name, cpu_seconds, drop_postgres, fresh_postgres, machine_busy, machine_line
from ntp_manager.manager_process import ManagerProcess
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import db, write_log

LEADER_TABLES = (*write_log.TABLES, "outbox_state", "outbox_quarantine", "agent_commands")


class Child:
    """A generator process of the bench: one JSON line in (its config, then commands), one JSON line
    out per command."""

    def __init__(self, script: str, label: str, config: dict[str, Any]) -> None:
        self.label = label
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name(script))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._send(config)

    def _send(self, d: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(d) + "\n")
        self.proc.stdin.flush()

    async def ask(self, d: dict[str, Any]) -> dict[str, Any]:
        self._send(d)
        assert self.proc.stdout is not None
        line = await asyncio.to_thread(self.proc.stdout.readline)
        if not line:
            raise RuntimeError(f"{self.label} ended (status {self.proc.poll()})")
        return dict(json.loads(line))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._send({"cmd": "quit"})
        with contextlib.suppress(Exception):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()


# the agents' heartbeat period: 0 beats as the agent does when its counters do not change (the
# welcome's longest quiet); set to compare (2.0: every liveness period, as agents did before)
HEARTBEAT_S = float(os.environ.get("NTP_BENCH_HEARTBEAT_S", "0"))


# before the idle window that the ingest figures are net of: every manager under this share of a
# core for SETTLED_PROBES seconds in a row (or SETTLE_MAX_S seconds waited), and the window itself
# measured again, up to IDLE_TRIES times, while a manager is over that share in it
SETTLED_SHARE, SETTLED_PROBES, SETTLE_MAX_S, IDLE_TRIES = 0.12, 3, 60.0, 5


class Gen(Child):
    """One load-generator process (bench/fleet_load.py)."""

    def __init__(self, targets: list[str], nodes: list[tuple[str, str]], k: int, spread: bool) -> None:
        self.nodes = [n for n, _ in nodes]
        # the manager each agent says hello to first: the process's first address, or with `spread`
        # agent i's is targets[i % len(targets)] (every process's agents spread over the managers)
        self.first = [targets[i % len(targets)] if spread else targets[0] for i in range(len(nodes))]
        super().__init__("fleet_load.py", f"load generator {k}",
                         {"targets": targets, "nodes": nodes, "gpus": 8, "heartbeat_s": HEARTBEAT_S,
                          "spread": spread})

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)


class WatchGen(Child):
    """One process of simulated layout watches (bench/fleet_watchers.py)."""

    def __init__(self, targets: list[str], token: str, gpus: list[str]) -> None:
        self.n = len(gpus)
        super().__init__("fleet_watchers.py", "watch generator",
                         {"targets": targets, "token": token, "job": "fleet", "gpus": gpus})


async def watchers_start(args: argparse.Namespace, grpcs: list[str], token: str, nodes: list[str]) -> list[WatchGen]:
    """`--watchers` layout watches over `--watcher-procs` processes, spread over the managers."""
    if args.watchers <= 0:
        return []
    gpus = [f"GPU-{nodes[i % len(nodes)]}-{(i // len(nodes)) % 8}" for i in range(args.watchers)]
    t0 = time.perf_counter()
    gens = [WatchGen(grpcs[k % 3:] + grpcs[:k % 3], token, gpus[k::args.watcher_procs])
            for k in range(args.watcher_procs)]
    ready = await asyncio.gather(*(g.ask({"cmd": "ready"}) for g in gens))
    print(f"{args.watchers} layout watches: all have a layout {time.perf_counter() - t0:.1f} s "
          f"(generator CPU {[round(r['cpu_s'], 1) for r in ready]} s)", flush=True)
    return gens


async def watchers_stats(gens: list[WatchGen]) -> dict[str, Any]:
    st = await asyncio.gather(*(g.ask({"cmd": "stats"}) for g in gens))
    lost: dict[str, int] = {}
    epochs: dict[int, int] = {}
    for s in st:
        for k, v in s["lost_from"].items():
            lost[k] = lost.get(k, 0) + v
        for e, v in s["epochs"].items():
            epochs[int(e)] = epochs.get(int(e), 0) + v
    return {"connected": sum(s["connected"] for s in st), "reconnects": sum(s["reconnects"] for s in st),
            "moved": sum(s["moved"] for s in st), "lost_from": lost, "epochs": epochs,
            "gaps_s": [g for s in st for g in s["gaps_s"]], "on": [a for s in st for a in s["on"]],
            "gaps_by_gen": [s["gaps_s"] for s in st], "served_at": [t for s in st for t in s["served_at"]],
            "cpu_s": [round(s["cpu_s"], 1) for s in st]}


def _lost_from(before: dict[str, Any], after: dict[str, Any], addr: str) -> int:
    return int(after["lost_from"].get(addr, 0) - before["lost_from"].get(addr, 0))


async def watchers_failover(gens: list[WatchGen], before: dict[str, Any], epoch_before: int, t_kill: float,
                            killed: str, t_kill_wall: float) -> dict[str, Any] | None:
    """After a leader failure: when the first watch got a layout of a newer epoch (stamped by its
    generator as it arrived) and how long until every watch had one, and how many watch streams
    reconnected although their manager lived (the goal: 0)."""
    if not gens:
        return None
    total = sum(g.n for g in gens)
    lag = [0.0] * len(gens)
    await asyncio.gather(*(g.ask({"cmd": "epochs"}) for g in gens))  # resets the lag probes
    while True:  # the small "epochs" answer: the full stats (every gap, every address) are MBs
        polls = await asyncio.gather(*(g.ask({"cmd": "epochs"}) for g in gens))
        lag = [max(a, float(p["lag_max_s"])) for a, p in zip(lag, polls, strict=True)]
        new = sum(v for p in polls for e, v in p["epochs"].items() if int(e) > epoch_before)
        if new >= total or time.perf_counter() - t_kill > 120:
            break
        await asyncio.sleep(0.25)
    all_s = time.perf_counter() - t_kill
    firsts = [t for p in polls for e, t in p["first_at"].items() if int(e) > epoch_before]
    now = await watchers_stats(gens)
    delta = now["reconnects"] - before["reconnects"]
    of_killed = _lost_from(before, now, killed)
    balance = now["moved"] - before["moved"]  # moved for balance, not by the failover
    return {"first_new_epoch_s": min(firsts) - t_kill_wall if firsts else None,
            "all_new_epoch_s": all_s, "reconnects_of_live_managers": delta - of_killed - balance,
            "moved_for_balance": balance, "generator_lag_max_s": lag,
            "reconnects_of_the_killed_leader": of_killed, "new_epoch_watchers":
            sum(v for e, v in now["epochs"].items() if e > epoch_before), "watchers": total}


async def watchers_standby_kill(gens: list[WatchGen], before: dict[str, Any], killed: str,
                                served_s: float | None, killed_at: float) -> dict[str, Any] | None:
    """After a standby's SIGKILL: its watches served elsewhere (`served_s` after the kill, as the
    caller measured; None: not within 120 s), the others untouched."""
    if not gens:
        return None
    total = sum(g.n for g in gens)
    now = await watchers_stats(gens)
    # per generator: a list joined across generators cannot be cut at the old length
    gaps = [g for old, new in zip(before["gaps_by_gen"], now["gaps_by_gen"], strict=True) for g in new[len(old):]]
    served = [t for t in now["served_at"] if t >= killed_at]
    of_killed = _lost_from(before, now, killed)
    return {"all_served_s": served_s, "last_served_s": max(served) - killed_at if served else None,
            "moved": of_killed,
            "reconnects_of_live_managers": now["reconnects"] - before["reconnects"] - of_killed
            - (now["moved"] - before["moved"]),
            "moved_for_balance": now["moved"] - before["moved"],
            "gap_max_s": max(gaps) if gaps else None, "gap_p50_s": statistics.median(gaps) if gaps else None,
            "connected": now["connected"], "watchers": total}
# ["--native"] with --profile-native: C frames (gRPC's core, asyncpg's codecs) too; py-spy then
# pauses the process at each sample (blocking mode), so the figures of such a run are not the ones to quote
NATIVE: list[str] = []


class Profile:
    """`py-spy record` of one manager process over a window (`--profile`): sampled stacks in py-spy's
    raw (collapsed) format, summed at the end into the functions that cost the most, self and total."""

    def __init__(self, pid: int, label: str, out: Path) -> None:
        self.label, self.out = label, out
        exe = Path(sys.executable).with_name("py-spy")
        self.proc = subprocess.Popen([str(exe), "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                                      "--threads", *(NATIVE or ["--nonblocking"]), "-o", str(out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(self, top: int = 15) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if not self.out.exists():
            err = self.proc.stderr.read() if self.proc.stderr else ""
            print(f"profile of {self.label}: py-spy wrote nothing ({err.strip()[-300:]})", flush=True)
            return {}
        return summarize(self.out, self.label, top)


def summarize(path: Path, label: str, top: int = 15) -> dict[str, Any]:
    """The busiest functions of a py-spy raw profile: self samples (the frame on top) and total samples
    (anywhere on the stack), the main thread's and the worker threads' apart; idle samples (a thread
    waiting in select/epoll or on a lock) are counted, not ranked."""
    self_n: dict[str, int] = {}
    total_n: dict[str, int] = {}
    busy = idle = 0
    idle_leaves = ("select (selectors.py", "poll (", "wait (threading.py", "_worker (concurrent", "sleep (")
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if any(frames[-1].startswith(x) or x in frames[-1] for x in idle_leaves):
            idle += int(n)
            continue
        busy += int(n)
        thread = frames[0].split(" ")[0] if frames[0].startswith("thread") or frames[0].startswith("process") else ""
        leaf = frames[-1]
        self_n[leaf] = self_n.get(leaf, 0) + int(n)
        for f in set(frames[1:]) if thread else set(frames):
            total_n[f] = total_n.get(f, 0) + int(n)
    rank_self = sorted(self_n.items(), key=lambda kv: -kv[1])[:top]
    rank_total = sorted(((f, k) for f, k in total_n.items() if "ntp_manager" in f or "sqlalchemy" in f
                         or "asyncpg" in f), key=lambda kv: -kv[1])[:top]
    print(f"profile of {label}: {busy} busy samples, {idle} idle ({path})", flush=True)
    for f, k in rank_self:
        print(f"  self  {k / max(1, busy):6.1%}  {f[:150]}", flush=True)
    for f, k in rank_total:
        print(f"  total {k / max(1, busy):6.1%}  {f[:150]}", flush=True)
    return {"busy_samples": busy, "idle_samples": idle, "self": rank_self, "total": rank_total, "raw": str(path)}


async def outbox_state(pg: str) -> tuple[int, int, int]:
    c = await asyncpg.connect(pg)
    try:
        head = await c.fetchval("SELECT coalesce(max(seq), 0) FROM outbox")
        cursor = await c.fetchval("SELECT coalesce(max(last_seq), 0) FROM outbox_state WHERE consumer = 'leader'")
        nodes = await c.fetchval("SELECT count(*) FROM nodes")
    finally:
        await c.close()
    return int(head), int(cursor), int(nodes)


async def until_applied(pg: str, nodes: int = 0, timeout: float = 600) -> float:
    """Until the leader's cursor is at the outbox head (and `nodes` nodes exist); when it was."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        head, cursor, n = await outbox_state(pg)
        if cursor >= head and n >= nodes:
            return time.perf_counter()
        await asyncio.sleep(0.05)
    raise TimeoutError("the leader did not apply the outbox in time")


def rest_client(http: str, op: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://{http}", timeout=2, headers={"Authorization": f"Bearer {op}"})


async def layout_epoch(http: str, op: str, client: httpx.AsyncClient | None = None) -> int | None:
    """The leader epoch of the job's current layout as `http` answers over REST (None: no answer,
    or a standby's redirect). With `client`, on its kept connection (a failover round polls that
    way: a new client per read cost the bench tens of ms a poll, coarsening what it measured)."""
    with contextlib.suppress(Exception):
        if client is not None:
            r = await client.get("/v1/jobs/fleet/layout")
            return int(r.json()["leader_epoch"]) if r.status_code == 200 else None
        async with rest_client(http, op) as h:
            r = await h.get("/v1/jobs/fleet/layout")
            if r.status_code == 200:
                return int(r.json()["leader_epoch"])
    return None


async def prepared(http: str) -> tuple[float, float] | None:
    """A manager's preparations ahead of a takeover so far, and their wall seconds (its /metrics;
    service/leadership/follow.py): the ingest figures say which windows held one. None when the
    manager did not answer (the figure is then left out, not taken as none)."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        async with httpx.AsyncClient(base_url=f"http://{http}", timeout=5) as h:
            r = await h.get("/metrics")
            r.raise_for_status()
            vals = {"ntp_world_follow_prepared_total": 0.0, "ntp_world_follow_prepare_seconds_total": 0.0}
            for line in r.text.splitlines():
                name, _, value = line.partition(" ")
                if name in vals:
                    vals[name] = float(value)
            return vals["ntp_world_follow_prepared_total"], vals["ntp_world_follow_prepare_seconds_total"]
    return None



def prepared_between(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict[str, Any]:
    """The preparations that ended between two readings of `prepared` (None where one is missing)."""
    if before is None or after is None:
        return {"preparations": None, "preparation_s": None}
    return {"preparations": int(after[0] - before[0]), "preparation_s": round(after[1] - before[1], 3)}


TIMELINE = {"leading": "lease taken", "manager started": "state loaded", "applying the outbox": "replay began",
            "outbox caught up": "replay done", "layout published": "layout published"}


def takeover_timeline(log: Path, epoch: int, t_kill_wall: float) -> dict[str, float]:
    """Seconds from the kill to each step of the takeover at `epoch`, from the managers' log
    (JSON lines; the managers and the bench share this machine's clock)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError), log.open() as f:
        for line in f:
            if '"epoch": ' + str(epoch) not in line or not line.startswith("{"):
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            step = TIMELINE.get(d.get("event", ""))
            if step is None or d.get("epoch") != epoch or step in out:
                continue
            at = datetime.fromisoformat(str(d["timestamp"]).replace("Z", "+00:00")).timestamp()
            out[step] = round(at - t_kill_wall, 2)
    return out


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    url = await fresh_postgres(args.postgres, "ntp_fleet")
    pg = url.replace("postgresql+asyncpg://", "postgresql://")
    tmp = Path(tempfile.mkdtemp(prefix="ntp-fleet-bench-"))
    procs: dict[str, ManagerProcess] = {}
    gens: list[Gen] = []
    wgens: list[WatchGen] = []
    out: dict[str, Any] = {"agents": args.agents, "gpus": args.agents * 8, "machine": machine_line()}
    try:
        n = args.agents
        m = Manager(Settings(database_url=url))
        await db.upgrade(m.engine)
        nodes = [f"f-{i:05d}" for i in range(n)]
        tokens = await m.token_service.create_agents(nodes, "bench")
        op = await m.create_token("bench-op", "operator")
        wtok = await m.create_token("bench-worker", "worker")  # --watchers
        await m.engine.dispose()
        await write_log.install(url, LEADER_TABLES)
        env = {"NTP_LEASE_TTL_S": str(args.lease_ttl), "NTP_LEASE_RENEW_S": str(args.renew),
               "NTP_TAKEOVER_GRACE_S": "30", "NTP_SUSPECT_AFTER_S": "60", "NTP_FAIL_AFTER_S": "120",
               "NTP_LOG_FORMAT": "json", "NTP_MAX_CLUSTER_GPUS": str(max(100_000, n * 8))}
        if args.balance_s > 0:
            env["NTP_FLEET_BALANCE_S"] = str(args.balance_s)
        counter = iter(range(1000))

        def start(slot: int) -> ManagerProcess:
            p = ManagerProcess(f"m{slot}-{next(counter)}", url, tmp / "managers.log", env)
            procs[p.name] = p
            return p

        slots: list[ManagerProcess] = []

        async def restart(slot: int) -> ManagerProcess:
            """Start slot's manager again (it stopped or exited) and point every client that listed
            the old address at the new one; returns the old process."""
            gone = slots[slot]
            p = start(slot)
            await p.ready_async(300)
            for g in gens:
                await g.ask({"cmd": "retarget", "old": gone.grpc, "new": p.grpc})
            for wg in wgens:
                await wg.ask({"cmd": "retarget", "old": gone.grpc, "new": p.grpc})
            slots[slot] = p
            return gone
        for k in range(3):
            p = start(k)
            await p.ready_async(300)
            slots.append(p)
        assert slots[0].info["role"] == "leader"
        grpcs = [p.grpc for p in slots]

        # ---- 1. registration --------------------------------------------------------------------
        per = args.procs
        rcpu0 = [cpu_seconds(p.proc.pid) for p in slots]
        rprofs = [Profile(slots[0].proc.pid, "the leader (registration)", tmp / "profile-reg-leader.txt"),
                  Profile(slots[1].proc.pid, "standby m1 (registration)", tmp / "profile-reg-standby.txt")] \
            if args.profile else []
        t0 = time.perf_counter()
        for gk in range(per):
            agents = [(nodes[i], tokens[nodes[i]]) for i in range(gk, n, per)]
            home = gk % 3  # without --spread-agents: the process's agents go to one manager first
            gens.append(Gen(grpcs if args.spread_agents else [grpcs[(home + j) % 3] for j in range(3)], agents,
                            gk, args.spread_agents))
        ready = await asyncio.gather(*(g.ask({"cmd": "ready"}) for g in gens))
        t_welcomed = time.perf_counter()
        reg_errors = [(await g.ask({"cmd": "stats"}))["errors"] for g in gens]
        if any(reg_errors):
            print(f"registration: stream ends before every agent was welcomed {reg_errors}", flush=True)
        t_applied = await until_applied(pg, n)
        rcpu = [cpu_seconds(p.proc.pid) - c for p, c in zip(slots, rcpu0, strict=True)]
        if rprofs:
            out["profile_registration"] = {p.label: p.stop() for p in rprofs}
        # each agent says hello to its preferred manager first; the leader applies every hello
        taken = [sum(g.first.count(grpcs[k]) for g in gens) for k in range(3)]
        out["registration"] = {"welcomed_s": t_welcomed - t0, "applied_s": t_applied - t0,
                               "generator_cpu_s": [r["cpu_s"] for r in ready],
                               "manager_cpu_s": [round(c, 3) for c in rcpu], "hellos_taken": taken,
                               "leader_cpu_us_per_hello_applied": round(rcpu[0] / n * 1e6, 1),
                               "standby_cpu_us_per_hello_taken": [round(rcpu[k] / taken[k] * 1e6, 1)
                                                                  for k in (1, 2) if taken[k]]}
        print(f"registration of {n} nodes: all welcomed {t_welcomed - t0:.1f} s, applied by the leader "
              f"{t_applied - t0:.1f} s; CPU per hello: leader (takes {taken[0]}, applies all) "
              f"{out['registration']['leader_cpu_us_per_hello_applied']} us, standbys (take) "
              f"{out['registration']['standby_cpu_us_per_hello_taken']} us", flush=True)

        # ---- 2. ingest --------------------------------------------------------------------------
        # each manager's CPU while its agents only send heartbeats: subtracted from the leader's CPU
        # in the phases it consumes, so that its CPU per report consumed is the consuming alone.
        # First the managers settle: a standby follows the registration's log and prepares its
        # planner for a while after the last welcome (at 12,500 agents a standby still spent a
        # third of a core in the idle window, and its "net of idle" figures went negative). Quiet
        # for SETTLED_PROBES seconds in a row, then the idle window; a standby prepares its planner
        # again some seconds after its last time (service/leadership/follow.py's PRIME_SPACING),
        # which may fall in the window: a window with a manager over SETTLED_SHARE is measured again
        t_settle, idle_rate = time.perf_counter(), [1.0]
        for attempt in range(IDLE_TRIES):
            quiet = 0
            while time.perf_counter() - t_settle < SETTLE_MAX_S:
                c0, t_probe = [cpu_seconds(p.proc.pid) for p in slots], time.perf_counter()
                await asyncio.sleep(1.0)
                rates = [(cpu_seconds(p.proc.pid) - c) / (time.perf_counter() - t_probe)
                         for p, c in zip(slots, c0, strict=True)]
                quiet = quiet + 1 if max(rates) < SETTLED_SHARE else 0
                if quiet >= SETTLED_PROBES:
                    break
            idle0, ti = [cpu_seconds(p.proc.pid) for p in slots], time.perf_counter()
            await asyncio.sleep(args.idle_s)
            idle_rate = [(cpu_seconds(p.proc.pid) - c) / (time.perf_counter() - ti) for p, c in zip(slots, idle0,
                                                                                                   strict=True)]
            if max(idle_rate) < SETTLED_SHARE:
                break
            print(f"idle window {attempt + 1}: managers' CPU {[f'{r:.1%}' for r in idle_rate]}, not idle; again",
                  flush=True)
        out["settled_after_registration_s"] = round(time.perf_counter() - t_settle, 1)
        out["idle_cpu_share"] = [round(r, 3) for r in idle_rate]
        print(f"idle (heartbeats only): managers' CPU {[f'{r:.1%}' for r in idle_rate]}", flush=True)
        out["ingest"] = []
        for homes in ([1], [1, 2], [0, 1, 2]):
            busy = gens  # each sends the reports of its agents on those managers
            prep0 = await asyncio.gather(*(prepared(p.info["http"]) for p in slots))
            cpu0 = {k: cpu_seconds(p.proc.pid) for k, p in enumerate(slots)}
            gcpu0 = [g.cpu() for g in busy]
            profs = [Profile(slots[0].proc.pid, "the leader (consuming)", tmp / "profile-leader.txt"),
                     Profile(slots[1].proc.pid, "standby m1 (ingesting)", tmp / "profile-standby.txt")] \
                if args.profile and homes == [1, 2] else []
            t1 = time.perf_counter()
            res = await asyncio.gather(*(g.ask({"cmd": "reports", "k": args.reports,
                                                "on": [grpcs[h] for h in homes]}) for g in busy))
            t_acked = time.perf_counter()
            t_done = await until_applied(pg)
            if profs:
                out["profile"] = {p.label: p.stop() for p in profs}
            cpu1 = {k: cpu_seconds(p.proc.pid) for k, p in enumerate(slots)}
            prep1 = await asyncio.gather(*(prepared(p.info["http"]) for p in slots))
            reports = sum(r["reports"] for r in res)
            per_mgr = {}
            for k in range(3):
                mine = sum(int(r["by"].get(grpcs[k], 0)) for r in res)
                per_mgr[f"m{k}"] = {"role": "leader" if k == 0 else "standby", "reports_taken": mine,
                                    "cpu_s": round(cpu1[k] - cpu0[k], 3),
                                    "cpu_us_per_report_taken": round((cpu1[k] - cpu0[k]) / mine * 1e6, 1)
                                    if mine else None,
                                    # as the leader's: less what it spends idle in as long (its streams' upkeep)
                                    "cpu_us_per_report_taken_net_of_idle":
                                        round((cpu1[k] - cpu0[k] - idle_rate[k] * (t_done - t1)) / mine * 1e6, 1)
                                    if mine else None,
                                    # a standby's preparations ahead of a takeover that ended in the
                                    # window (their CPU is in cpu_s: not per report, not subtracted)
                                    **prepared_between(prep0[k], prep1[k])}
            row = {"ingesting": len(homes), "reports": reports, "acked_s": t_acked - t1,
                   "reports_per_s": reports / (t_acked - t1), "applied_s": t_done - t1,
                   "applied_per_s": reports / (t_done - t1),
                   "leader_cpu_us_per_report_consumed": round((cpu1[0] - cpu0[0]) / reports * 1e6, 1)
                   if 0 not in homes else None,
                   "leader_cpu_us_per_report_consumed_net_of_idle":
                       round((cpu1[0] - cpu0[0] - idle_rate[0] * (t_done - t1)) / reports * 1e6, 1)
                   if 0 not in homes else None,
                   "managers": per_mgr, "generator_cpu_s": [round(g.cpu() - c, 2) for g, c in zip(busy, gcpu0,
                                                                                             strict=True)]}
            out["ingest"].append(row)
            print(f"ingest with {len(homes)} manager(s): {reports} reports, {row['reports_per_s']:.0f}/s acked, "
                  f"{row['applied_per_s']:.0f}/s applied; leader CPU/report consumed "
                  f"{row['leader_cpu_us_per_report_consumed']} us "
                  f"({row['leader_cpu_us_per_report_consumed_net_of_idle']} us net of idle); {per_mgr}", flush=True)

        # ---- 3. failovers -----------------------------------------------------------------------
        async with httpx.AsyncClient(base_url=f"http://{slots[0].info['http']}", timeout=120,
                                     headers={"Authorization": f"Bearer {op}"}) as h:
            for _ in range(30):  # a 503 (the database slow to answer on a box this busy): say why, again
                r = await h.post("/v1/jobs", json={"name": "fleet", "tp": 8, "replicas": n, "local_batch": 8,
                                                   "min_tp": 4, "heads": 32, "mlp_columns": 128})
                if r.status_code != 503:
                    break
                print(f"job creation answered 503: {r.text[:300]}; again in 1 s", flush=True)
                await asyncio.sleep(1.0)
            r.raise_for_status()
        t_job = time.perf_counter()
        while await layout_epoch(slots[0].info["http"], op) is None:
            if time.perf_counter() - t_job > 300:
                raise TimeoutError("no first layout in 300 s (is the circuit breaker open?)")
            await asyncio.sleep(0.1)
        out["first_layout_s"] = time.perf_counter() - t_job
        wgens = await watchers_start(args, grpcs, wtok, nodes)
        wrounds: list[dict[str, Any] | None] = []
        leader = 0
        # ---- the steady state: every agent and watch connected, nothing changing. Measured after a
        # pause, so that what the last phase left (the standbys' followers rebuilding the planner's
        # snapshot once the log is quiet, the watches' first reads) is not counted as idle.
        await asyncio.sleep(args.settle_s)
        st_idle = [await g.ask({"cmd": "stats"}) for g in gens]
        w_idle = await watchers_stats(wgens) if wgens else {"on": []}
        on_agents = [a for s in st_idle for a in s["on"]]
        sprofs = [Profile(slots[k].proc.pid, f"{'the leader' if k == 0 else 'standby m' + str(k)} (steady state)",
                          tmp / f"profile-steady-{k}.txt") for k in (0, 1)] if args.profile else []
        c0, ti = [cpu_seconds(p.proc.pid) for p in slots], time.perf_counter()
        await asyncio.sleep(args.idle_s)
        share = [(cpu_seconds(p.proc.pid) - c) / (time.perf_counter() - ti) for p, c in zip(slots, c0, strict=True)]
        clients = [on_agents.count(p.grpc) + w_idle["on"].count(p.grpc) for p in slots]
        out["steady"] = {"cpu_share": [round(x, 3) for x in share], "clients": clients,
                         "us_per_s_per_client": [round(x * 1e6 / c, 1) if c else None
                                                 for x, c in zip(share, clients, strict=True)]}
        if sprofs:
            out["profile_steady"] = {p.label: p.stop() for p in sprofs}
        print(f"steady state (every agent and watch connected): managers' CPU {[f'{x:.1%}' for x in share]}, "
              f"clients {clients}, CPU per client {out['steady']['us_per_s_per_client']} us/s", flush=True)
        # ---- 4. a standby killed (before the leader rounds: each manager still holds a third of the
        # agents then; agents move only when their stream breaks, so after a few leader changes the
        # standbys may hold none) ----------------------------------------------------------------------
        st0 = [await g.ask({"cmd": "stats"}) for g in gens]
        before = [len(s["gaps_s"]) for s in st0]
        on = [a for s in st0 for a in s["on"]]
        standby = max((k for k in range(3) if k != leader), key=lambda k: on.count(slots[k].grpc))  # the busiest
        on_it = on.count(slots[standby].grpc)
        w0 = await watchers_stats(wgens) if wgens else {}
        # served elsewhere = every client connected, none of them to the killed standby (right after the
        # kill its clients still count as connected there: they have not seen it die yet)
        dead = slots[standby].grpc
        for g in gens:
            await g.ask({"cmd": "connected"})  # resets the lag probes
        for wg in wgens:
            await wg.ask({"cmd": "epochs"})
        # where the storm's CPU goes: the managers left, the generators, PostgreSQL, the whole machine
        groups = {"managers left": [s.proc.pid for k, s in enumerate(slots) if k != standby],
                  "agent generators": [g.proc.pid for g in gens], "watch generators": [wg.proc.pid for wg in wgens]}

        def cpu_now() -> dict[str, float]:
            return {k: sum(cpu_seconds(p) for p in pids) for k, pids in groups.items()}
        storm0, pg0, busy0 = cpu_now(), cpu_of_name("postgres"), machine_busy()
        slots[standby].signal(signal.SIGKILL)
        t_kill, t_kill_wall = time.perf_counter(), time.time()
        t_agents: float | None = None
        t_watches: float | None = None if wgens else 0.0
        glag, wlag = [0.0] * len(gens), [0.0] * len(wgens)
        wtotal = sum(wg.n for wg in wgens)
        while t_agents is None or t_watches is None:  # small answers, every generator at once
            conn = await asyncio.gather(*(g.ask({"cmd": "connected", "on": dead}) for g in gens))
            wconn = await asyncio.gather(*(wg.ask({"cmd": "epochs", "on": dead}) for wg in wgens))
            glag = [max(a, float(c["lag_max_s"])) for a, c in zip(glag, conn, strict=True)]
            wlag = [max(a, float(c["lag_max_s"])) for a, c in zip(wlag, wconn, strict=True)]
            since = time.perf_counter() - t_kill
            if t_agents is None and not any(c["on"] for c in conn) and all(
                    c["connected"] == len(g.nodes) for c, g in zip(conn, gens, strict=True)):
                t_agents = since
            if t_watches is None and not any(c["on"] for c in wconn) and sum(c["connected"] for c in wconn) >= wtotal:
                t_watches = since
            if since > 120:
                if t_agents is None:
                    st = [await g.ask({"cmd": "stats"}) for g in gens]
                    print(f"standby SIGKILL: after 120 s, agents connected {[c['connected'] for c in conn]} "
                          f"(of {[len(g.nodes) for g in gens]}), on the dead one {[c['on'] for c in conn]}; "
                          f"stream ends {[s['errors'] for s in st]}", flush=True)
                    raise TimeoutError("agents of the killed standby not served elsewhere in 120 s")
                break
            if int(since / 5) != int((since - 0.25) / 5):
                print(f"  standby SIGKILL +{since:.0f} s: agents connected {sum(c['connected'] for c in conn)}, "
                      f"on the dead one {sum(c['on'] for c in conn)}", flush=True)
            await asyncio.sleep(0.25)
        storm1, pg1, busy1 = cpu_now(), cpu_of_name("postgres"), machine_busy()
        storm_cpu = {k: round(storm1[k] - storm0[k], 2) for k in storm0}
        # PostgreSQL's server and backends (those of the killed manager ended: their share is lost)
        storm_cpu["postgres"] = round(sum(v - pg0.get(pid, 0.0) for pid, v in pg1.items()), 2)
        storm_busy = (busy1[0] - busy0[0]) / max(1e-9, busy1[1] - busy0[1])
        st = [await g.ask({"cmd": "stats"}) for g in gens]
        gaps = [x for s, b in zip(st, before, strict=True) for x in s["gaps_s"][b:]]
        waits = [x for s, b in zip(st, before, strict=True) for x in s["hello_waits_s"][b:]]
        # exact: the last moved agent's welcome, stamped by its generator (the poll above is 0.25 s coarse)
        welcomes = [x for s, b in zip(st, before, strict=True) for x in s["welcomed_at"][b:]]
        last_welcome = max(welcomes) - t_kill_wall if welcomes else None
        print(f"standby SIGKILL: stream ends so far {[s['errors'] for s in st]}", flush=True)
        out["standby_kill"] = {"hello_to_welcome_p50_s": statistics.median(waits) if waits else None,
                               "hello_to_welcome_max_s": max(waits) if waits else None,
                               "agents_on_it": on_it, "agents_moved": len(gaps),
                               "all_served_s": t_agents, "last_welcome_s": last_welcome,
                               "gap_max_s": max(gaps) if gaps else None,
                               "gap_p50_s": statistics.median(gaps) if gaps else None,
                               "generator_lag_max_s": glag, "watch_generator_lag_max_s": wlag,
                               "cpu_s_until_served": storm_cpu, "machine_busy_until_served": round(storm_busy, 3)}
        shown = None if last_welcome is None else round(last_welcome, 3)
        print(f"standby SIGKILL: {len(gaps)} agents moved, all served after {t_agents:.2f} s (polled; the last "
              f"welcome {shown} s after the kill), the longest without "
              f"a stream {out['standby_kill']['gap_max_s']}; generators' longest loop lag {glag} s, "
              f"watch generators' {wlag} s; hello -> welcome p50 "
              f"{out['standby_kill']['hello_to_welcome_p50_s']}, "
              f"max {out['standby_kill']['hello_to_welcome_max_s']} s; "
              f"CPU seconds from the kill until all were served {storm_cpu}, the machine {storm_busy:.0%} busy",
              flush=True)
        wkill = await watchers_standby_kill(wgens, w0, slots[standby].grpc, t_watches, t_kill_wall)
        if wgens:
            print(f"standby SIGKILL: watches {wkill}", flush=True)

        slots[standby].proc.wait(10)
        await restart(standby)

        async def lease_now() -> tuple[int, str, Any]:
            """The lease row: epoch, holder, since."""
            c = await asyncpg.connect(pg)
            try:
                row = await c.fetchrow("SELECT epoch, holder, since FROM leader WHERE id = 1")
            finally:
                await c.close()
            return int(row["epoch"]), str(row["holder"]), row["since"]

        async def balanced(rnd: int) -> None:
            """Wait (up to 60 s) until every manager holds at least 80 % of its share of the agents and
            watches, as the balance (every fleet_balance_s) makes it between failovers: back-to-back
            rounds would otherwise start with the survivors of the last one holding everything (and
            the failing agent, with every other, on the leader)."""
            t0 = time.perf_counter()
            while True:
                on = [a for g in gens for a in (await g.ask({"cmd": "stats"}))["on"]]
                won = (await watchers_stats(wgens))["on"] if wgens else []
                held = [(on.count(sl.grpc), won.count(sl.grpc)) for sl in slots]
                if all(a >= 0.8 * len(on) / 3 and w >= 0.8 * len(won) / 3 for a, w in held):
                    break
                if time.perf_counter() - t0 > 60:
                    print(f"round {rnd}: not balanced after 60 s: agents / watches held {held}", flush=True)
                    break
                await asyncio.sleep(0.5)
            print(f"round {rnd}: agents / watches held by each manager {held} "
                  f"({time.perf_counter() - t0:.1f} s waited for the balance)", flush=True)

        rounds = []
        for rnd in range(args.rounds):
            mode = "SIGKILL" if rnd % 2 == 0 else "SIGSTOP"
            await balanced(rnd)
            # the leader as the lease names it: a loaded leader may have lost its lease to another
            # manager since the last round (the bench must not stop one that no longer leads)
            lease_epoch, holder, _ = await lease_now()
            leader = next((k for k in range(3) if slots[k].name == holder), leader)
            old = slots[leader]
            epoch_before = await layout_epoch(old.info["http"], op) or 0
            others = [k for k in range(3) if k != leader]
            w0 = await watchers_stats(wgens) if wgens else {}
            tprofs = [Profile(slots[k].proc.pid, f"{slots[k].name} (round 0 takeover)",
                              tmp / f"profile-takeover-{k}.txt")
                      for k in others] if args.profile and rnd == 0 else []
            cpu_before = {k: cpu_seconds(slots[k].proc.pid) for k in others}
            busy_before = machine_busy()
            t_kill, t_kill_wall = time.perf_counter(), time.time()
            old.signal(signal.SIGKILL if mode == "SIGKILL" else signal.SIGSTOP)
            failed, via_killed = None, False
            # one agent on a manager left reports its node failed: the layout must change (when every
            # agent sits on the failed leader, one of those: its report waits for its stream to move)
            for strict in (True, False):
                for g in gens:
                    got = await g.ask({"cmd": "fail", "not": old.grpc, "strict": strict})
                    if got["node"] is not None:
                        failed, via_killed = got["node"], bool(got["on_it"])
                        break
                if failed is not None:
                    break
            if failed is None:
                raise RuntimeError(f"round {rnd}: no agent left to fail on a surviving manager")
            first = None
            new = None
            # both managers left read at once, each on a connection kept for the round; the longest
            # time between two reads says how coarse the figure is
            rest = {k: rest_client(slots[k].info["http"], op) for k in others}
            poll_gap, t_poll = 0.0, time.perf_counter()
            try:
                while first is None and time.perf_counter() - t_kill < 120:
                    epochs = await asyncio.gather(*(layout_epoch(slots[k].info["http"], op, rest[k])
                                                    for k in others))
                    now = time.perf_counter()
                    poll_gap, t_poll = max(poll_gap, now - t_poll), now
                    for k, e in zip(others, epochs, strict=True):
                        if e is not None and e > epoch_before:
                            first, new = now - t_kill, k
                            break
                    else:
                        await asyncio.sleep(0.01)
            finally:
                for c in rest.values():
                    await c.aclose()
            # what the machine gave the takeover: the new leader's CPU seconds over the window, and
            # how busy the whole machine was meanwhile (a starved takeover is slow for want of CPU)
            window_s = time.perf_counter() - t_kill
            busy_after = machine_busy()
            standby_cores = {slots[k].name: round((cpu_seconds(slots[k].proc.pid) - cpu_before[k]) / window_s, 2)
                             for k in others if slots[k].proc.poll() is None}
            machine = round((busy_after[0] - busy_before[0]) / max(1e-9, busy_after[1] - busy_before[1]), 3)
            if tprofs:  # the one that took over is the one with the busy samples
                out["profile_takeover"] = {p.label: p.stop() for p in tprofs}
            wround = await watchers_failover(wgens, w0, epoch_before, t_kill, old.grpc, t_kill_wall) if first else None
            wrounds.append(wround)
            if wround is not None:
                print(f"round {rnd}: watches: {wround['new_epoch_watchers']} of {wround['watchers']} at the new "
                      f"epoch after {wround['all_new_epoch_s']:.2f} s, reconnects of watches on live managers "
                      f"{wround['reconnects_of_live_managers']}, watch generators' longest loop lag "
                      f"{wround['generator_lag_max_s']} s", flush=True)
            exit_code = None
            if mode == "SIGSTOP":
                old.signal(signal.SIGCONT)
                exit_code = await asyncio.to_thread(old.proc.wait, 60)
            else:
                old.proc.wait(10)
            assert new is not None, f"round {rnd}: no layout at a new epoch within 120 s"
            epoch_after, _, since = await lease_now()
            takeovers = epoch_after - lease_epoch  # more than one: a new leader lost its lease to the next
            steps = takeover_timeline(tmp / "managers.log", epoch_after, t_kill_wall)
            # the layout as the new leader wrote it (its row's stamp, the leader's clock: this machine's),
            # before its fan-out to every watch delays the REST answer the bench polls
            c = await asyncpg.connect(pg)
            try:
                written = await c.fetchval("SELECT min(created_at) FROM layouts WHERE leader_epoch = $1", epoch_after)
            finally:
                await c.close()
            if written is not None:
                steps["layout written"] = round(written.timestamp() - t_kill_wall, 2)
            if wround is not None and wround["first_new_epoch_s"] is not None:
                steps["first watch"] = round(wround["first_new_epoch_s"], 2)
            rounds.append({"mode": mode, "first_layout_s": first, "rest_poll_gap_max_s": round(poll_gap, 3),
                           "exit": exit_code, "killed": old.name,
                           "since": since, "failed_agent_on_killed_leader": via_killed, "takeovers": takeovers,
                           "timeline_s": steps, "cores_used_by_standbys": standby_cores, "machine_busy": machine})
            print(f"round {rnd}: takeover at epoch {epoch_after}, seconds after the {mode}: "
                  + ", ".join(f"{k} {v}" for k, v in steps.items()) + f", first layout {first:.2f}; cores the "
                  f"managers left used meanwhile {standby_cores}, the machine {machine:.0%} busy", flush=True)
            print(f"round {rnd}: {mode} of the leader -> first layout at the new epoch {first:.2f} s"
                  + (" (the failing agent's stream was on the failed leader: it had to move first)"
                     if via_killed else "")
                  + (f", woken: exit {exit_code}" if exit_code is not None else "")
                  + (f"; {takeovers} takeovers (a new leader lost its lease)" if takeovers > 1 else ""), flush=True)
            # a supervisor's part: start the stopped leader again, and any other manager that exited
            # meanwhile (one that lost its lease while catching up exits for its supervisor)
            for k in [leader] + [k for k in others if slots[k].proc.poll() is not None]:
                gone = await restart(k)
                if k != leader:
                    print(f"round {rnd}: {gone.name} had exited (code {gone.proc.returncode}); started again",
                          flush=True)
            leader = new
        if wgens:
            out["watchers"] = {"count": args.watchers, "rounds": wrounds, "standby_kill": wkill}

        # ---- 5. counters ------------------------------------------------------------------------
        await asyncio.sleep(2.5)  # the last liveness rows
        await until_applied(pg)
        stats = [await g.ask({"cmd": "stats"}) for g in gens]
        acked = {k: v for s in stats for k, v in s["acked"].items()}
        c = await asyncpg.connect(pg)
        try:
            stored = {r["name"]: r["last_seq"] for r in await c.fetch("SELECT name, last_seq FROM nodes")}
            dup = await c.fetchval("SELECT count(*) FROM (SELECT node, seq, gpu_uuid FROM health_events "
                                   "WHERE seq IS NOT NULL GROUP BY node, seq, gpu_uuid HAVING count(*) > 1) d")
            quarantined = await c.fetchval("SELECT count(*) FROM outbox_quarantine")
        finally:
            await c.close()
        zombie = 0
        for rr in rounds:
            zombie += await write_log.writes_since(url, rr["killed"], rr["since"])
        # the failover figures count the rounds whose failing agent was on a manager left (the case
        # measured: its report goes through at once); the others are listed in "rounds"
        direct = [r for r in rounds if not r["failed_agent_on_killed_leader"]]
        kills = [r["first_layout_s"] for r in direct if r["mode"] == "SIGKILL"]
        after_lease = [r["first_layout_s"] - r["timeline_s"]["lease taken"] for r in rounds
                       if r["mode"] == "SIGKILL" and "lease taken" in r["timeline_s"]]
        written = [r["timeline_s"]["layout written"] - r["timeline_s"]["lease taken"] for r in rounds
                   if r["mode"] == "SIGKILL" and {"lease taken", "layout written"} <= set(r["timeline_s"])]
        watched = [r["timeline_s"]["first watch"] - r["timeline_s"]["lease taken"] for r in rounds
                   if r["mode"] == "SIGKILL" and {"lease taken", "first watch"} <= set(r["timeline_s"])]
        stops = [r["first_layout_s"] for r in direct if r["mode"] == "SIGSTOP"]
        out.update({
            "rounds": [{k: v for k, v in r.items() if k != "since"} for r in rounds],
            "sigkill_first_layout_p50_s": statistics.median(kills) if kills else None,
            "sigkill_first_layout_max_s": max(kills) if kills else None,
            "sigkill_first_layout_p99_s": pct(kills, 99) if kills else None,
            "sigstop_first_layout_max_s": max(stops) if stops else None,
            # every SIGKILL round, from the lease taken: the layout served over REST / as written
            "sigkill_after_lease_s": [round(x, 3) for x in after_lease],
            "sigkill_after_lease_p99_s": pct(after_lease, 99) if after_lease else None,
            "sigkill_written_after_lease_s": [round(x, 3) for x in written],
            "sigkill_written_after_lease_p99_s": pct(written, 99) if written else None,
            # ... and as the first layout watch got it (its generator's stamp as the layout arrived)
            "sigkill_first_watch_after_lease_s": [round(x, 3) for x in watched],
            "sigkill_first_watch_after_lease_p99_s": pct(watched, 99) if watched else None,
            "acked_reports_lost": sum(1 for k, v in acked.items() if v > stored.get(k, 0)),
            "reports_applied_twice": int(dup), "deposed_leader_writes": zombie, "quarantined": int(quarantined),
            "generator_cpu_s_total": [round(s["cpu_s"], 1) for s in stats],
        })
        return out
    finally:
        for g in gens:
            g.close()
        for wg in wgens:
            wg.close()
        for p in procs.values():
            p.stop(graceful=False)
        with contextlib.suppress(Exception):
            await drop_postgres(args.postgres, url)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=2000)
    ap.add_argument("--reports", type=int, default=3, help="state-changing reports per agent per ingest phase")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--procs", type=int, default=3, help="load-generator processes (a multiple of 3)")
    ap.add_argument("--watchers", type=int, default=0, help="layout watches spread over the managers (0: none)")
    ap.add_argument("--watcher-procs", type=int, default=3, help="processes of simulated layout watches")
    ap.add_argument("--balance-s", type=float, default=0.0, help="the managers' fleet_balance_s (0: their default, "
                    "30 s); each leader round first waits (up to 60 s) for the balance to spread the clients")
    ap.add_argument("--lease-ttl", type=float, default=2.0)
    ap.add_argument("--renew", type=float, default=0.4)
    ap.add_argument("--postgres", default=os.environ.get("NTP_TEST_POSTGRES_URL",
                                                         "postgresql+asyncpg://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--idle-s", type=float, default=3.0, help="the idle windows measured (before the ingest phases, "
                    "and in the steady state with every agent and watch connected)")
    ap.add_argument("--settle-s", type=float, default=5.0, help="the pause before the steady-state idle window")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy record the leader and a standby over the registration and over the ingest "
                         "phase with two ingesting managers (the leader only consumes) and print their busiest "
                         "functions "
                         "(pip install py-spy)")
    ap.add_argument("--spread-agents", action="store_true",
                    help="each generator's agents spread over the three managers (as the watches are), instead "
                         "of going to one manager first: a standby's agents are then simulated by every "
                         "generator process, not one, and reconnect all at once when it dies")
    ap.add_argument("--profile-native", action="store_true",
                    help="with --profile: py-spy samples native (C) frames too (slower sampling)")
    args = ap.parse_args()
    if args.profile_native:
        NATIVE.append("--native")
    s = asyncio.run(main_async(args))
    text = json.dumps(s, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
