"""structlog set-up shared by the manager, the agent, ntp-run, its ranks and the demos.

Where lines go and how they look:

- `configure_logging(fmt)`: every line to stderr (whatever stderr is at the time of the line),
  rendered for people (`console`) or as one JSON object per line (`json`). `auto` picks console
  on a terminal and JSON otherwise (a pipe, a file, a CI log), unless NTP_LOG_FORMAT says which
  (ntp-run sets it for its ranks, whose stderr is a pipe to ntp-run, after its own console).
- `RoutedFiles`: a program that hosts several components in one process (the demos run their
  agents on one event loop) writes each component's lines to a file of its own, chosen by a
  context variable the component bound (`node`, for the agents of `ntp_agent.local.FakeFleet`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import structlog

FORMAT_ENV = "NTP_LOG_FORMAT"  # the manager's and the agent's setting of the same name


class _Stderr:
    """Whatever `sys.stderr` is when a line is written, not when logging was configured: a test
    (or an embedding program) that swaps stderr and closes its stand-in afterwards must not leave
    every later log line -- on any thread -- raising "I/O operation on closed file"."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


STDERR: Any = _Stderr()


def auto_format(stream: Any = None) -> str:
    """`console` when `stream` (default: stderr) is a terminal, `json` otherwise; NTP_LOG_FORMAT
    (`console` or `json`) decides instead when it is set to one of them."""
    env = os.environ.get(FORMAT_ENV, "").strip().lower()
    if env in ("console", "json"):
        return env
    try:
        return "console" if (stream if stream is not None else sys.stderr).isatty() else "json"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return "json"


def _renderer(fmt: str) -> list[Any]:
    if fmt == "json":  # a traceback as a string field, not `"exc_info": true`
        return [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    # plain tracebacks: rich ones with locals take seconds to render, on the event loop
    return [structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)]


def _processors(fields: Mapping[str, str] | None) -> list[Any]:
    """Context variables bound by a component (FakeFleet's `node`), fixed `fields` (a rank's
    `worker`), the level and an ISO time stamp."""
    procs: list[Any] = [structlog.contextvars.merge_contextvars]
    if fields:
        extra = dict(fields)

        def add_fields(_logger: Any, _name: str, event: Any) -> Any:
            for k, v in extra.items():
                event.setdefault(k, v)
            return event

        procs.append(add_fields)
    procs += [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso")]
    return procs


def configure_logging(fmt: str = "console", *, level: int = logging.NOTSET, stream: Any = STDERR,
                      fields: Mapping[str, str] | None = None) -> None:
    """structlog (and the standard library's warnings) to `stream`: `fmt` is `console`, `json` or
    `auto` (`auto_format`); lines below `level` are dropped; `fields` are added to every line.
    ValueError for another format."""
    if fmt == "auto":
        fmt = auto_format(stream)
    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be console, json or auto, not {fmt!r}")
    structlog.configure(
        processors=[*_processors(fields), *_renderer(fmt)],
        logger_factory=structlog.WriteLoggerFactory(file=stream),  # one write per line, newline included
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=logging.WARNING, stream=stream)


class RoutedFiles:
    """Log files for the components of one process: a line whose context holds `key` goes to
    `<directory>/<prefix><value>.log`, any other line to `<directory>/<default>`. Files are opened
    on first use (appending) and closed by `close()`; writes are whole lines, under a lock.

        files = RoutedFiles(logs, key="node", prefix="agent-", default="demo.log")
        files.install()       # structlog and standard logging now write there
        ...
        files.close()         # the caller restores its own configuration (structlog.get_config())
    """

    def __init__(self, directory: Path, key: str, prefix: str, default: str, fmt: str = "console") -> None:
        self.directory, self.key, self.prefix, self.default, self.fmt = directory, key, prefix, default, fmt
        self._files: dict[str, TextIO] = {}
        self._lock = threading.Lock()

    def path(self, route: str | None) -> Path:
        """Where the lines of `route` (a value of `key`; None: the rest) go."""
        name = self.default if route is None else f"{self.prefix}{_safe(route)}.log"
        return self.directory / name

    def write(self, line: str, route: str | None = None) -> None:
        path = self.path(route)
        with self._lock:
            f = self._files.get(path.name)
            if f is None:
                f = self._files[path.name] = path.open("a", buffering=1, encoding="utf-8")
            f.write(line if line.endswith("\n") else line + "\n")

    def install(self, level: int = logging.NOTSET) -> None:
        """Point structlog at these files (and the standard library's root logger at the default
        one)."""
        render = _renderer(self.fmt)
        key = self.key

        def route(logger: Any, name: str, event: Any) -> Any:
            r = event.get(key)
            for step in render:
                event = step(logger, name, event)
            return (event,), {"route": None if r is None else str(r)}

        structlog.configure(
            processors=[*_processors(None), route],
            logger_factory=lambda *_: _RoutedLogger(self),
            wrapper_class=structlog.make_filtering_bound_logger(level),
            cache_logger_on_first_use=False,
        )
        root = logging.getLogger()
        handler = logging.StreamHandler(_DefaultFile(self))
        handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s"))
        root.addHandler(handler)
        self._handler = handler

    def close(self) -> None:
        handler = getattr(self, "_handler", None)
        if handler is not None:
            logging.getLogger().removeHandler(handler)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:100]


class _RoutedLogger:
    """What structlog calls with a rendered line (any level's method name)."""

    def __init__(self, files: RoutedFiles) -> None:
        self._files = files

    def msg(self, line: str, route: str | None = None) -> None:
        self._files.write(line, route)

    def __getattr__(self, _name: str) -> Any:
        return self.msg


class _DefaultFile:
    """A text stream over the routed files' default file, for the standard library's handler."""

    def __init__(self, files: RoutedFiles) -> None:
        self._files = files

    def write(self, text: str) -> int:
        if text.strip():
            self._files.write(text.rstrip("\n"))
        return len(text)

    def flush(self) -> None:
        pass
