"""Alembic migrations of the manager's database (env.py, versions/).

At the top of the repository so that `alembic upgrade head` works from a checkout (alembic.ini at
the root); installed as the package `ntp_manager.migrations`, so the manager's wheel carries them
and `ntp-manager serve` / `ntp-manager db upgrade` migrate from an installed wheel
(ntp_manager/store/db.py finds them through importlib.resources).
"""
