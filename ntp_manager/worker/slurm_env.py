"""`ntp-run --slurm`: what a Slurm job step tells ntp-run, and the job it registers with the manager.

deploy/slurm/train.sbatch starts one ntp-run per node (`srun --ntasks-per-node=1`); each learns
from the step's environment and its node's agent:

- the GPUs: SLURM_STEP_GPUS (else SLURM_JOB_GPUS, else CUDA_VISIBLE_DEVICES) lists the node's GPUs
  the step got, numbered as Slurm numbers them: 0..n-1 in gres.conf device-file order, which is the
  order of the devices' minor numbers (/dev/nvidia<minor>) when gres.conf lists all of the node's
  GPUs (AutoDetect=nvml does). The node's agent writes its GPUs with their minor numbers to its
  state file (agent/ntp_agent/state.py; `--agent-state`, `{node}` = SLURMD_NODENAME), so Slurm's number i is
  the agent's GPU with the i-th lowest minor number, whose UUID is the rank's worker id. A state
  file of another node, a GPU without a minor number, or a number past the node's GPUs is refused
  before anything starts: a wrong mapping would have the manager reshard around the wrong GPU.
- the store: the ntp-run of the step's node 0 (SLURM_NODEID 0) hosts the rendezvous store on
  `--store-port`; the others join it at SLURM_LAUNCH_NODE_IPADDR (the node srun ran on: the batch
  script's node, which is node 0 of an allocation-wide step).
- the job: `--job`/NTP_JOB, else the Slurm job's name and id (`<SLURM_JOB_NAME>-<SLURM_JOB_ID>`,
  made a valid job name). With `--job-spec FILE` (a job spec YAML without `name` and `domains`) the
  ntp-run of node 0 registers the job when the manager has none by that name: over the NVLink
  domains of the allocation's nodes (SLURM_JOB_NODELIST), asked of the manager's REST API. A node
  the manager does not know, or a domain with nodes outside the allocation (the planner would place
  ranks on GPUs the job does not have), is refused with an error naming it. The other nodes' ntp-run
  wait for the registration in the store; when the run ends, node 0 deletes the job it registered
  (after the other nodes are done, or a minute).

A node may come up before its agent has written the state file, or before node 0's ntp-run hosts
the store: ntp-run says in one line what it waits for and waits up to `--slurm-wait` seconds
(NTP_SLURM_WAIT_S, default 120), then stops with one line saying what never came.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ntp_manager.contract import limits

DEFAULT_AGENT_STATE = "/run/ntp-agent/state.json"
WAIT_REGISTERED_S = 300.0  # other nodes wait this long for node 0's registration
WAIT_PEERS_DONE_S = 60.0  # node 0 waits this long for the other nodes before deleting its job
WAIT_UP_S = 120.0  # default --slurm-wait: for this node's agent state file and node 0's store
WAIT_UP_MAX_S = 3600.0
POLL_S = 0.5


class SlurmEnvError(ValueError):
    """The Slurm environment, the agent's state or the manager refuses the run (one line)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """ntp-run's Slurm options."""
    p.add_argument("--slurm", action="store_true",
                   help="learn GPUs, store and job from the Slurm job step (deploy/slurm/train.sbatch)")
    p.add_argument("--agent-state", default=os.environ.get("NTP_AGENT_STATE_FILE", DEFAULT_AGENT_STATE),
                   help="--slurm: the node agent's state file ({node}: SLURMD_NODENAME)")
    p.add_argument("--job-spec", default=os.environ.get("NTP_JOB_SPEC", ""),
                   help="--slurm: a job spec YAML to register when the manager has no such job")
    p.add_argument("--manager-http", default=os.environ.get("NTP_MANAGER_HTTP", ""),
                   help="--slurm: the manager's REST URL, to register the job")
    p.add_argument("--register-token-file", default=os.environ.get("NTP_REGISTER_TOKEN_FILE", ""),
                   help="--slurm: an operator-scope token to register the job with")
    p.add_argument("--slurm-wait", type=_wait_seconds, default=os.environ.get("NTP_SLURM_WAIT_S", f"{WAIT_UP_S:g}"),
                   help="--slurm: seconds to wait for this node's agent state file and for node 0's store "
                        f"(NTP_SLURM_WAIT_S; default {WAIT_UP_S:g})")


def _wait_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= v <= WAIT_UP_MAX_S:
        raise argparse.ArgumentTypeError(f"{text} is not within 0..{WAIT_UP_MAX_S:g} seconds")
    return v


def _stderr(msg: str) -> None:
    print(f"ntp-run: {msg}", file=sys.stderr, flush=True)


Say = Callable[[str], None]


# ---- the step's environment (pure) ----------------------------------------------------------------
def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (`sn[1-3,7],gpu-[01-02]b`) as names, in order. Raises
    SlurmEnvError for a malformed one."""
    entries, depth, cur = [], 0, ""
    for ch in text.strip():
        if ch == "," and depth == 0:
            entries.append(cur)
            cur = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise SlurmEnvError(f"SLURM_JOB_NODELIST={text!r}: unbalanced brackets")
        cur += ch
    if depth:
        raise SlurmEnvError(f"SLURM_JOB_NODELIST={text!r}: unbalanced brackets")
    entries.append(cur)
    out: list[str] = []
    for e in entries:
        if not e:
            raise SlurmEnvError(f"SLURM_JOB_NODELIST={text!r}: an empty entry")
        names = [""]
        for part in re.split(r"(\[[^\]]*\])", e):
            if part.startswith("["):
                alts: list[str] = []
                for rng in part[1:-1].split(","):
                    m = re.fullmatch(r"(\d+)(?:-(\d+))?", rng)
                    if m is None:
                        raise SlurmEnvError(f"SLURM_JOB_NODELIST={text!r}: bad range {rng!r}")
                    lo, hi = m.group(1), m.group(2) or m.group(1)
                    if int(hi) < int(lo) or int(hi) - int(lo) > limits.JOB_GPUS_MAX:
                        raise SlurmEnvError(f"SLURM_JOB_NODELIST={text!r}: bad range {rng!r}")
                    alts += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
                names = [n + a for n in names for a in alts]
            else:
                names = [n + part for n in names]
        out += names
    return out


