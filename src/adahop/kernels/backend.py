"""Which backend runs an op of `adahop.kernels`: the Triton kernels or the PyTorch references.

A module of its own, below every kernel module, so that the ops and their lazily imported Triton
kernels all import the choice from one place without importing each other.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch

__all__ = ["BACKENDS", "Backend", "resolve_backend", "triton_available", "triton_runs_on"]

Backend = Literal["auto", "triton", "reference"]
#: Values of every ``backend=`` argument in `adahop.kernels`.
BACKENDS = ("auto", "triton", "reference")

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is not imported here)."""
    return _HAS_TRITON


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether a Triton kernel can run on tensors of ``device``: Triton importable, and a CUDA device or
    Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _HAS_TRITON and (torch.device(device).type == "cuda" or _interpreting())


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Resolve ``backend`` for tensors on ``device``: ``"triton"`` or ``"reference"``.

    ``"auto"`` gives ``"triton"`` on a CUDA device when Triton is importable, else
    ``"reference"``. ``"triton"`` is also accepted on the CPU under ``TRITON_INTERPRET=1``
    (Triton's interpreter, used by the CPU tests).

    Raises:
        ValueError: unknown ``backend``.
        RuntimeError: ``"triton"`` asked for without Triton or without a CUDA device.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use one of {BACKENDS}")
    dev = torch.device(device)
    if backend == "reference":
        return "reference"
    usable = triton_runs_on(dev)
    if backend == "auto":
        return "triton" if usable and dev.type == "cuda" else "reference"
    if not _HAS_TRITON:
        raise RuntimeError(
            "backend='triton' needs triton (pip install 'adahop[triton]'); use backend='reference' or 'auto'"
        )
    if not usable:
        raise RuntimeError(
            f"backend='triton' needs a CUDA device, got tensors on {dev}; use backend='reference' or 'auto' "
            "(or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)"
        )
    return "triton"
