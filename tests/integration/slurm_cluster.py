"""A real Slurm on loopback for the tests: munged, slurmctld and one slurmd per node name, all on
this host (Debian's Slurm runs several slurmd on one host: each node has its own NodeName and
Port), with a generated slurm.conf and gres.conf in a directory of its own (SLURM_CONF), its own
ports and its own munge socket. GRES gpu entries name device files (links to /dev/null, numbered as
/dev/nvidia<minor> would be), so a step gets SLURM_STEP_GPUS as on a GPU node; the fake GPU
backend numbers its GPUs' minors the same way.

The prolog and epilog are deploy/slurm's, copied into the cluster's directory with their
ntp-slurm.env beside them, as a site would install them.

`SlurmCluster.start()` skips the test (pytest.skip, with the reason) when Slurm or munge is not
installed or when not root (slurmd must run as root here); `stop()` cancels the cluster's jobs and
ends every process it started. Tests talk to it only through Slurm's own commands.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "sbatch", "srun", "scancel")
INSTALL = "apt-get install slurmctld slurmd slurm-client munge (`make test` does it when run as root)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    def __init__(self, root: Path, nodes: tuple[str, ...] = ("sn1", "sn2"), gpus_per_node: int = 2,
                 script_env: dict[str, str] | None = None) -> None:
        self.root, self.nodes, self.gpus = root, nodes, gpus_per_node
        self.conf = root / "slurm.conf"
        self.script_env = script_env or {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.log = root / "log"
        self.scripts = root / "ntp"  # deploy/slurm's prolog and epilog, as installed
        self.munge_dir: Path | None = None

    # ---- commands ----------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def cmd(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        """A Slurm command on this cluster; its output (AssertionError with the output when it fails)."""
        r = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()} {r.stdout.strip()}")
        return r.stdout

    def nodes_state(self) -> dict[str, tuple[str, str]]:
        """node -> (state, reason) as sinfo shows them."""
        out = {}
        for line in self.cmd("sinfo", "-h", "-N", "-o", "%N|%T|%E").splitlines():
            n, st, reason = line.split("|", 2)
            out.setdefault(n, (st, "" if reason == "none" else reason))
        return out

    def resume_all(self) -> None:
        """Every drained node back to service (between tests)."""
        for n, (st, _) in self.nodes_state().items():
            if "drain" in st:
                self.cmd("scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)

    def job_state(self, job_id: str) -> str:
        text = self.cmd("scontrol", "show", "job", job_id, check=False)
        for field in text.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return ""

    # ---- life cycle --------------------------------------------------------------------------
    def start(self) -> SlurmCluster:
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            pytest.skip(f"Slurm is not installed here ({', '.join(missing)} missing): {INSTALL}")
        if os.geteuid() != 0:
            pytest.skip("the test Slurm runs slurmd as root (it starts job steps as their user): not root here")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        for d in ("state", "log", "run", "dev", *(f"spool/{n}" for n in self.nodes)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        # munged insists that every directory above its socket be searchable by all (pytest's
        # temporary directories are not): the socket lives in a directory of its own under /tmp
        self.munge_dir = Path(tempfile.mkdtemp(prefix="ntp-munge-"))
        self.munge_dir.chmod(0o755)
        key = self.root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        sock = self.munge_dir / "munge.sock"
        self._spawn("munged", ["munged", "-F", f"--socket={sock}", f"--key-file={key}",
                               f"--pid-file={self.munge_dir / 'munged.pid'}",
                               f"--log-file={self.log / 'munged.log'}", f"--seed-file={self.munge_dir / 'seed'}"])
        self._until(sock.exists, 10, "munged's socket")
        self._install_scripts()
        ctld_port = free_port()
        node_ports = {n: free_port() for n in self.nodes}
        gres, devs = [], 0
        for n in self.nodes:
            first = devs
            for _ in range(self.gpus):
                (self.root / "dev" / f"nvidia{devs}").symlink_to("/dev/null")
                devs += 1
            gres.append(f"NodeName={n} Name=gpu File={self.root}/dev/nvidia[{first}-{devs - 1}]")
        (self.root / "gres.conf").write_text("\n".join(gres) + "\n")
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports[n]} CPUs=2 RealMemory=1000 "
            f"Gres=gpu:{self.gpus} State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(f"""# generated by tests/integration/slurm_cluster.py
ClusterName=ntptest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/run/slurmctld.pid
SlurmdPidFile={self.root}/run/slurmd-%n.pid
SlurmctldLogFile={self.log}/slurmctld.log
SlurmdLogFile={self.log}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MpiDefault=none
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=600
Prolog={self.scripts}/prolog.sh
Epilog={self.scripts}/epilog.sh
{node_lines}
PartitionName=ntp Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._until(lambda: "UP" in self.cmd("scontrol", "ping", check=False), 20, "slurmctld")
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        self._until(lambda: all(st == "idle" for st, _ in self.nodes_state().values())
                    and set(self.nodes_state()) == set(self.nodes), 30, "every slurmd to register (idle)")

    def _install_scripts(self) -> None:
        self.scripts.mkdir(parents=True, exist_ok=True)
        for name in ("prolog.sh", "epilog.sh", "healthcheck.sh"):
            shutil.copy2(ROOT / "deploy" / "slurm" / name, self.scripts / name)
        env = {"SLURM_CONF": str(self.conf), **self.script_env}
        (self.scripts / "ntp-slurm.env").write_text("".join(f"{k}='{v}'\n" for k, v in env.items()))

    def _spawn(self, name: str, args: list[str]) -> None:
        out = open(self.log / f"{name}.out", "wb")  # noqa: SIM115  # closed with the process
        self.procs[name] = subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        out.close()

    def _until(self, pred: object, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}: {self._tail(name)}")
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                if pred():  # type: ignore[operator]
                    return
            time.sleep(0.2)
        raise TimeoutError(f"waited {timeout:g}s for {what}; slurmctld log: {self._tail('slurmctld')}")

    def _tail(self, name: str) -> str:
        p = self.log / f"{name}.out"
        return p.read_text(errors="replace")[-1500:] if p.exists() else "(no log)"

    def stop(self) -> None:
        """Cancel this cluster's jobs, then end every process started here (slurmd first)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                jobs = self.cmd("squeue", "-h", "-o", "%i", check=False, timeout=10).split()
                if jobs:
                    self.cmd("scancel", *jobs, check=False, timeout=10)
                    end = time.monotonic() + 15
                    while time.monotonic() < end and self.cmd("squeue", "-h", check=False, timeout=10).strip():
                        time.sleep(0.3)
        for name in sorted(self.procs, key=lambda n: (n == "munged", n == "slurmctld")):
            p = self.procs[name]
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)  # a test may have stopped it
                    p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        self.procs.clear()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
