import subprocess
import sys

import pytest
from pydantic import ValidationError

from ntp_manager.settings import Settings


def test_defaults_bind_to_loopback_and_use_sqlite(tmp_path, monkeypatch):
    monkeypatch.delenv("NTP_CONFIG_FILE", raising=False)
    s = Settings(data_dir=tmp_path)
    assert s.http_host == "127.0.0.1" and s.grpc_host == "127.0.0.1"
    assert s.effective_database_url == f"sqlite+aiosqlite:///{tmp_path.resolve() / 'ntp-manager.db'}"


def test_env_and_config_file(tmp_path, monkeypatch):
    cfg = tmp_path / "ntp.yaml"
    cfg.write_text("http_port: 9999\ngrpc_port: 7777\nbreaker_share: 0.5\n")
    monkeypatch.setenv("NTP_CONFIG_FILE", str(cfg))
    monkeypatch.setenv("NTP_GRPC_PORT", "6666")  # the environment wins over the file
    s = Settings()
    assert (s.http_port, s.grpc_port, s.breaker_share) == (9999, 6666, 0.5)


def test_invalid_settings_are_rejected(monkeypatch):
    monkeypatch.delenv("NTP_CONFIG_FILE", raising=False)
    with pytest.raises(ValidationError):
        Settings(suspect_after_s=10, fail_after_s=5)
    with pytest.raises(ValidationError):
        Settings(http_port=70000)


def test_cli_reports_bad_settings_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ntp_manager.cli", "serve", "--data-dir", str(tmp_path),
                        "--http-port", "70000"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "http_port" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "ntp_manager.cli", "token", "create", "--scope", "root",
                        "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown scope 'root'" in r.stderr and "Traceback" not in r.stderr
