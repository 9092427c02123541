"""structlog set-up shared by the manager and the agent: to stderr, console or JSON."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


class _Stderr:
    """Whatever `sys.stderr` is when a line is written, not when logging was configured: a test
    (or an embedding program) that swaps stderr and closes its stand-in afterwards must not leave
    every later log line -- on any thread -- raising "I/O operation on closed file"."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


STDERR: Any = _Stderr()


def configure_logging(fmt: str = "console") -> None:
    renderer: Any = (
        structlog.processors.JSONRenderer() if fmt == "json"
        # plain tracebacks: rich ones with locals take seconds to render, on the event loop
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), renderer],
        logger_factory=structlog.PrintLoggerFactory(file=STDERR),
    )
    logging.basicConfig(level=logging.WARNING, stream=STDERR)
