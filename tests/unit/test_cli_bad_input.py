"""Every console script of pyproject.toml answers bad input with one clear line and a non-zero
exit, never a traceback: in process through each `main(argv)` (the function the script runs), and
as real processes for two of them.

Statuses: 2 for usage (click's and argparse's, and each command's own checks), 1 for an answer
ntpctl could not use, 3 when it reaches no manager.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from ntp_agent.main import main as agent_main
from ntp_manager.cli import ctl
from ntp_manager.cli.manager import main as manager_main
from ntp_manager.worker.run import main as run_main

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "examples" / "specs"
CLUSTER, JOB = str(SPECS / "cluster-small.yaml"), str(SPECS / "job-small.yaml")
SCENARIO = str(ROOT / "examples" / "scenarios" / "xid79.yaml")

MAINS: dict[str, Callable[[Sequence[str] | None], int]] = {
    "ntp-manager": manager_main, "ntpctl": ctl.main, "ntp-agent": agent_main, "ntp-run": run_main,
}


class _NotAManager(http.server.BaseHTTPRequestHandler):
    """What answers when NTP_URL names something else: HTML, not the manager's JSON."""

    def do_GET(self) -> None:
        json_ = self.path.startswith("/json")  # another JSON service
        body = b'{"ok": true}' if json_ else b"<html><body>\n<h1>It works</h1>\n</body></html>\n"
        self.send_response(200)
        self.send_header("Content-Type", "application/json" if json_ else "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def not_a_manager() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAManager)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# (script, argv, environment, status, words of the message); {tmp}: the test's directory,
# {www}: a loopback HTTP server that is not a manager, {closed}: a loopback address nothing answers
CASES: list[tuple[str, list[str], dict[str, str], int, str]] = [
    ("ntp-manager", ["nosuch"], {}, 2, "No such command 'nosuch'"),
    ("ntp-manager", ["plan", "-c", CLUSTER], {}, 2, "Missing option '--job'"),
    ("ntp-manager", ["plan", "-c", CLUSTER, "-j", JOB, "--fail-random", "abc"], {}, 2, "--fail-random"),
    ("ntp-manager", ["plan", "-c", "{tmp}/nope.yaml", "-j", JOB], {}, 2, "nope.yaml: no such file"),
    ("ntp-manager", ["plan", "-c", CLUSTER, "-j", JOB, "--previous", "{tmp}"], {}, 2, "cannot read"),
    ("ntp-manager", ["plan", "-c", "{tmp}/binary", "-j", JOB], {}, 2, "binary: not a text file"),
    ("ntp-manager", ["plan", "-c", CLUSTER, "-j", JOB, "--previous", "{tmp}/binary"], {}, 2, "not a text file"),
    ("ntp-manager", ["token", "create", "--scope", "agent", "--nodes-from", "{tmp}/binary", "--data-dir", "{tmp}"],
     {}, 2, "not a text file"),
    ("ntp-manager", ["cluster", "generate", "--domains", "2", "--domain-size", "6"], {}, 2, "not a multiple"),
    ("ntp-manager", ["serve", "--http-port", "99999", "--data-dir", "{tmp}"], {}, 2, "http_port"),
    ("ntp-manager", ["token", "list", "--data-dir", "{tmp}"], {"NTP_CONFIG_FILE": "{tmp}/none.yaml"}, 2,
     "NTP_CONFIG_FILE={tmp}/none.yaml: no such file"),
    ("ntp-manager", ["token", "list", "--data-dir", "{tmp}"], {"NTP_CONFIG_FILE": "{tmp}/bad.yaml"}, 2, "not YAML"),
    ("ntp-manager", ["token", "list", "--data-dir", "{tmp}"], {"NTP_CONFIG_FILE": "{tmp}/list.yaml"}, 2,
     "expected a mapping"),
    ("ntp-manager", ["db", "upgrade", "nosuchrevision", "--data-dir", "{tmp}"], {}, 2,
     "Can't locate revision identified by 'nosuchrevision'"),
    ("ntp-manager", ["simulate", "--preset", "small", "--plot", "{tmp}/no/dir/x.png"], {}, 2, "no such directory"),
    ("ntp-manager", ["simulate", "--preset", "small", "--days", "nan"], {}, 2, "--days must be a finite number"),
    ("ntp-manager", ["simulate", "--preset", "small", "--rack-headroom", "inf"], {}, 2,
     "--rack-headroom must be a finite number, got inf"),
    ("ntpctl", ["status"], {}, 2, "no token"),
    ("ntpctl", ["nosuch"], {"NTP_TOKEN": "t"}, 2, "No such command"),
    ("ntpctl", ["--url", "http://[::1", "status"], {"NTP_TOKEN": "t"}, 2, "is not an http:// or https:// address"),
    ("ntpctl", ["status"], {"NTP_TOKEN": "a\nb"}, 2, "characters an HTTP header cannot carry"),
    ("ntpctl", ["--token-file", "{tmp}", "status"], {}, 2, "cannot read the token"),
    ("ntpctl", ["drain", "node-1", "--reason", "r", "--in", "5x"], {"NTP_TOKEN": "t"}, 2, "--in '5x'"),
    ("ntpctl", ["layout"], {"NTP_TOKEN": "t"}, 2, "Missing argument 'job'"),
    ("ntpctl", ["--timeout", "inf", "status"], {"NTP_TOKEN": "t"}, 2, "--timeout"),
    ("ntpctl", ["slow", "set", "j", "--set", "enter_margin"], {"NTP_TOKEN": "t"}, 2, "expected NAME=VALUE"),
    ("ntpctl", ["submit", "{tmp}/bad.yaml"], {"NTP_TOKEN": "t"}, 2, "not YAML"),
    ("ntpctl", ["submit", "{tmp}/binary"], {"NTP_TOKEN": "t"}, 2, "not a text file"),
    ("ntpctl", ["--token-file", "{tmp}/binary", "status"], {}, 2, "not a token file"),
    ("ntpctl", ["--url", "{www}", "status"], {"NTP_TOKEN": "t"}, 1, "not the manager's JSON"),
    ("ntpctl", ["--url", "{www}/json", "status"], {"NTP_TOKEN": "t"}, 1, "not what ntpctl expects (no field"),
    ("ntpctl", ["--url", "{closed}", "status"], {"NTP_TOKEN": "t"}, 3, "cannot reach the manager"),
    ("ntp-agent", ["--bogus"], {}, 2, "No such option: --bogus"),
    ("ntp-agent", ["--token-file", "{tmp}/token", "--backend", "fake", "--scenario", SCENARIO],
     {"NTP_AGENT_HEARTBEAT_INTERVAL_S": "inf"}, 2, "heartbeat_interval_s"),
    ("ntp-agent", ["--metrics-port", "abc"], {}, 2, "--metrics-port"),
    ("ntp-agent", ["--token-file", "{tmp}/token", "--backend", "fake", "--scenario", "{tmp}"], {}, 2,
     "cannot read"),
    ("ntp-agent", ["--token-file", "{tmp}/token", "--backend", "fake", "--scenario", SCENARIO],
     {"NTP_AGENT_XID_POLICY": "94=fail"}, 2, "xid_policy"),
    ("ntp-agent", ["--token-file", "{tmp}/token", "--backend", "fake", "--scenario", SCENARIO, "--tls-ca",
                   "{tmp}/token"], {}, 2, "--tls-ca {tmp}/token: not a PEM certificate"),
    ("ntp-agent", ["--token-file", "{tmp}/binary", "--backend", "fake", "--scenario", SCENARIO], {}, 2,
     "not a token file"),
    ("ntp-agent", ["probe", "--backend", "quantum"], {}, 2, "backend must be nvml or fake"),
    ("ntp-agent", ["probe", "extra"], {}, 2, "unexpected extra argument"),
    ("ntp-run", [], {}, 2, "required: script"),
    ("ntp-run", ["--nproc", "x", "train.py"], {}, 2, "invalid int value: 'x'"),
    ("ntp-run", ["--tp", "x", "train.py"], {}, 2, "--tp must be comma-separated integers"),
    ("ntp-run", ["--store", "host:port", SCENARIO], {}, 2, "--store must be HOST:PORT"),
    ("ntp-run", ["--store-port", "99999", SCENARIO], {}, 2, "--store-port must be 0-65535"),
    ("ntp-run", ["--restart-delay", "nan", SCENARIO], {}, 2, "--restart-delay from 0 to 86400 s"),
    ("ntp-run", ["--nproc", "2", "{tmp}/nope.py"], {}, 2, "no such script"),
    ("ntp-run", ["--manager", "m:1", "--gpus", "GPU-a", "--token-file", "{tmp}/binary", "x.py"], {}, 2,
     "not a token file"),
]

ENV_CLEARED = ("NTP_TOKEN", "NTP_TOKEN_FILE", "NTP_URL", "NTP_CONFIG_FILE", "NTP_MANAGER", "NTP_GPUS", "NTP_JOB")


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fill(text: str, tmp: Path, www: str) -> str:
    if "{closed}" in text:
        text = text.replace("{closed}", f"http://127.0.0.1:{_closed_port()}")
    return text.replace("{tmp}", str(tmp)).replace("{www}", www)


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "bad.yaml").write_text("key: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- http_port\n")
    (tmp_path / "token").write_text("ntp_00000000_x\n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00 not text")
    return tmp_path


