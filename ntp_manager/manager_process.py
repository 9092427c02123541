"""An `ntp-manager serve` child process, for the programs that start managers and wait on them:
the HA demo (demos/ha_demo.py), the HA benchmark (bench/ha.py) and the HA fault tests.

`serve` prints one line when it listens (`NTP-MANAGER READY {json}`: its addresses, its role and
epoch) and a standby one more when it takes over (`NTP-MANAGER LEADING {json}`: its epoch). Its
stdout is read line by line on a thread, so a caller waits for a line with a timeout, from a plain
thread or (`wait_async`) without holding its event loop; stderr (the JSON log) goes to a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

READY = "NTP-MANAGER READY"
LEADING = "NTP-MANAGER LEADING"


class ManagerProcess:
    """`ntp-manager serve --http-port 0 --grpc-port 0` on `database_url` as leader id `name`, with
    `env` added to this process's environment (lease settings, say)."""

    def __init__(self, name: str, database_url: str, log: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        with log.open("a") as err:  # the child has its own descriptor of it
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ntp_manager.cli", "serve", "--http-port", "0", "--grpc-port", "0"],
                stdout=subprocess.PIPE, stderr=err, text=True,
                env=dict(os.environ, NTP_DATABASE_URL=database_url, NTP_LEADER_ID=name, **(env or {})))
        self.lines: list[str] = []
        self.info: dict[str, Any] = {}  # the READY line's JSON, once `ready` returned
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True, name=f"manager-{name}-stdout").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:  # closed at its end (the process and what it started have exited)
            for line in self.proc.stdout:
                with self._cond:
                    self.lines.append(line.rstrip("\n"))
                    self._cond.notify_all()
        with self._cond:  # end of output: wake a waiter now rather than at its next poll
            self._cond.notify_all()

    def wait_line(self, prefix: str, timeout: float = 120) -> dict[str, Any]:
        """The JSON after the first stdout line that starts with `prefix`. RuntimeError (with the end
        of the log) when the process ends, or `timeout` seconds pass, before there is one."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return dict(json.loads(line[len(prefix):].strip()))
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
                    raise RuntimeError(f"manager {self.name}: no {prefix!r} line within {timeout:g} s "
                                       f"(exit status {self.proc.poll()}); its log ends:\n{tail}")
                self._cond.wait(min(left, 0.1))

    async def wait_async(self, prefix: str, timeout: float = 120) -> dict[str, Any]:
        return await asyncio.to_thread(self.wait_line, prefix, timeout)

    def ready(self, timeout: float = 120) -> dict[str, Any]:
        """Until it listens: its READY info (http, grpc, epoch, role)."""
        self.info = self.wait_line(READY, timeout)
        return self.info

    async def ready_async(self, timeout: float = 120) -> dict[str, Any]:
        return await asyncio.to_thread(self.ready, timeout)

    async def leading(self, timeout: float = 120) -> dict[str, Any]:
        """Until this standby has taken the lease over: {"epoch": ...}."""
        return await self.wait_async(LEADING, timeout)

    @property
    def http(self) -> str:
        return f"http://{self.info['http']}"

    @property
    def grpc(self) -> str:
        return str(self.info["grpc"])

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def stop(self, graceful: bool = True, timeout: float = 15) -> int:
        """SIGTERM (after SIGCONT: a stopped process acts on nothing else), SIGKILL when it has not
        exited within `timeout` or when not `graceful`; its exit status."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM if graceful else signal.SIGKILL)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
        return self.proc.wait()
