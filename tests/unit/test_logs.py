"""Logging writes to whatever stderr is at the time of the line: a CLI run in-process by a test
configures logging while pytest's capture stands in for stderr and closes it afterwards; log lines
of later tests in that process (from any thread) used to raise "I/O operation on closed file"
(in CI: 21 failures and 11 errors across unrelated files of one xdist worker)."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator

import pytest
import structlog

from ntp_manager.logs import configure_logging


@pytest.fixture
def restored_logging() -> Iterator[None]:
    saved, root = structlog.get_config(), logging.getLogger()
    handlers = list(root.handlers)
    yield
    structlog.configure(**saved)
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