@pytest.mark.parametrize(("script", "argv", "env", "status", "message"), CASES,
                         ids=[f"{c[0]}:{' '.join(c[1])[:40]}" for c in CASES])
def test_bad_input_is_one_line_and_a_status(script: str, argv: list[str], env: dict[str, str], status: int,
                                            message: str, files: Path, not_a_manager: str,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    for name in ENV_CLEARED:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, _fill(value, files, not_a_manager))
    monkeypatch.setattr(ctl, "ROUNDS", 1)  # one pass over the addresses: no backoff sleeps
    rc = MAINS[script]([_fill(a, files, not_a_manager) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == status, err
    assert len(lines) == 1 and "error:" in lines[0], err
    assert _fill(message, files, not_a_manager) in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["-m", "ntp_manager.cli", "plan", "--cluster", CLUSTER, "--job", JOB, "--seed", "x"], "--seed"),
    (["-m", "ntp_manager.worker.run", "--tp", "2,x", "train.py"], "--tp must be comma-separated integers"),
])
def test_bad_input_as_a_real_process(argv: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_serve_on_a_port_in_use_says_so_and_stops(tmp_path: Path) -> None:
    """The REST port is taken: one error line, status 2, and the gRPC server it had started is
    stopped (before: its destructor's 'Event loop is closed' traceback followed the error)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "ntp_manager.cli", "serve", "--data-dir", str(tmp_path),
                            "--http-port", str(port), "--grpc-port", "0"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert lines == [f"error: cannot start: cannot bind REST to 127.0.0.1:{port} (Address already in use)"], r.stderr


def test_a_tls_file_that_is_not_pem_is_named(tmp_path: Path) -> None:
    """`serve --grpc-tls-cert F` with F not a PEM certificate: grpcio only logs 'Invalid cert chain
    file' and fails to bind, which `serve` reported as 'cannot bind gRPC TLS to ...'."""
    from ntp_manager.rpc.tls import server_credentials
    from ntp_manager.settings import Settings

    bad = tmp_path / "cert.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(OSError, match=r"grpc_tls_cert .*cert.pem: not a PEM certificate"):
        server_credentials(Settings(data_dir=tmp_path, grpc_tls_cert=bad, grpc_tls_key=bad))
