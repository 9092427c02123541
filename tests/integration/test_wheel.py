"""Installable per role, from the wheels this tree builds (issues 35 and 43).

Two distributions are built from a clean copy of the tracked sources: `nonuniform-tp-manager` (the
root: import package ntp_manager, with the `worker` and `manager` extras) and `nonuniform-tp-agent`
(agent/: import package ntp_agent). Into one fresh virtual environment, in turn:

1. the agent alone (its wheel and the base wheel, no extras): `ntp-agent probe --backend fake`
   runs, and torch, numpy, FastAPI, SQLAlchemy and Alembic are neither installed nor importable;
2. `[worker]` added: the worker API and ntp-run, still without the service's packages;
3. `[manager]` added: `ntp-manager serve` migrates a fresh SQLite database with the migrations the
   wheel carries (migrations/, shipped as ntp_manager.migrations), from a directory outside the tree.

The project's own distributions come only from the wheel files built here: they are named by path,
and each installed one must record that file as its origin (PEP 610's direct_url.json) -- never a
name resolved on the index, where `ntp-manager` is an unrelated project. Third-party dependencies
come from this machine's pip configuration (its local index and wheel directory, torch's CPU wheel
among them). Slow: three installs, about a minute and a half on two cores."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SERVICE_ONLY = ("fastapi", "sqlalchemy", "alembic", "matplotlib", "uvicorn", "asyncpg", "aiosqlite")
NOT_ON_A_NODE = ("torch", "numpy", *SERVICE_ONLY)
MANAGER, AGENT = "nonuniform-tp-manager", "nonuniform-tp-agent"


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def _tops(whl: Path) -> set[str]:
    with zipfile.ZipFile(whl) as z:
        return {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}


def _wheels(tmp: Path) -> tuple[Path, Path]:
    """The two wheels of the tracked sources, built from a clean copy (no stale build/ or egg-info)."""
    src = tmp / "src"
    files = _run(["git", "ls-files", "-z", "pyproject.toml", "setup.py", "README.md", "ntp_manager", "migrations",
                  "agent"], ROOT).split("\0")
    for f in filter(None, files):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    dist = tmp / "dist"
    for project in (src, src / "agent"):  # setuptools from this environment: building needs no registry
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
              str(project)], tmp)
    (manager,) = dist.glob("nonuniform_tp_manager-*.whl")
    (agent,) = dist.glob("nonuniform_tp_agent-*.whl")
    assert _tops(manager) == {"ntp_manager"} and _tops(agent) == {"ntp_agent"}
    with zipfile.ZipFile(manager) as z:  # the migrations travel inside the manager's package
        names = set(z.namelist())
    assert {"ntp_manager/migrations/env.py", "ntp_manager/migrations/script.py.mako",
            "ntp_manager/migrations/versions/0001_initial_schema.py"} <= names
    return manager, agent


def _origins(py: Path, cwd: Path) -> dict[str, str]:
    """Where pip took each of our installed distributions from (direct_url.json's url)."""
    out = _run([str(py), "-c", f"""
import importlib.metadata as md, json
got = {{}}
for name in {(MANAGER, AGENT)!r}:
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    got[name] = json.loads(d.read_text("direct_url.json") or "{{}}").get("url", "")
print(json.dumps(got))
"""], cwd)
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_the_agent_installs_alone_and_the_manager_migrates_from_its_wheel(tmp_path: Path) -> None:
    manager_whl, agent_whl = _wheels(tmp_path)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, bin_ = env_dir / "bin" / "python", env_dir / "bin"
    pip = [str(py), "-m", "pip", "install", "-q", "--no-compile"]

    # 1. the node agent: its wheel and the base wheel, nothing else of ours
    _run([*pip, str(agent_whl), str(manager_whl)], tmp_path, timeout=400)
    assert _origins(py, tmp_path) == {MANAGER: manager_whl.as_uri(), AGENT: agent_whl.as_uri()}
    out = _run([str(py), "-c", f"""
import importlib, importlib.util, json, sys
import ntp_agent.main, ntp_agent.core, ntp_agent.local, ntp_agent.backends.nvml, ntp_agent.backends.fake
refused = []
for m in {NOT_ON_A_NODE!r}:
    try:
        importlib.import_module(m)
    except ModuleNotFoundError:
        refused.append(m)
print(json.dumps({{"file": ntp_agent.main.__file__, "refused": refused,
                  "installed": [m for m in {NOT_ON_A_NODE!r} if importlib.util.find_spec(m)],
                  "loaded": sorted({{m.split('.')[0] for m in sys.modules}} & set({NOT_ON_A_NODE!r}))}}))
"""], tmp_path)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["file"].startswith(str(env_dir)), got  # the installed package, not this tree
    assert got["refused"] == list(NOT_ON_A_NODE) and got["installed"] == [] and got["loaded"] == [], got
    scenario = tmp_path / "node.yaml"
    scenario.write_text("seed: 1\nnode: wheel-node\ndomain: nvl-1\ngpus: 2\n")
    probe = json.loads(_run([str(bin_ / "ntp-agent"), "probe", "--backend", "fake", "--scenario", str(scenario),
                             "--json"], tmp_path))
    assert probe["backend"] == "fake" and probe["domain"] == "nvl-1" and len(probe["gpus"]) == 2, probe
    assert "--tls-ca" in _run([str(bin_ / "ntp-agent"), "--help"], tmp_path)

    # 2. the worker's role on top: the worker API, still none of the service's packages
    _run([*pip, f"{manager_whl}[worker]"], tmp_path, timeout=400)
    out = _run([str(py), "-c", f"""
import importlib.util, json, sys
import ntp_manager.worker as w
api = [getattr(w, n) for n in w.__all__]
from ntp_manager.worker.sources import GrpcLayoutSource
from ntp_manager.contract.client import ManagerClient
from ntp_manager.contract.tls import TlsFiles
import ntp_manager.worker.run, ntp_manager.worker.env
print(json.dumps({{"file": w.__file__, "names": len(api),
                  "installed": [m for m in {SERVICE_ONLY!r} if importlib.util.find_spec(m)],
                  "loaded": sorted({{m.split('.')[0] for m in sys.modules}} & set({SERVICE_ONLY!r}))}}))
"""], tmp_path)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["file"].startswith(str(env_dir)), got
    assert got["names"] > 10 and got["installed"] == [] and got["loaded"] == [], got
    assert "--tls-ca" in _run([str(bin_ / "ntp-run"), "--help"], tmp_path)

    # 3. the manager's role on top: `serve` migrates a fresh database with the wheel's migrations
    _run([*pip, f"{manager_whl}[manager]"], tmp_path, timeout=400)
    assert _origins(py, tmp_path) == {MANAGER: manager_whl.as_uri(), AGENT: agent_whl.as_uri()}
    data = tmp_path / "data"
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen([str(bin_ / "ntp-manager"), "serve", "--data-dir", str(data), "--http-port", "0",
                                 "--grpc-port", "0"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        ready = ""
        for line in proc.stdout:  # the READY line comes after the migrations and the listeners
            if line.startswith("NTP-MANAGER READY"):
                ready = line
                break
        assert ready, log.read_text()[-4000:]
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    (db,) = data.glob("*.db")
    with sqlite3.connect(db) as c:
        (revision,) = c.execute("select version_num from alembic_version").fetchone()
        tables = {r[0] for r in c.execute("select name from sqlite_master where type = 'table'")}
    from alembic.script import ScriptDirectory

    head = ScriptDirectory(str(ROOT / "migrations")).get_current_head()
    assert revision == head, (revision, head)
    assert {"jobs", "gpus", "nodes", "api_tokens"} <= tables, tables


def test_alembic_upgrade_head_works_from_the_checkout(tmp_path: Path) -> None:
    """The root's alembic.ini: `alembic upgrade head` from the repository root, on the database
    NTP_DATABASE_URL names, brings it to the newest revision in migrations/versions."""
    db = tmp_path / "checkout.db"
    env = {**os.environ, "NTP_DATABASE_URL": f"sqlite+aiosqlite:///{db}"}
    r = subprocess.run([str(Path(sys.executable).parent / "alembic"), "upgrade", "head"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    from alembic.script import ScriptDirectory

    head = ScriptDirectory(str(ROOT / "migrations")).get_current_head()
    with sqlite3.connect(db) as c:
        (revision,) = c.execute("select version_num from alembic_version").fetchone()
    assert revision == head
