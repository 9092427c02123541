"""Logging writes to whatever stderr is at the time of the line: a CLI run in-process by a test
configures logging while pytest's capture stands in for stderr and closes it afterwards; log lines
of later tests in that process (from any thread) used to raise "I/O operation on closed file"
(in CI: 21 failures and 11 errors across unrelated files of one xdist worker)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from ntp_manager.contract.logs import RoutedFiles, auto_format, configure_logging


@pytest.fixture
def restored_logging() -> Iterator[None]:
    saved, root = structlog.get_config(), logging.getLogger()
    handlers = list(root.handlers)
    yield
    structlog.configure(**saved)
    structlog.contextvars.clear_contextvars()
    root.handlers[:] = handlers


@pytest.mark.usefixtures("restored_logging")
def test_lines_go_to_the_stderr_of_their_time_not_to_a_closed_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    logging.getLogger().handlers.clear()  # basicConfig only configures a root without handlers
    stand_in = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stand_in)
    configure_logging("console")
    structlog.get_logger().warning("while configured", n=1)
    assert "while configured" in stand_in.getvalue()
    stand_in.close()
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    structlog.get_logger().warning("after the stand-in closed", n=2)
    logging.getLogger("ntp.test").warning("standard logging too")
    assert "after the stand-in closed" in now.getvalue() and "standard logging too" in now.getvalue()


def test_auto_format_follows_the_terminal_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NTP_LOG_FORMAT", raising=False)
    assert auto_format(Tty()) == "console" and auto_format(io.StringIO()) == "json"
    monkeypatch.setenv("NTP_LOG_FORMAT", "json")  # what ntp-run tells its ranks
    assert auto_format(Tty()) == "json"
    with pytest.raises(ValueError, match="console, json or auto"):
        configure_logging("xml")


@pytest.mark.usefixtures("restored_logging")
def test_json_lines_carry_fixed_fields() -> None:
    out = io.StringIO()
    configure_logging("json", stream=out, fields={"worker": "r0g1"})
    structlog.get_logger().info("first step", version=3)
    line = json.loads(out.getvalue())
    assert line["event"] == "first step" and line["worker"] == "r0g1" and line["version"] == 3


@pytest.mark.usefixtures("restored_logging")
def test_routed_files_one_per_node_bound_in_the_context(tmp_path: Path) -> None:
    """The demos' agents share a process: each node's lines go to its own file, by the `node`
    its task bound; lines of no node (and standard logging) to the default file."""
    files = RoutedFiles(tmp_path, key="node", prefix="agent-", default="demo.log")
    files.install()

    async def agent(node: str) -> None:
        structlog.contextvars.bind_contextvars(node=node)  # as agent.local.FakeFleet does per task
        await asyncio.sleep(0)
        structlog.get_logger("ntp.agent").info("connected", manager="m")

    async def both() -> None:
        await asyncio.gather(agent("node-a"), agent("node-b"))

    asyncio.run(both())
    structlog.get_logger().warning("nobody's")
    logging.getLogger("ntp.test").warning("standard logging")
    files.close()
    a, b, rest = ((tmp_path / n).read_text() for n in ("agent-node-a.log", "agent-node-b.log", "demo.log"))
    assert "connected" in a and "node=node-a" in a and "node-b" not in a
    assert "connected" in b and "node=node-b" in b and "node-a" not in b
    assert "nobody's" in rest and "standard logging" in rest and "connected" not in rest
