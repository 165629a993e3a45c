"""Small constant tensors on the device, when host-side checks must be skipped, and whether a CUDA FP32
matmul may round its operands to TF32 (:func:`tf32_may_round`: the references then multiply in float64).

Two rules that the converted layers' opaque ops (`adahop.nn.opaque`) need from every op they run:

- A constant (the E2M1 grid, a Hadamard block, the fold table, fixed signs) is copied to a device
  once and cached: inside the ops, a host-to-device copy on every call would be a sync that a
  CUDA-graph capture cannot hold. The copy is made outside any fake mode, because the forward op's
  fake impl runs the same code on fake tensors, and a cache filled there would hand a fake tensor
  to a later real call. Under dynamo tracing the cached copy is a graph input; only one not yet
  cached is copied by a graph op (a converted layer caches its constants when it is built).
- A check that reads device values on the host (a sync) is skipped while dynamo traces, while a
  fake mode runs the code, and while a CUDA stream captures a graph.

A converted layer makes its constants eagerly, when its specs are fixed and when it moves
(``LowPrecisionLinear._warm_constants``): under ``mode="reduce-overhead"`` a first compiled call
allocates from the CUDA-graph pool, where a cached constant does not belong.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["on_device", "skip_host_checks", "tf32_may_round"]

_CACHE: dict[tuple, torch.Tensor] = {}


def on_device(key: tuple, build: Callable[[], torch.Tensor], device) -> torch.Tensor:
    """``build()`` (a CPU tensor) on ``device``, built and copied once per ``(key, device)``.

    The result is shared: callers must not modify it in place (clone it for that). ``key`` names
    the constant and every parameter it depends on (size, dtype, seed)."""
    k = (*key, str(torch.device(device)))
    t = _CACHE.get(k)
    if torch.compiler.is_dynamo_compiling():
        # traced: the cached device tensor enters the graph as an input. Only a constant not cached
        # yet is built in the graph (a cache write would be a side effect): from a CPU tensor, a
        # host-to-device copy per call, and a CPU input makes Inductor run the whole graph without
        # CUDA graphs under mode="reduce-overhead" ("skipping cudagraphs due to cpu device")
        return t if t is not None else build().to(device)
    if t is None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), torch.device("cpu"):  # built on the CPU whatever the ambient device (meta init)
            t = _CACHE[k] = build().to(device)
    return t


def skip_host_checks() -> bool:
    """True where a host sync must not happen: dynamo tracing, a fake mode, a CUDA-graph capture."""
    if torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def tf32_may_round(t: torch.Tensor) -> bool:
    """Whether an FP32 matmul of CUDA tensor ``t`` may run in TF32 (10 mantissa bits), i.e. ``t`` is on CUDA and
    ``torch.get_float32_matmul_precision()`` is not ``"highest"`` (a setting an Inductor warning asks users to
    change). The FP32 references (GEMM emulations, Hadamard transforms) multiply in float64 then. Raises nothing.
    Source: torch's ``set_float32_matmul_precision`` documentation (``"high"`` allows TF32)."""
    return t.is_cuda and torch.get_float32_matmul_precision() != "highest"
