"""`ntp-run` without a model: its arguments, what it does when a rank's process dies (a script
that crashes once stands in for the training script), and its output as torchrun's (issue 33):
each rank line whole and prefixed, --log-dir/--redirects/--tee files per rank and restart,
--local-ranks-filter, console or JSON log lines by whether stderr is a terminal."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, "-m", "ntp_manager.worker.run"]


def events(stderr: str) -> list[dict[str, Any]]:
    """ntp-run's own log lines (JSON when its stderr is not a terminal)."""
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_ntp_run_refuses_bad_arguments() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ntp_manager.worker.run", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    for args, msg in [
        (["--nproc", "4", "--tp", "3,2", "examples/train_hf_llama.py"], "does not split into replicas"),
        (["--manager", "127.0.0.1:1", "examples/train_hf_llama.py"], "--manager needs --gpus"),
        (["--manager", "127.0.0.1:1", "--gpus", "GPU-a", "examples/train_hf_llama.py"], "needs a token"),
        (["--repair-at", "3", "examples/train_hf_llama.py"], "needs an earlier --fail-at"),
        (["--nproc", "2", "no/such/script.py"], "no such script"),
        (["--nproc", "2", "--redirects", "4", "examples/train_hf_llama.py"], "--redirects must be 0-3"),
        (["--nproc", "2", "--tee", "2:1", "examples/train_hf_llama.py"], "--tee 2:1: local rank 2, but there are 2"),
        (["--nproc", "2", "--local-ranks-filter", "a", "examples/train_hf_llama.py"], "comma-separated local ranks"),
        (["--nproc", "2", "--local-ranks-filter", "0,5", "examples/train_hf_llama.py"], "no local rank 5"),
        (["--nproc", "2", "--log-dir", "README.md", "examples/train_hf_llama.py"], "not a directory"),
        (["--nproc", "2", "--tls-ca", "README.md", "examples/train_hf_llama.py"], "--tls-ca README.md: not a PEM"),
        (["--nproc", "2", "--tls-cert", "c.pem", "examples/train_hf_llama.py"], "--tls-cert and --tls-key go together"),
        (["--nproc", "2", "--tls-ca", "no/ca.pem", "examples/train_hf_llama.py"], "--tls-ca no/ca.pem: cannot read"),
    ]:
        r = run(*args)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)


