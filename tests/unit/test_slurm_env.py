"""`ntp-run --slurm` before anything starts (worker/slurm_env.py): the step's environment, Slurm's
GPU numbers mapped to UUIDs through the agent's state file, the job spec to register, and the one
`error:` line for each thing it refuses. The run itself is in tests/integration/test_slurm.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ntp_manager.worker.slurm_env import (
    SlurmEnvError,
    expand_hostlist,
    job_name,
    load_spec,
    map_gpus,
    read_agent_state,
    read_step,
    wait_for_store,
)

ROOT = Path(__file__).resolve().parents[2]


def test_host_lists_expand_as_slurm_writes_them() -> None:
    assert expand_hostlist("sn1") == ["sn1"]
    assert expand_hostlist("sn[1-3,7],gpu-[3,08-10],x") == ["sn1", "sn2", "sn3", "sn7", "gpu-3", "gpu-08", "gpu-09",
                                                            "gpu-10", "x"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    for bad in ("sn[1-3", "sn1]", "sn[3-1]", "sn[a-b]", "a,,b"):
        with pytest.raises(SlurmEnvError):
            expand_hostlist(bad)


STEP = {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "train llama!", "SLURMD_NODENAME": "sn2", "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "sn[1-2]", "SLURM_STEP_GPUS": "1,0", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}


def test_the_step_is_read_and_refused_when_incomplete() -> None:
    s = read_step(STEP)
    assert (s.node, s.node_id, s.nodes, s.gpu_ids, s.launch_host) == ("sn2", 1, ("sn1", "sn2"), (1, 0), "10.0.0.1")
    assert job_name(s) == "train-llama-42"
    assert read_step({**STEP, "SLURM_STEP_GPUS": "", "CUDA_VISIBLE_DEVICES": "3"}).gpu_ids == (3,)
    for env, msg in [
        ({k: v for k, v in STEP.items() if k != "SLURM_JOB_ID"}, "SLURM_JOB_ID not set"),
        ({**STEP, "SLURM_STEP_GPUS": ""}, "the step has no GPUs"),
        ({**STEP, "SLURM_STEP_GPUS": "0,GPU-x"}, "expected GPU numbers"),
        ({**STEP, "SLURM_STEP_GPUS": "0,0"}, "listed twice"),
        ({**STEP, "SLURMD_NODENAME": "sn9"}, "is not in SLURM_JOB_NODELIST"),
    ]:
        with pytest.raises(SlurmEnvError, match=msg):
            read_step(env)


def state(node: str = "sn2", minors: tuple[int | None, ...] = (4, 0, 2)) -> dict[str, object]:
    return {"format": 1, "node": node, "gpus": [{"index": i, "minor": m, "uuid": f"GPU-{i}"}
                                                for i, m in enumerate(minors)]}


def test_slurm_gpu_numbers_map_by_minor_number_or_are_refused() -> None:
    # minors 4, 0, 2 -> Slurm's numbering (device-file order) is GPU-1 (minor 0), GPU-2 (2), GPU-0 (4)
    assert map_gpus(state(), "sn2", (0, 1, 2), "f") == ["GPU-1", "GPU-2", "GPU-0"]
    assert map_gpus(state(), "sn2", (2,), "f") == ["GPU-0"]
    for doc, ids, msg in [(state("sn1"), (0,), "state of node 'sn1'"), (state(), (3,), "has 3 GPUs"),
                          (state(minors=(0, None)), (0,), "minor number")]:
        with pytest.raises(SlurmEnvError, match=msg):
            map_gpus(doc, "sn2", ids, "f")


def test_the_job_spec_is_checked_before_anything_starts(tmp_path: Path) -> None:
    p = tmp_path / "job.yaml"
    p.write_text("tp: 2\nreplicas: 2\nlocal_batch: 4\nmin_tp: 1\nheads: 6\nmlp_columns: 96\n")
    assert load_spec(str(p), "j-1")["tp"] == 2
    # its fields are the manager's to check, at registration (tests/integration/test_slurm_register.py)
    for text, msg in [("name: x\ntp: 2\nreplicas: 1\nlocal_batch: 1\n", "leave 'name' out"),
                      ("domains: [d]\ntp: 2\n", "leave 'domains' out"), ("- 1\n", "mapping"),
                      ("1: 2\n", "mapping"), ("tp: [\n", "not YAML")]:
        p.write_text(text)
        with pytest.raises(SlurmEnvError, match=msg):
            load_spec(str(p), "j-1")


def test_ntp_run_slurm_refuses_with_one_line(tmp_path: Path) -> None:
    st = tmp_path / "agent-sn2.json"
    st.write_text(json.dumps(state()))

    def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ntp_manager.worker.run", "--slurm", *args,
                               "examples/train_tiny_gpt.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", **env})

    base = ["--agent-state", str(tmp_path / "agent-{node}.json"), "--store-port", "29999"]
    for env, args, msg in [
        ({}, base, "not set: start ntp-run with srun"),
        (STEP, ["--store-port", "29999", "--agent-state", str(tmp_path / "none.json"), "--slurm-wait", "0"],
         "no agent state file"),
        (STEP, [*base, "--slurm-wait", "-1"], "--slurm-wait: -1 is not within 0..3600"),
        (STEP, ["--agent-state", str(st)], "needs --store-port"),
        (STEP, [*base, "--gpus", "GPU-1"], "leave --gpus"),
        ({**STEP, "SLURM_NODEID": "0"}, [*base, "--job-spec", str(tmp_path / "j.yaml")], "needs --manager-http"),
    ]:
        r = run(env, *args)
        assert r.returncode == 2 and r.stderr.startswith("ntp-run: error: ") and msg in r.stderr, (args, r.stderr)
        assert r.stderr.count("\n") == 1  # one line, no traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_late_agent_state_file_is_waited_for_with_one_line_and_a_bound(tmp_path: Path) -> None:
    tpl = str(tmp_path / "agent-{node}.json")
    said: list[str] = []
    naps: list[float] = []

    def agent_comes_up(s: float) -> None:  # the agent writes its file while ntp-run waits
        naps.append(s)
        if len(naps) == 3:
            (tmp_path / "agent-sn2.json").write_text(json.dumps(state()))

    doc, path = read_agent_state(tpl, "sn2", 60.0, said.append, agent_comes_up)
    assert doc["node"] == "sn2" and path == str(tmp_path / "agent-sn2.json") and len(naps) == 3
    assert len(said) == 1 and said[0].startswith("waiting up to 60s for the agent's state file at ")
    said.clear()
    with pytest.raises(SlurmEnvError, match=r"no agent state file at .*agent-sn9.json after waiting 0.2s"):
        read_agent_state(tpl, "sn9", 0.2, said.append)
    assert len(said) == 1 and "agent-sn9.json" in said[0]
    (tmp_path / "agent-sn3.json").write_text("{")  # there but not the agent's: refused at once, not waited for
    with pytest.raises(SlurmEnvError, match="cannot read the agent's state"):
        read_agent_state(tpl, "sn3", 60.0, said.append, lambda s: pytest.fail("waited"))


def test_node_0s_store_is_waited_for_with_one_line_and_a_bound() -> None:
    port = _free_port()
    said: list[str] = []
    server: list[socket.socket] = []

    def node_0_comes_up(s: float) -> None:  # node 0's ntp-run starts listening while this node waits
        if not server:
            server.append(socket.create_server(("127.0.0.1", port)))

    try:
        wait_for_store("127.0.0.1", port, 60.0, said.append, node_0_comes_up)
    finally:
        for x in server:
            x.close()
    assert len(said) == 1 and said[0] == f"waiting up to 60s for node 0's store at 127.0.0.1:{port} (node 0's " \
                                         "ntp-run not up yet)"
    with pytest.raises(SlurmEnvError, match=rf"node 0's store at 127.0.0.1:{port} did not come up within 0.3s"):
        wait_for_store("127.0.0.1", port, 0.3, said.append)
    with pytest.raises(SlurmEnvError, match="does not resolve"):
        wait_for_store("no-such-host.invalid", port, 60.0, said.append)


def test_ntp_run_slurm_on_a_node_up_before_node_0_waits_then_stops_with_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "agent-sn2.json").write_text(json.dumps(state()))
    port = _free_port()  # nothing listens: node 0's ntp-run never comes up
    env = {"PATH": "/usr/bin:/bin", **STEP, "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "NTP_TOKEN": "t"}
    args = ["--slurm", "--manager", "127.0.0.1:1", "--agent-state", str(tmp_path / "agent-{node}.json"),
            "--store-port", str(port), "--slurm-wait", "1", "examples/train_tiny_gpt.py"]
    r = subprocess.run([sys.executable, "-m", "ntp_manager.worker.run", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 2 and f"waiting up to 1s for node 0's store at 127.0.0.1:{port}" in lines[0], r.stderr
    assert lines[1].startswith(f"ntp-run: error: node 0's store at 127.0.0.1:{port} did not come up within 1s"), \
        r.stderr