def _ids(name: str, value: str) -> list[int]:
    ids = [x.strip() for x in value.split(",") if x.strip()]
    if not ids or not all(x.isdigit() for x in ids):
        raise SlurmEnvError(f"{name}={value!r}: expected GPU numbers such as 0,1,2,3")
    if len(set(ids)) != len(ids):
        raise SlurmEnvError(f"{name}={value!r}: a GPU is listed twice")
    return [int(x) for x in ids]


@dataclass(frozen=True)
class SlurmStep:
    job_id: str
    job_name: str
    node: str  # SLURMD_NODENAME
    node_id: int  # SLURM_NODEID: this node's place in the step
    nodes: tuple[str, ...]  # the allocation's nodes
    gpu_ids: tuple[int, ...]  # the step's GPUs on this node, as Slurm numbers them
    launch_host: str  # SLURM_LAUNCH_NODE_IPADDR


def read_step(env: Mapping[str, str]) -> SlurmStep:
    """The step this ntp-run runs in. Raises SlurmEnvError naming what is missing or wrong (not
    started by srun inside an allocation; no GPUs requested)."""
    need = ("SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_LAUNCH_NODE_IPADDR")
    missing = [k for k in need if not env.get(k)]
    if missing:
        raise SlurmEnvError(f"--slurm: {', '.join(missing)} not set: start ntp-run with srun inside a Slurm job "
                            "(deploy/slurm/train.sbatch)")
    if not env["SLURM_NODEID"].isdigit():
        raise SlurmEnvError(f"SLURM_NODEID={env['SLURM_NODEID']!r} is not a number")
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        if env.get(name):
            gpu_ids = _ids(name, env[name])
            break
    else:
        raise SlurmEnvError("--slurm: the step has no GPUs (SLURM_STEP_GPUS, SLURM_JOB_GPUS and CUDA_VISIBLE_DEVICES "
                            "are unset): request them, e.g. sbatch --gres=gpu:8")
    nodes = tuple(expand_hostlist(env["SLURM_JOB_NODELIST"]))
    if env["SLURMD_NODENAME"] not in nodes:
        raise SlurmEnvError(f"SLURMD_NODENAME={env['SLURMD_NODENAME']!r} is not in SLURM_JOB_NODELIST "
                            f"({env['SLURM_JOB_NODELIST']})")
    return SlurmStep(env["SLURM_JOB_ID"], env.get("SLURM_JOB_NAME", "") or "slurm", env["SLURMD_NODENAME"],
                     int(env["SLURM_NODEID"]), nodes, tuple(gpu_ids), env["SLURM_LAUNCH_NODE_IPADDR"])


