"""Put on PYTHONPATH by bench/gpu_session.sh: every Python process of that run may read the GPUs
but never change them. Each NVML call that sets, resets or clears anything is replaced by one that
raises, before any of our code can import pynvml."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WRITES = ("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear", "nvmlSet", "nvmlUnitSet", "nvmlGpuInstanceSet",
          "nvmlComputeInstanceSet", "nvmlVgpuInstanceSet", "nvmlDeviceCreate", "nvmlDeviceDestroy")


def _refuse(name: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name}: this run is read-only (bench/gpu_session.sh); no GPU setting may change")
    return refused


def guard() -> int:
    """Replace pynvml's writing calls; returns how many (0 without pynvml)."""
    try:
        import pynvml
    except ImportError:
        return 0
    names = [n for n in dir(pynvml) if n.startswith(WRITES)]
    for n in names:
        setattr(pynvml, n, _refuse(n))
    return len(names)


guard()
