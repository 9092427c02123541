"""Runs a typer app as a console script: a usage error is one `error:` line, never a traceback.

typer prints a usage error (unknown command or option, a bad value, a missing option) as a
multi-line boxed panel; the console scripts (`ntp-manager`, `ntpctl`, `ntp-agent`) print one line on
stderr instead, `error: <what> (try 'CMD --help')`, and exit with click's status (2). Errors the
commands raise themselves (`typer.Exit` after their own `error:` line) keep their status; Ctrl-C is
130. Lives beside logs.py so that both the manager's commands and the agent may use it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from typer import Abort

try:  # typer >= 0.29 carries its own click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer on real click
    from click.exceptions import ClickException  # type: ignore[assignment]


def one_line(e: ClickException) -> str:
    """The error as one line, with where to get help when click knows the command."""
    msg = " ".join(e.format_message().split())
    ctx: Any = getattr(e, "ctx", None)
    if ctx is not None:
        return f"error: {msg} (try '{ctx.command_path} --help')"
    return f"error: {msg}"


def run_app(app: Any, argv: Sequence[str] | None, prog_name: str) -> int:
    """Run `app` on argv (default: sys.argv[1:]) and return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        rv = app(args=args, prog_name=prog_name, standalone_mode=False)
    except ClickException as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # the help was printed: as typer itself does
            return e.exit_code
        print(one_line(e), file=sys.stderr)
        return e.exit_code
    except (Abort, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return 130
    return rv if isinstance(rv, int) else 0
