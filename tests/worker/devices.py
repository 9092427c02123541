"""Device variants of the worker's equivalence tests.

- "cpu": CPU tensors on gloo, as always.
- "staged": CPU tensors, with comm.py's staging forced: every message and collective goes through
  separate host buffers, the exact code a GPU without NCCL runs. Runs in CI.
- "cuda": CUDA tensors on gloo (several ranks may share one GPU), staged by comm.py through pinned
  host buffers. Skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from ntp_manager.worker import comm

NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the CUDA variant runs where a GPU is (gloo, staged through host memory)")
CUDA = pytest.param("cuda", marks=NEEDS_CUDA)


def setup(device: str, rank: int) -> torch.device:
    """In a test's worker process: configure the transport for `device`; the tensors' device."""
    if device == "staged":
        comm.configure(force_staging=True)
        return torch.device("cpu")
    if device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        comm.configure(device=dev)
        return dev
    assert device == "cpu", device
    return torch.device("cpu")


def staged_ops() -> int:
    """Operations that went through staging buffers in this process so far."""
    return comm.stats.staged_ops
