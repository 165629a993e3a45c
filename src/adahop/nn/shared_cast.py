"""One autocast copy of an input that several converted layers read (q, k and v; gate and up).

Under eager autocast every linear casts its FP32 input to BF16 itself, and a layer that keeps its input
for backward (a BF16 GEMM of the plan, or calibration) keeps its own copy: q, k and v held three BF16 copies of
one X (`docs/benchmarks.md`, "Where the memory goes"). :func:`shared_cast` makes the copy once and hands each
layer its own autograd node over it, so the gradients still reach X separately, cast back to its dtype and
summed there in FP32, exactly as after separate casts. Compiled graphs are left to Inductor.
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["shared_cast"]

_last = threading.local()  # (source, its version, dtype, the copy), each held weakly: nothing is kept alive here


class _Alias(torch.autograd.Function):
    """``cast`` to the layer, as a view of its own; the gradient goes back to ``x`` in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.to(ctx.dtype), None


def shared_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, one copy for consecutive calls on the same unchanged tensor while the copy is alive.

    Values and gradients equal ``x.to(dtype)``'s; under ``torch.compile`` and inference mode it is
    ``x.to(dtype)``. A write to ``x`` or to a copy handed out makes the next call cast again (both tensors'
    version counters are checked); a write through ``x.data``, which bumps no counter, is not seen.
    """
    # inference tensors have no version counter, and inference saves nothing for backward: nothing to share
    if x.dtype == dtype or torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or x.is_inference():
        return x.to(dtype)
    entry = getattr(_last, "entry", None)
    cast = None
    if entry is not None:
        src, version, dt, ref, cast_version = entry
        c = ref()
        # x written in place since (its version), or the copy written through a view handed out (its own)
        if src() is x and version == x._version and dt == dtype and c is not None and c._version == cast_version:
            cast = c
    if cast is None:
        with torch.no_grad():
            cast = x.to(dtype)
        _last.entry = (weakref.ref(x), x._version, dtype, weakref.ref(cast), cast._version)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return cast.view_as(cast)
    return _Alias.apply(x, cast)
