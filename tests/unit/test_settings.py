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


def test_the_event_loop_is_uvloop_unless_told_otherwise(monkeypatch):
    import asyncio

    import uvloop

    from ntp_manager.server import loop_factory

    monkeypatch.delenv("NTP_CONFIG_FILE", raising=False)
    monkeypatch.delenv("NTP_EVENT_LOOP", raising=False)
    for settings, kind in ((Settings(), uvloop.Loop), (Settings(event_loop="asyncio"), asyncio.BaseEventLoop)):
        loop = loop_factory(settings)()
        try:
            assert isinstance(loop, kind)
            assert not isinstance(loop, uvloop.Loop) or kind is uvloop.Loop
        finally:
            loop.close()
    monkeypatch.setenv("NTP_EVENT_LOOP", "trio")
    with pytest.raises(ValidationError, match="event_loop"):
        Settings()


@pytest.mark.parametrize("choice, module", [(None, "uvloop"), ("asyncio", "asyncio.unix_events")])
def test_serve_runs_on_the_event_loop_chosen(tmp_path, choice, module):
    """The served process itself says which loop it runs on (its "serving" log line)."""
    import os
    import signal

    env = {k: v for k, v in os.environ.items() if k not in ("NTP_EVENT_LOOP", "NTP_CONFIG_FILE")}
    if choice is not None:
        env["NTP_EVENT_LOOP"] = choice
    p = subprocess.Popen([sys.executable, "-m", "ntp_manager.cli", "serve", "--data-dir", str(tmp_path),
                          "--http-port", "0", "--grpc-port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("NTP-MANAGER READY"):
                break
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, err[-2000:]
    serving = [ln for ln in err.splitlines() if "serving" in ln]
    assert serving and f"event_loop={module}" in serving[0].replace('"', "").replace(": ", "="), serving


def test_cli_refuses_an_unknown_event_loop(tmp_path):
    import os

    env = dict(os.environ, NTP_EVENT_LOOP="trio")
    r = subprocess.run([sys.executable, "-m", "ntp_manager.cli", "serve", "--data-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "event_loop" in r.stderr and "Traceback" not in r.stderr
