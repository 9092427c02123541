"""The package list, which pyproject.toml cannot say: every ntp_manager package, and
ntp_manager.migrations taken from the top-level migrations/ directory (Alembic's env.py and
versions/, where Alembic users look), so the manager's wheel carries its migrations. Everything
else about the distribution is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["ntp_manager", "ntp_manager.*"]), "ntp_manager.migrations"],
    package_dir={"ntp_manager.migrations": "migrations"},
)
