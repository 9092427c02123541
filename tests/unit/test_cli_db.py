"""`ntp-manager db upgrade|downgrade` on a fresh SQLite database: it migrates through the service's
schema module (cli/ never opens store/db.py itself) and says the revision it reached."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from ntp_manager.cli.manager import main
from ntp_manager.store.db import MIGRATIONS


def _tables(data_dir: Path) -> set[str]:
    (db_file,) = data_dir.glob("*.db")
    with sqlite3.connect(db_file) as con:
        return {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}


def test_upgrade_then_downgrade_reports_the_revision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("NTP_DATABASE_URL", "NTP_CONFIG_FILE", "NTP_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert main(["db", "upgrade", "0003", "--data-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "database at revision 0003"
    assert "gpus" in _tables(tmp_path) and "outbox" not in _tables(tmp_path)

    assert main(["db", "upgrade", "--data-dir", str(tmp_path)]) == 0
    head = ScriptDirectory(str(MIGRATIONS)).get_current_head()
    assert capsys.readouterr().out.strip() == f"database at revision {head}"
    assert "outbox" in _tables(tmp_path)

    assert main(["db", "downgrade", "--data-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "database at revision None"
    assert _tables(tmp_path) <= {"alembic_version"}
