"""What a step reads its samples through: the step-addressed `batch_fn(step, start, count)` of
existing scripts, or a sample-addressed source `samples(start, count)` read at the runtime's
global sample cursor (worker/data.py). Either way the step sees one function of (step, offset in
the step's global batch, count); a read that raises becomes a `DataSourceError` naming the source
and the samples, and a source with fewer samples than a global batch is refused before the step
starts (every rank decides that alike, from the layout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ntp_manager.worker.runtime.config import DataSourceError


def _name(fn: Any) -> str:
    name = getattr(fn, "name", None)
    if isinstance(name, str):
        return name
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


class Feed:
    """One of the two forms (module doc). `cursor()` reads the runtime's committed cursor."""

    def __init__(self, batch_fn: Callable[[int, int, int], Any] | None, samples: Any,
                 cursor: Callable[[], int]) -> None:
        if (batch_fn is None) == (samples is None):
            raise ValueError("give train_step either batch_fn(step, start, count) (step-addressed) or "
                             "samples=source(start, count) (sample-addressed), one of them")
        if samples is not None and not callable(samples):
            raise ValueError(f"samples must be callable as samples(start, count), not {type(samples).__name__}")
        self.batch_fn, self.samples, self.cursor = batch_fn, samples, cursor
        self.name = _name(samples if samples is not None else batch_fn)

    def check(self, global_batch: int) -> None:
        """A sample-addressed source that has a length must hold at least one global batch (else
        one step would take some of its samples twice)."""
        if self.samples is None or not hasattr(self.samples, "__len__"):
            return
        n = len(self.samples)
        if n < global_batch:
            c = self.cursor()
            raise DataSourceError(f"data source {self.name} holds {n} samples, fewer than the global batch of "
                                  f"{global_batch}: samples [{c}, {c + global_batch}) cannot be one step's")

    def __call__(self, step: int, start: int, count: int) -> Any:
        if self.samples is not None:
            first = self.cursor() + start
            what = f"samples [{first}, {first + count}) (step {step})"
        else:
            first = start
            what = f"samples [{start}, {start + count}) of step {step}'s global batch"
        try:
            if self.samples is not None:
                return self.samples(first, count)
            assert self.batch_fn is not None
            return self.batch_fn(step, start, count)
        except DataSourceError:
            raise
        except Exception as e:
            raise DataSourceError(f"data source {self.name} failed reading {what}: {type(e).__name__}: {e}") from e

    def prefetch(self, first: int, count: int) -> None:
        """Tell a sample-addressed source the next step's range of this rank's replica."""
        fn = getattr(self.samples, "prefetch", None)
        if fn is not None and count > 0:
            fn(first, count)
