"""structlog set-up shared by the manager and the agent: to stderr, console or JSON."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(fmt: str = "console") -> None:
    renderer: Any = (
        structlog.processors.JSONRenderer() if fmt == "json"
        # plain tracebacks: rich ones with locals take seconds to render, on the event loop
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), renderer],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
