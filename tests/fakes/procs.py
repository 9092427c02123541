"""Real processes for tests: a free loopback port, `ntp-manager` tokens and `serve` subprocesses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def create_token(data: Path, scope: str, node: str | None = None, env: dict[str, str] | None = None) -> str:
    """`ntp-manager token create` against the data dir (or NTP_DATABASE_URL in `env`); agent
    tokens need the `node` they speak for."""
    cmd = [sys.executable, "-m", "ntp_manager.cli", "token", "create", "--scope", scope, "--json", "--data-dir",
           str(data)]
    if node is not None:
        cmd += ["--node", node]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True,
                         env=dict(os.environ, **(env or {}))).stdout
    return str(json.loads(out)["token"])


def create_agent_tokens(data: Path, nodes: list[str]) -> dict[str, str]:
    """One agent token per node, made by one `ntp-manager token create --nodes-from -` call."""
    cmd = [sys.executable, "-m", "ntp_manager.cli", "token", "create", "--scope", "agent", "--nodes-from", "-",
           "--data-dir", str(data)]
    out = subprocess.run(cmd, input="\n".join(nodes), capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return {d["node"]: d["token"] for d in map(json.loads, out.splitlines())}


def start_manager(
    data: Path, http_port: int = 0, grpc_port: int = 0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """`ntp-manager serve` on loopback; returns the process and its READY info (http, grpc, epoch)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ntp_manager.cli", "serve", "--data-dir", str(data), "--http-port", str(http_port),
         "--grpc-port", str(grpc_port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, **(env or {})),
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("NTP-MANAGER READY"):
            return proc, json.loads(line.split(" ", 2)[2])
    raise AssertionError(f"manager did not start (rc={proc.wait()})")
