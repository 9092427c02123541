"""What the `ntp-manager` commands share: the error line on stderr and its exit status."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