def job_name(step: SlurmStep) -> str:
    """`<SLURM_JOB_NAME>-<SLURM_JOB_ID>` as a valid job name (other characters become `-`)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "-", step.job_name).strip("-._") or "slurm"
    return f"{base[: limits.JOB_NAME_MAX - len(step.job_id) - 1]}-{step.job_id}"


def map_gpus(doc: Mapping[str, Any], node: str, gpu_ids: tuple[int, ...], where: str) -> list[str]:
    """The UUIDs of Slurm's GPU numbers `gpu_ids` on `node`, from the agent's state `doc` (see the
    module docstring). Raises SlurmEnvError when the file is another node's, a GPU has no minor
    number, or a number is past the node's GPUs."""
    if doc.get("node") != node:
        raise SlurmEnvError(f"{where} is the agent state of node {doc.get('node')!r}, but Slurm runs this step on "
                            f"{node!r}: run the agent with --node set to the Slurm NodeName")
    gpus = doc.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        raise SlurmEnvError(f"{where}: the agent lists no GPUs")
    if any(not isinstance(g, dict) or not isinstance(g.get("minor"), int) or not str(g.get("uuid", "")) for g in gpus):
        raise SlurmEnvError(f"{where}: the agent does not know every GPU's device minor number, so Slurm's GPU "
                            "numbers cannot be mapped to UUIDs")
    ordered = sorted(gpus, key=lambda g: int(g["minor"]))
    out = []
    for i in gpu_ids:
        if i >= len(ordered):
            raise SlurmEnvError(f"Slurm gave this step GPU {i}, but the agent on {node} has {len(ordered)} GPUs "
                                "(does gres.conf match the node?)")
        out.append(str(ordered[i]["uuid"]))
    return out


