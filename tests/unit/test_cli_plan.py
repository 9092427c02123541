"""`ntp-manager plan` and `cluster generate` as a user runs them: real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "examples" / "specs"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ntp_manager.cli", *args], capture_output=True, text=True, timeout=120
    )


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_plan_prints_table_and_summary():
    r = run("plan", "-c", str(SPECS / "cluster-small.yaml"), "-j", str(SPECS / "job-small.yaml"),
            "--fail-random", "2", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "replica" in r.stdout and "relative throughput" in r.stdout


def test_plan_json_is_documented_shape_and_deterministic():
    args = ("plan", "-c", str(SPECS / "cluster-small.yaml"), "-j", str(SPECS / "job-small.yaml"),
            "--fail-random", "3", "--seed", "5", "--json")
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    doc = json.loads(a.stdout)
    assert doc["schema"] == 1 and doc["scheme"] == "ntp-pw"
    assert {"replicas", "dropped", "idle", "spares_used", "power_caps_w", "reasons"} <= doc.keys()
    gpus = [u for r in doc["replicas"] for g in r["groups"] for u in g["gpus"]]
    assert len(gpus) == len(set(gpus))


def test_fail_by_uuid_changes_the_plan(tmp_path):
    gen = run("cluster", "generate", "--domains", "2", "--domain-size", "4", "--gpus-per-node", "2")
    assert gen.returncode == 0
    cluster = write(tmp_path, "c.yaml", gen.stdout)
    job = write(tmp_path, "j.yaml", "name: j\ntp: 4\nreplicas: 2\nlocal_batch: 4\nmin_tp: 2\nheads: 8\n")
    healthy = json.loads(run("plan", "-c", str(cluster), "-j", str(job), "--json").stdout)
    victim = healthy["replicas"][1]["groups"][0]["gpus"][0]
    failed = json.loads(run("plan", "-c", str(cluster), "-j", str(job), "--json", "--fail", victim).stdout)
    assert [r["tp"] for r in failed["replicas"]] == [4, 3]
    assert victim not in {u for r in failed["replicas"] for g in r["groups"] for u in g["gpus"]}


JOB_OK = "name: j\ntp: 4\nreplicas: 2\nlocal_batch: 4\nmin_tp: 2\nheads: 8\n"
CLUSTER_OK = "generate: {domains: 2, domain_size: 4, gpus_per_node: 2}\n"


@pytest.mark.parametrize(
    ("cluster", "job", "extra", "message"),
    [
        (CLUSTER_OK, JOB_OK.replace("tp: 4", "tp: 8").replace("heads: 8", "heads: 16"), (),
         "tp 8 is above the largest domain size 4"),
        (CLUSTER_OK, JOB_OK.replace("min_tp: 2", "min_tp: 5"), (), "min_tp 5 is above"),
        (CLUSTER_OK, JOB_OK.replace("replicas: 2", "replicas: 0"), (),
         "replicas: Input should be greater than or equal to 1"),
        (CLUSTER_OK, JOB_OK.replace("tp: 4", "tp: true"), (), "tp: Input should be a valid integer"),
        (CLUSTER_OK, JOB_OK, ("--fail", "GPU-does-not-exist"), "unknown GPU 'GPU-does-not-exist'"),
        ("generate: {domains: 2, domain_size: [4\n", JOB_OK, (), "malformed YAML"),
        (CLUSTER_OK, "name: j\ntp: four\nreplicas: 2\nlocal_batch: 4\nheads: 8\n", (), "tp"),
        (CLUSTER_OK, JOB_OK + "bogus: 1\n", (), "bogus"),
        ("generate: {domains: 2, domain_size: 6, gpus_per_node: 4}\n", JOB_OK, (), "not a multiple"),
        (CLUSTER_OK, JOB_OK, ("--fail-random", "100"), "exceeds the 8 placeable GPUs"),
    ],
)
def test_bad_input_gives_one_clear_line_and_exit_2(tmp_path, cluster, job, extra, message):
    c = write(tmp_path, "c.yaml", cluster)
    j = write(tmp_path, "j.yaml", job)
    r = run("plan", "-c", str(c), "-j", str(j), *extra)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert message in r.stderr
    assert r.stderr.strip().startswith("error:")


def test_missing_file_is_a_clear_error(tmp_path):
    r = run("plan", "-c", str(tmp_path / "none.yaml"), "-j", str(SPECS / "job-small.yaml"))
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_generate_writes_a_loadable_spec(tmp_path):
    out = tmp_path / "big.yaml"
    r = run("cluster", "generate", "--domains", "64", "--domain-size", "32", "--gpus-per-node", "4",
            "-o", str(out))
    assert r.returncode == 0, r.stderr
    from ntp_manager.specfile import load_cluster

    c = load_cluster(out)
    assert c.gpu_count == 64 * 32 and len(c.domains) == 64 and len(list(c.nodes())) == 64 * 8
