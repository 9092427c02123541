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
        ("defaults: {base_cap: 1.5}\n" + CLUSTER_OK, JOB_OK, (), "defaults.base_cap"),
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


def test_cluster_base_cap_boosts_the_reduced_group_to_the_maximum(tmp_path):
    # H100-like fleet (default = max = 700 W) under a 0.85 base cap: healthy GPUs at 595 W (not listed),
    # the TP3 group's survivors raised to their 700 W maximum.
    c = write(tmp_path, "c.yaml", "defaults: {tdp_w: 700, min_w: 200, max_w: 700, base_cap: 0.85}\n" + CLUSTER_OK)
    j = write(tmp_path, "j.yaml", JOB_OK + "scheme: ntp-pw\n")
    from ntp_manager.specfile import load_cluster

    cl = load_cluster(c)
    assert {g.power.base_w for g in cl.gpus()} == {595.0}
    victim = cl.domains[0].gpus[3].uuid
    doc = json.loads(run("plan", "-c", str(c), "-j", str(j), "--json", "--fail", victim).stdout)
    assert sorted(doc["power_caps_w"].values()) == [700.0, 700.0, 700.0]


def test_previous_plan_keeps_groups_in_place_and_shows_the_moves(tmp_path):
    # 4 NVL4 domains, TP4 x 2 stages, 2 replicas, ntp: failures in both replicas (stage 1 of replica
    # 0, stage 0 of replica 1) put the two TP3 groups into one replica by one swap.
    c = write(tmp_path, "c.yaml", "generate: {domains: 4, domain_size: 4, gpus_per_node: 2}\n")
    j = write(tmp_path, "j.yaml", "name: j\ntp: 4\ngroups_per_replica: 2\nreplicas: 2\nlocal_batch: 4\n"
                                  "min_tp: 2\nheads: 8\nparameters: 1000000000\n")
    first = run("plan", "-c", str(c), "-j", str(j), "--json")
    assert first.returncode == 0, first.stderr
    prev = write(tmp_path, "prev.json", first.stdout)
    doc = json.loads(first.stdout)
    a = doc["replicas"][0]["groups"][1]["gpus"][0]
    b = doc["replicas"][1]["groups"][0]["gpus"][0]
    out = run("plan", "-c", str(c), "-j", str(j), "--json", "--fail", a, "--fail", b, "--previous", str(prev))
    assert out.returncode == 0, out.stderr
    moved = json.loads(out.stdout)["moves"]
    assert moved["moved"] == 2 and moved["bytes"] is not None and moved["left"] == 0
    text = run("plan", "-c", str(c), "-j", str(j), "--fail", a, "--fail", b, "--previous", str(prev))
    assert "moves vs the previous plan: 2 group(s) moved" in text.stdout and "(from r" in text.stdout
    bad = write(tmp_path, "bad.json", "{not json")
    r = run("plan", "-c", str(c), "-j", str(j), "--previous", str(bad))
    assert r.returncode == 2 and "malformed JSON" in r.stderr and "Traceback" not in r.stderr
    r = run("plan", "-c", str(c), "-j", str(j), "--previous", str(write(tmp_path, "x.json", '{"replicas": 3}')))
    assert r.returncode == 2 and "previous plan JSON is malformed" in r.stderr