def read_agent_state(template: str, node: str, wait_s: float = 0.0, say: Say = _stderr,
                     sleep: Callable[[float], None] = time.sleep) -> tuple[dict[str, Any], str]:
    """The agent's state document and its path (`{node}` replaced). While the file does not exist
    (the agent not up yet) it says so once and waits up to `wait_s` seconds. SlurmEnvError when it
    never comes or cannot be read (the agent writes it atomically: a file that is there is whole)."""
    path = template.replace("{node}", node)
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            raw = Path(path).read_bytes()[: 1 << 20]
            break
        except FileNotFoundError:
            left = deadline - time.monotonic()
            if left <= 0:
                waited = f" after waiting {wait_s:g}s" if wait_s > 0 else ""
                raise SlurmEnvError(f"no agent state file at {path}{waited}: run ntp-agent with --state-file on "
                                    "every node (or give --agent-state; --slurm-wait to wait longer)") from None
            if not said:
                say(f"waiting up to {wait_s:g}s for the agent's state file at {path} (ntp-agent on {node} not up yet)")
                said = True
            sleep(min(POLL_S, left))
        except OSError as e:
            raise SlurmEnvError(f"{path}: cannot read the agent's state ({e})") from None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise SlurmEnvError(f"{path}: cannot read the agent's state ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise SlurmEnvError(f"{path}: not an ntp-agent state file")
    return doc, path


def wait_for_store(host: str, port: int, wait_s: float, say: Say = _stderr,
                   sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait up to `wait_s` seconds until node 0's store accepts connections at host:port, saying
    once what it waits for; SlurmEnvError when it does not come up (or the host does not resolve).
    The store client itself would retry silently and then fail with c10d's stack on stderr."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except socket.gaierror as e:
            raise SlurmEnvError(f"node 0's store host {host!r} (SLURM_LAUNCH_NODE_IPADDR) does not resolve: "
                                f"{e.strerror or e}") from None
        except OSError as e:  # refused (not listening yet), timed out, unreachable
            left = deadline - time.monotonic()
            if left <= 0:
                raise SlurmEnvError(f"node 0's store at {host}:{port} did not come up within {wait_s:g}s "
                                    f"({e.strerror or e}): is node 0's ntp-run running, with the same "
                                    "--store-port? (--slurm-wait to wait longer)") from None
            if not said:
                say(f"waiting up to {wait_s:g}s for node 0's store at {host}:{port} (node 0's ntp-run not up yet)")
                said = True
            sleep(min(POLL_S, left))


# ---- registering the job with the manager --------------------------------------------------------------
@dataclass
class SlurmRun:
    """What `--slurm` set up for one ntp-run: the step, and (node 0) the job to register."""

    step: SlurmStep
    job: str
    spec: dict[str, Any] | None = None  # a job spec to register (node 0, with --job-spec)
    http: str = ""
    token: str = ""
    registered: bool = False
    store_port: int = 0
    wait_s: float = WAIT_UP_S

    def wait_for_store(self, say: Say = _stderr) -> None:
        """Nodes other than node 0: wait (bounded) until node 0 hosts the store."""
        if not self.hosts_store:
            wait_for_store(self.step.launch_host, self.store_port, self.wait_s, say)

    @property
    def hosts_store(self) -> bool:
        return self.step.node_id == 0

    def _key(self, what: str) -> str:
        return f"ntp/{self.job}/slurm/{what}"

    def _client(self) -> Any:
        import httpx

        return httpx.Client(base_url=self.http, timeout=30, headers={"Authorization": f"Bearer {self.token}"})

    def before_ranks(self, store: Any, say: Any) -> None:
        """Node 0: register the job if asked and absent, then tell the others; the others: wait for
        that. Raises SlurmEnvError (node 0: the manager refused; others: node 0 never said)."""
        import datetime as dt

        if not self.hosts_store:
            if not store.check([self._key("ready")]):
                say(f"waiting up to {WAIT_REGISTERED_S:g}s for node 0's ntp-run to get job {self.job} ready")
            try:
                store.wait([self._key("ready")], dt.timedelta(seconds=WAIT_REGISTERED_S))
            except Exception:
                raise SlurmEnvError(f"node 0's ntp-run did not get job {self.job} ready within {WAIT_REGISTERED_S:g}s "
                                    "(see its output)") from None
            error = store.get(self._key("ready")).decode()
            if error:
                raise SlurmEnvError(f"node 0's ntp-run could not register job {self.job}: {error}")
            return
        try:
            if self.spec is not None:
                self.registered = self.register(say)
            store.set(self._key("ready"), "")
        except SlurmEnvError as e:
            store.set(self._key("ready"), str(e))
            raise

    def register(self, say: Any) -> bool:
        """Create the job over the allocation's domains unless the manager has it; True when made."""
        import httpx

        assert self.spec is not None
        try:
            with self._client() as c:
                r = c.get(f"/v1/jobs/{self.job}")
                if r.status_code == 200:
                    say(f"job {self.job}: the manager has it already")
                    return False
                if r.status_code != 404:
                    raise SlurmEnvError(f"the manager answered {r.status_code} for job {self.job}: {_detail(r)}")
                domains: list[str] = []
                for n in self.step.nodes:
                    r = c.get(f"/v1/nodes/{n}")
                    if r.status_code == 404:
                        raise SlurmEnvError(f"the manager does not know node {n!r} (SLURM_JOB_NODELIST): is its agent "
                                            "running, with --node set to the Slurm NodeName?")
                    if r.status_code != 200:
                        raise SlurmEnvError(f"the manager answered {r.status_code} for node {n!r}: {_detail(r)}")
                    d = r.json()["domain"]
                    if d not in domains:
                        domains.append(d)
                for d in domains:
                    r = c.get("/v1/nodes", params={"domain": d, "limit": 1000})
                    if r.status_code != 200:
                        raise SlurmEnvError(f"the manager answered {r.status_code} for domain {d!r}: {_detail(r)}")
                    outside = sorted(x["name"] for x in r.json()["items"] if x["name"] not in self.step.nodes)
                    if outside:
                        raise SlurmEnvError(f"NVLink domain {d!r} also holds {', '.join(outside[:8])}, outside this "
                                            "allocation: allocate whole domains (the planner would place ranks on "
                                            "GPUs this job does not have)")
                body = {**self.spec, "name": self.job, "domains": domains}
                r = c.post("/v1/jobs", json=body)
                if r.status_code != 201:
                    raise SlurmEnvError(f"the manager refused job {self.job} ({r.status_code}): {_detail(r)}")
        except httpx.HTTPError as e:
            raise SlurmEnvError(f"cannot reach the manager at {self.http}: {e}") from None
        say(f"job {self.job}: registered over {', '.join(domains)}")
        return True

    def after_ranks(self, store: Any, say: Any) -> None:
        """When this ntp-run's ranks are done: tell node 0; node 0 deletes the job it registered
        once the others are done (or after WAIT_PEERS_DONE_S)."""
        store.set(self._key(f"done/{self.step.node_id}"), "1")
        if not (self.hosts_store and self.registered):
            return
        deadline = time.monotonic() + WAIT_PEERS_DONE_S
        for i in range(len(self.step.nodes)):
            while not store.check([self._key(f"done/{i}")]) and time.monotonic() < deadline:
                time.sleep(0.2)
        try:
            with self._client() as c:
                r = c.delete(f"/v1/jobs/{self.job}")
            say(f"job {self.job}: deleted" if r.status_code == 200 else
                f"job {self.job}: the manager answered {r.status_code} to its deletion: {_detail(r)}")
        except Exception as e:  # the run's result stands; the job can be deleted by hand
            say(f"job {self.job}: could not delete it ({e})")


def _detail(r: Any) -> str:
    try:
        body = r.json()
        return str(body.get("detail", body))[:300]
    except ValueError:
        return str(r.text)[:300]


def prepare(a: argparse.Namespace, env: Mapping[str, str], say: Say = _stderr) -> SlurmRun:
    """Fill in ntp-run's arguments from the step (`a` is changed: gpus, job, store) and say what the
    run registers; waits (bounded, `a.slurm_wait`) for the agent's state file. Raises SlurmEnvError
    for anything missing or wrong, before anything starts."""
    step = read_step(env)
    if a.gpus:
        raise SlurmEnvError("--slurm takes the GPUs from Slurm: leave --gpus (NTP_GPUS) out")
    if a.store:
        raise SlurmEnvError("--slurm finds the store itself (node 0 hosts it): leave --store out")
    if not a.store_port:
        raise SlurmEnvError("--slurm needs --store-port (the same on every node; train.sbatch derives it from "
                            "the job id)")
    doc, path = read_agent_state(a.agent_state, step.node, a.slurm_wait, say)
    a.gpus = ",".join(map_gpus(doc, step.node, step.gpu_ids, path))
    a.job = a.job or job_name(step)
    if step.node_id == 0:
        a.store_host = step.launch_host
    else:
        a.store = f"{step.launch_host}:{a.store_port}"
    run = SlurmRun(step, a.job, store_port=int(a.store_port), wait_s=a.slurm_wait)
    if a.job_spec and step.node_id == 0:
        if not a.manager_http:
            raise SlurmEnvError("--job-spec needs --manager-http (NTP_MANAGER_HTTP) to register the job")
        if not a.register_token_file:
            raise SlurmEnvError("--job-spec needs --register-token-file (NTP_REGISTER_TOKEN_FILE): an operator-scope "
                                "token")
        try:
            run.token = Path(a.register_token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise SlurmEnvError(f"--register-token-file {a.register_token_file}: cannot read ({e})") from None
        run.spec = load_spec(a.job_spec, a.job)
        run.http = a.manager_http.rstrip("/")
    return run


def load_spec(path: str, name: str) -> dict[str, Any]:
    """A job spec file for registration: YAML, a mapping of job fields without `name` and `domains`
    (ntp-run sets them from the Slurm job). Its fields are checked by the manager, with the same
    model as `POST /v1/jobs`, when node 0 registers the job -- before any rank starts; a refusal is
    one line naming the field (`SlurmRun.register`). The worker keeps no copy of the manager's job
    model (issue 35: the worker imports only the contract and itself). `name` is the job's name,
    which the manager's check receives."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SlurmEnvError(f"--job-spec {path}: cannot read ({e})") from None
    except yaml.YAMLError as e:
        raise SlurmEnvError(f"--job-spec {path}: not YAML ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(doc, dict) or not all(isinstance(k, str) for k in doc):
        raise SlurmEnvError(f"--job-spec {path}: expected a mapping of job fields")
    for k in ("name", "domains"):
        if k in doc:
            raise SlurmEnvError(f"--job-spec {path}: leave {k!r} out (ntp-run sets it from the Slurm job {name!r})")
    return dict(doc)
