"""Installable per role (issue 35): the wheel built from this tree, installed with `[worker]` alone
into a fresh virtual environment, gives the worker API (the layout source, the manager client,
ntp-run) without FastAPI, SQLAlchemy, Alembic or matplotlib; `[agent]` added, the agent, still
without them; `[manager]` added
runs `ntp-manager serve`, which migrates a fresh SQLite database from the migrations the wheel
carries (ntp_manager/store/migrations), from a directory outside the source tree.

pip runs with this machine's configuration (its local index and wheel directory, torch's CPU wheel
among them; a package it lacks comes from its cache or registry). Slow: two installs, about a
minute on two cores."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SERVICE_ONLY = ("fastapi", "sqlalchemy", "alembic", "matplotlib", "uvicorn", "asyncpg", "aiosqlite")


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def _wheel(tmp: Path) -> Path:
    """The wheel of the tracked sources, built from a clean copy (no stale build/ or egg-info)."""
    src = tmp / "src"
    files = _run(["git", "ls-files", "-z", "pyproject.toml", "README.md", "ntp_manager"], ROOT).split("\0")
    for f in filter(None, files):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    # setuptools from this environment: building needs nothing from a registry
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
          str(src)], tmp)
    (whl,) = (tmp / "dist").glob("ntp_manager-*.whl")
    with zipfile.ZipFile(whl) as z:  # one top-level package: the agent lives under it (issue 35)
        tops = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"ntp_manager"}, tops
    return whl


def test_the_worker_installs_alone_and_the_manager_migrates_from_the_wheel(tmp_path: Path) -> None:
    whl = _wheel(tmp_path)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, bin_ = env_dir / "bin" / "python", env_dir / "bin"
    pip = [str(py), "-m", "pip", "install", "-q", "--no-compile", "--find-links", str(whl.parent)]
    _run([*pip, f"{whl}[worker]"], tmp_path, timeout=400)

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
    assert got["file"].startswith(str(env_dir)), got  # the installed package, not this tree
    assert got["names"] > 10 and got["installed"] == [] and got["loaded"] == [], got
    help_text = _run([str(bin_ / "ntp-run"), "--help"], tmp_path)
    assert "--tls-ca" in help_text

    # the agent's role on top: still none of the service's packages
    _run([*pip, f"{whl}[agent]"], tmp_path, timeout=400)
    out = _run([str(py), "-c", f"""
import importlib.util, json, sys
import ntp_manager.agent.main, ntp_manager.agent.core, ntp_manager.agent.local
import ntp_manager.agent.backends.nvml, ntp_manager.agent.backends.fake
print(json.dumps({{"file": ntp_manager.agent.main.__file__,
                  "installed": [m for m in {SERVICE_ONLY!r} if importlib.util.find_spec(m)]}}))
"""], tmp_path)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["file"].startswith(str(env_dir)) and got["installed"] == [], got
    assert "--tls-ca" in _run([str(bin_ / "ntp-agent"), "--help"], tmp_path)

    # the manager's role on top: `serve` migrates a fresh database with the wheel's migrations
    _run([*pip, f"{whl}[manager]"], tmp_path, timeout=400)
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

    head = ScriptDirectory(str(ROOT / "ntp_manager" / "store" / "migrations")).get_current_head()
    assert revision == head, (revision, head)
    assert {"jobs", "gpus", "nodes", "api_tokens"} <= tables, tables