def test_the_example_refuses_to_run_outside_ntp_run() -> None:
    r = subprocess.run([sys.executable, "examples/train_hf_llama.py", "--steps", "1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "start it with ntp-run" in r.stderr


CRASH_ONCE = """
import os, pathlib, sys, time
marker = pathlib.Path(sys.argv[1]) / os.environ["NTP_WORKER_ID"]
if os.environ["NTP_WORKER_ID"] == "r0g1" and not marker.exists():
    marker.write_text("crashed")
    sys.exit(3)
time.sleep(3)
"""


def test_ntp_run_restarts_a_dead_rank_or_stops_the_run(tmp_path: Path) -> None:
    """Without a manager: a rank that dies is left out of the next layout and put back once its
    fresh process is up (--max-restarts); with no restarts left the run stops, as torchrun's."""
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ONCE)

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        for f in tmp_path.glob("r*"):
            f.unlink()
        return subprocess.run([sys.executable, "-m", "ntp_manager.worker.run", "--nproc", "4", "--replicas", "2",
                               *flags, str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)

    r = run("--max-restarts", "1", "--restart-delay", "0.2")
    assert r.returncode == 0, r.stderr
    ev = events(r.stderr)
    layouts = [(e["tp"], e["reason"]) for e in ev if e["event"] == "layout published"]
    assert layouts == [([2, 2], "start"), ([1, 2], "r0g1 died"), ([2, 2], "r0g1 restarted")], r.stderr
    assert {"event": "done", "finished_cleanly": 4, "ranks": 4, "failed": []}.items() <= ev[-1].items()
    r = run()
    ev = events(r.stderr)
    assert r.returncode == 1 and any(e["event"] == "rank exited" and e["worker"] == "r0g1" and e["status"] == 3
                                     for e in ev), r.stderr
    assert any(e["event"] == "stopping every rank" for e in ev)


def test_ntp_run_survives_every_rank_dying_at_once(tmp_path: Path) -> None:
    """Every rank's process fails at start (here: exit 3) with a restart left: no layout can be
    published while none is up, which is no reason to crash (it once did, with a traceback); each
    fresh process is put back, and when they fail again with no restart left the run ends with a
    clear status."""
    script = tmp_path / "always_fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    r = subprocess.run([sys.executable, "-m", "ntp_manager.worker.run", "--nproc", "2", "--replicas", "2",
                        # the delay is longer than the four processes take to start and exit, also on a
                        # busy box (with 0.2 s the first restarted before the last had died, once in CI:
                        # never all down at once, which is what this tests)
                        "--max-restarts", "1", "--restart-delay", "3", str(script)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, r.stderr
    ev = events(r.stderr)
    assert any(e["event"] == "every rank is down; the next layout comes with the first restart" for e in ev)
    # both died and were restarted; the first to die again with no restart left stops the run
    assert sum(1 for e in ev if e["event"] == "rank exited") >= 3
    assert any(e["event"] == "stopping every rank" for e in ev)


# Each rank writes 40 long lines, each in two pieces flushed apart (two writes to its pipe), a
# line to stderr, its log format, and a last piece without a newline: on a shared descriptor the
# pieces of different ranks would run into each other.
CHATTY = """
import os, sys
w = os.environ["NTP_WORKER_ID"]
for i in range(40):
    sys.stdout.write(f"out {w} {i} ")
    sys.stdout.flush()
    sys.stdout.write("x" * 300 + " end\\n")
    sys.stdout.flush()
print(f"err {w}", file=sys.stderr, flush=True)
print(f"format {os.environ['NTP_LOG_FORMAT']}", flush=True)
sys.stdout.write(f"last {w}")
"""
WORKERS = ["r0g0", "r0g1", "r1g0", "r1g1"]


def test_ntp_run_prefixes_every_rank_line_whole(tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    r = subprocess.run([*RUN, "--nproc", "4", "--replicas", "2", str(script)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    by: dict[str, list[str]] = {w: [] for w in WORKERS}
    for line in r.stdout.splitlines():
        m = re.fullmatch(r"\[(r\dg\d)\]: (.*)", line)
        assert m, f"not a whole, prefixed rank line: {line[:200]!r}"
        by[m[1]].append(m[2])
    for w in WORKERS:
        lines = by[w]
        assert lines[:40] == [f"out {w} {i} " + "x" * 300 + " end" for i in range(40)], (w, lines[:3])
        assert lines[40:] == ["format json", f"last {w}"], (w, lines[40:])  # stderr is no terminal: JSON
    assert sorted(line for line in r.stderr.splitlines() if not line.startswith("{")) == [f"[{w}]: err {w}"
                                                                                          for w in WORKERS]
    started = events(r.stderr)[0]
    assert started["event"] == "ntp-run started" and started["level"] == "info" and "rank_output" not in started


def test_ntp_run_log_dir_redirects_tee_and_filter(tmp_path: Path) -> None:
    """As torchrun: `--redirects 2` sends stderr to files only, `--tee 1` stdout to files and the
    console, `--local-ranks-filter 0` shows only local rank 0 on the console; the files are
    <log dir>/<job>_*/attempt_<restart>/<local rank>/{stdout,stderr}.log, a restarted rank's in
    the next attempt's folder."""
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ONCE.replace("time.sleep(3)", "print('hello from', os.environ['NTP_WORKER_ID'])\n"
                                         "print('log of', os.environ['NTP_WORKER_ID'], file=sys.stderr)\n"
                                         "time.sleep(3)"))
    logs = tmp_path / "logs"
    r = subprocess.run([*RUN, "--nproc", "4", "--replicas", "2", "--max-restarts", "1", "--restart-delay", "0.2",
                        "--log-dir", str(logs), "--redirects", "2", "--tee", "1", "--local-ranks-filter", "0",
                        str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[r0g0]: hello from r0g0"]  # only local rank 0, stdout only
    assert all(line.startswith("{") for line in r.stderr.splitlines()), r.stderr  # no rank line: redirected
    (run_dir,) = logs.glob("job_*")
    assert events(r.stderr)[0]["rank_output"] == str(run_dir)
    for i, w in enumerate(WORKERS):
        first = run_dir / "attempt_0" / str(i)
        if w == "r0g1":  # crashed once (exit 3, nothing printed), then ran in its attempt 1
            assert (first / "stdout.log").read_text() == ""
            first = run_dir / "attempt_1" / str(i)
        assert (first / "stdout.log").read_text() == f"hello from {w}\n"
        assert (first / "stderr.log").read_text() == f"log of {w}\n"
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*.log")) == sorted(
        [f"attempt_0/{i}/{f}" for i in range(4) for f in ("stderr.log", "stdout.log")]
        + ["attempt_1/1/stderr.log", "attempt_1/1/stdout.log"])


def test_ntp_run_logs_for_people_on_a_terminal(tmp_path: Path) -> None:
    """stderr a terminal: ntp-run's lines through structlog's console renderer, and its ranks told
    (NTP_LOG_FORMAT=console)."""
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    master, slave = pty.openpty()
    with (tmp_path / "out").open("w") as out:
        p = subprocess.Popen([*RUN, "--nproc", "1", str(script)], cwd=ROOT, stdout=out, stderr=slave)
    os.close(slave)
    got = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        got += chunk
    os.close(master)
    assert p.wait(120) == 0
    text = got.decode(errors="replace")
    assert re.search(r"\[info\s*\] ntp-run started", text) and '"event"' not in text, text
    assert "[r0g0]: err r0g0" in text
    assert "[r0g0]: format console" in (tmp_path / "out").read_text()
