"""Abandoning a doomed step early. Once one rank of a layout version has seen a collective fail,
every rank's step at that version is lost: the failing rank leaves its groups, and the others
only find out when their own next collective with it fails -- for a rank of another replica,
that is the gradient sync, after its whole forward and backward. So the first rank to fail says so
in the store (`ntp/<job>/failed/v<epoch>.<version>`), a watcher thread of every rank looks for
that key while the rank computes (every `RuntimeConfig.abort_poll_s`), and the step checks a flag
at its cheap points: before each transformer block's forward and backward (hooks the runtime puts
on the model's blocks: the children of its longest ModuleList), between micro-batches, and before
the gradient sync. A doomed step raises `StepAborted` there -- before the commit, so no state
changed: its gradients are dropped (the next attempt zeroes them), the optimizer never moved, and
the runtime puts the RNG back where the step found it -- and goes down the failure path at once.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ntp_manager.worker.runtime.config import StepAborted


class AbortWatch:
    """The watcher: `arm(key)` while a step computes, `doomed()` the reason once some rank wrote
    `key`, `announce(key, why)` writes it. One thread per rank, started on the first `arm`."""

    def __init__(self, store: Any, poll_s: float) -> None:
        self.store, self.poll_s = store, poll_s
        self._key: str | None = None
        self._seen: tuple[str, str] | None = None  # (key, the reason written there)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, key: str) -> None:
        if self.poll_s <= 0:
            return
        self._key = key
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ntp-abort-watch", daemon=True)
            self._thread.start()
        self._wake.set()

    def disarm(self) -> None:
        self._key = None

    def doomed(self) -> str | None:
        seen, key = self._seen, self._key
        return seen[1] if seen is not None and key is not None and seen[0] == key else None

    def announce(self, key: str, why: str) -> None:
        # the store is the launcher's; if it cannot take the note, peers find out the slow way
        with contextlib.suppress(Exception):
            self.store.set(key, why[:300])

    def _run(self) -> None:
        while not self._stop.is_set():
            key = self._key
            if key is None or (self._seen is not None and self._seen[0] == key):
                self._wake.wait(1.0)  # nothing to watch until the next arm
                self._wake.clear()
                continue
            try:
                if self.store.check([key]):
                    self._seen = (key, bytes(self.store.get(key)).decode(errors="replace"))
            except Exception:  # a store that does not answer: the step's collectives decide
                pass
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the children of its longest ModuleList (none: no blocks)."""
    lists = [list(m) for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    return max(lists, key=len) if lists else []


def install_block_checks(model: nn.Module, check: Callable[[str], None]) -> int:
    """Put `check(where)` before every block's forward and before its backward (a hook on the
    gradient of its output). Once per module (a reshard keeps the modules); returns the blocks
    hooked now. `check` is held weakly through its owner so that the model does not keep a
    Runtime alive."""
    ref: Callable[[], Callable[[str], None] | None] = (
        weakref.WeakMethod(check) if inspect.ismethod(check) else (lambda: check))
    hooked = 0
    for i, blk in enumerate(_blocks(model)):
        if getattr(blk, "_ntp_abort_hooked", False):
            continue
        blk._ntp_abort_hooked = True  # type: ignore[assignment]
        hooked += 1

        def before(_m: nn.Module, _args: Any, i: int = i) -> None:
            fn = ref()
            if fn is not None:
                fn(f"before block {i}'s forward")

        def after(_m: nn.Module, _args: Any, out: Any, i: int = i) -> None:
            t = out if isinstance(out, torch.Tensor) else next(
                (x for x in (out if isinstance(out, (tuple, list)) else ()) if isinstance(x, torch.Tensor)), None)
            if t is None or not t.requires_grad:
                return

            def on_grad(g: torch.Tensor) -> torch.Tensor:
                fn = ref()
                if fn is not None:
                    fn(f"before block {i}'s backward")
                return g

            t.register_hook(on_grad)  # type: ignore[no-untyped-call]

        blk.register_forward_pre_hook(before)
        blk.register_forward_hook(after)
    return hooked


__all__ = ["AbortWatch", "StepAborted", "install_block_checks"]
