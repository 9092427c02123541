"""A job's training precision (`RuntimeConfig(precision=...)`): "fp32", or "bf16" with fp32 master
state.

Under "bf16" the model's parameters stay fp32 -- they are the master copy -- and so does
everything kept from step to step: the optimizer's state (built over those parameters), the
gradients (the NTP sync's fp32 buffers), what the reshard, the peer fetch and checkpoints move
and store. Only the step's compute is bf16: at its start `compute_copies` casts every floating
parameter to bf16 once and puts the copies in the modules' places for the forward and backward of
every micro-batch (and for activation recomputation, which runs inside the backward), then puts
the fp32 parameters back before the sync. So

- matmuls, activations, the TP all-reduces of activations and the messages between pipeline
  stages are bf16;
- each weight gradient comes out of its matmul in bf16, and the cast's backward adds it into the
  fp32 `.grad`: micro-batches accumulate in fp32, and the DP gradient sync reduces fp32 (exact
  sums of what the micro-batches gave; twice the bytes of a bf16 reduce);
- the optimizer updates the fp32 parameters with fp32 state, so updates far below bf16's
  resolution (2^-8 relative) still add up; the next step's bf16 copies round the new values.

Memory per parameter: fp32 master 4 + fp32 gradient 4 + Adam's two fp32 moments 8 + the step's
bf16 copy 2 = 18 bytes, what Megatron-LM's bf16 optimizer keeps (bf16 weights 2 + fp32 main
weights 4 + fp32 main gradients 4 + moments 8); here the bf16 copy lives only during the step.

Refused at set-up (`PrecisionError`, naming what and why): "fp16" (its gradients underflow
without loss scaling, which the runtime does not do); under "bf16" a model whose floating
parameters are not all fp32 when built (they are the master copy), or a Hugging Face model that
asks to keep modules in fp32 (`_keep_in_fp32_modules`: the bf16 copies would not); under "fp32" a
model built in bf16 or fp16 (its optimizer state would be half precision too; use "bf16").
Buffers are not cast: a model that mixes an fp32 buffer into bf16 activations computes that part
in fp32, as torch's type promotion says (Hugging Face's rotary embedding casts its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16")
_HALF = (torch.bfloat16, torch.float16)


class PrecisionError(ValueError):
    """A precision the model or device cannot be trained in exactly, refused at set-up."""


def check_precision_name(precision: str) -> None:
    if precision == "fp16":
        raise PrecisionError("precision 'fp16' is not supported: fp16 gradients underflow without loss scaling, "
                             "which the runtime does not implement; use 'bf16' (fp32 master state, no scaling needed)")
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")


def compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def check_model(model: nn.Module, precision: str) -> None:
    """Refuse a whole model (as `model_fn` built it) that cannot train in `precision` exactly
    (module docstring)."""
    check_precision_name(precision)
    floating = [(n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point()]
    if precision == "bf16":
        other = [(n, d) for n, d in floating if d != torch.float32]
        if other:
            raise PrecisionError(f"precision 'bf16' keeps the parameters as the fp32 master copy, but {len(other)} "
                                 f"parameter(s) are built in another dtype ({_first(other)}): build the model in "
                                 "fp32 (the runtime casts to bf16 for compute)")
        keep = _kept_in_fp32(model)
        if keep:
            raise PrecisionError(f"precision 'bf16': the model keeps {', '.join(keep[:4])} in fp32 "
                                 "(_keep_in_fp32_modules), but the runtime computes every parameter in bf16; "
                                 "train it with precision 'fp32'")
    else:
        half = [(n, d) for n, d in floating if d in _HALF]
        if half:
            raise PrecisionError(f"precision 'fp32' with {len(half)} half-precision parameter(s) ({_first(half)}): "
                                 "their optimizer state would be half precision too, and updates below its "
                                 "resolution would be lost; build the model in fp32 and set precision 'bf16'")


def check_device(precision: str, device: torch.device) -> None:
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise PrecisionError(f"precision 'bf16': {torch.cuda.get_device_name(device)} has no bf16 support; use 'fp32'")


def _first(pairs: list[tuple[str, torch.dtype]]) -> str:
    return ", ".join(f"{n} is {d}" for n, d in pairs[:3]) + (", ..." if len(pairs) > 3 else "")


def _kept_in_fp32(model: nn.Module) -> list[str]:
    """Module paths a Hugging Face model asks to keep in fp32."""
    wanted: set[str] = set()
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        wanted |= set(getattr(model, attr, None) or ())
    if not wanted:
        return []
    return [path for path, m in model.named_modules()
            if any(w in path.split(".") for w in wanted) and any(True for _ in m.parameters(recurse=False))]


@contextlib.contextmanager
def compute_copies(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Inside: every floating parameter of `model` that is not `dtype` is replaced, in its
    module, by one cast copy (autograd records the cast, so gradients flow back into the
    parameter's fp32 `.grad`; a parameter shared by several modules gets one copy). Outside: the
    parameters are back. Does nothing when every parameter is `dtype` already."""
    swapped: list[tuple[dict[str, Any], str, nn.Parameter]] = []
    copies: dict[int, torch.Tensor] = {}
    try:
        for m in model.modules():
            for name, p in list(m._parameters.items()):
                if p is None or not p.is_floating_point() or p.dtype == dtype:
                    continue
                c = copies.get(id(p))
                if c is None:
                    c = copies[id(p)] = p.to(dtype)  # keeps the layout (unit-major shards stay so)
                swapped.append((m._parameters, name, p))
                m._parameters[name] = c  # type: ignore[assignment]  # a tensor in the parameter's place
        yield
    finally:
        for params, name, p in reversed(swapped):
            params[name] = p
