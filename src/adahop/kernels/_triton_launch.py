"""One way to launch a Triton kernel from a ``torch.library.triton_op`` body, eager or traced.

The fused quantizer and the fold are ``triton_op`` s (issue 18 item 1): under ``torch.compile``,
AOTAutograd decomposes such an op into its body, so Inductor sees the allocations and the launches.
:func:`launch` picks how each launch happens:

- eager, plain tensors: the kernel itself (a ``wrap_triton`` launch outside tracing goes through
  a higher-order-op dispatch, ~1 ms of host time per launch);
- traced (fake or functional tensors), :data:`TRACED_LAUNCHES` ``"inline"``:
  ``torch.library.wrap_triton``, the launch Inductor inlines in its generated code. Tracing it
  costs a TTIR analysis of the kernel per call (torch finds the stored-to arguments from the IR),
  which on a whole model is most of the cold compile;
- traced, ``"opaque"`` (and always under Triton's CPU interpreter, ``TRITON_INTERPRET=1``, which
  ``wrap_triton`` cannot capture): the launch becomes the op ``adahop::triton_launch``, which
  declares the arguments the kernel stores to (``writes``) and runs ``kernel[grid]`` from its
  impl. Everything else in the op body (allocations, views, shapes) is traced as before, and
  ``reduce-overhead`` captures the launch in its CUDA graph like any other kernel.

Imported lazily, with Triton.
"""

from __future__ import annotations

import json

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # a Triton without the interpreter module: nothing is ever interpreted
    InterpretedFunction = ()

__all__ = ["launch", "TRACED_LAUNCHES", "set_traced_launches", "row_geometry"]

#: How a traced launch enters the graph: ``"inline"`` (``wrap_triton``) or ``"opaque"`` (module docstring).
#: Opaque by default: on the H200 (torch 2.11) the inline form's TTIR analyses alone kept a cold
#: compile of llama-125m adahop-lv2 tracing for over 135 s (gpu_call.sh r9c, docs/benchmarks.md).
TRACED_LAUNCHES = "opaque"

_KERNELS: dict[str, object] = {}  # name -> kernel, for the opaque launch op


def _name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__}.{fn.__qualname__}"


def set_traced_launches(how: str) -> str:
    """Set :data:`TRACED_LAUNCHES` (``"inline"`` or ``"opaque"``) for graphs traced from now on;
    returns the previous value. The numbers are the same either way: the same kernels run.

    Raises:
        ValueError: any other value.
    """
    global TRACED_LAUNCHES
    if how not in ("inline", "opaque"):
        raise ValueError(f"traced Triton launches are 'inline' or 'opaque', got {how!r}")
    prev, TRACED_LAUNCHES = TRACED_LAUNCHES, how
    return prev


@torch.library.custom_op("adahop::triton_launch", mutates_args=("writes",))
def _opaque_launch(kernel: str, grid: list[int], writes: list[torch.Tensor], reads: list[torch.Tensor],
                   meta: str) -> None:
    """Launch the registered kernel ``kernel`` on ``grid``: ``writes`` are the tensors it stores to,
    ``reads`` the others; ``meta`` (JSON) names them (``w``, ``r``) and holds the scalar arguments (``s``)."""
    m = json.loads(meta)
    kwargs = {**dict(zip(m["w"], writes)), **dict(zip(m["r"], reads)), **m["s"]}
    _KERNELS[kernel][tuple(grid)](**kwargs)


@_opaque_launch.register_fake
def _(kernel, grid, writes, reads, meta):
    return None


def _traced(kwargs: dict) -> bool:
    return any(isinstance(v, (FakeTensor, FunctionalTensor)) for v in kwargs.values())


def launch(kernel, grid: tuple[int, ...], writes: tuple[str, ...], **kwargs) -> None:
    """Launch ``kernel[grid](**kwargs)`` (every argument by name, launch options such as
    ``num_warps`` included), eagerly or into the graph being traced (module docstring).

    ``writes``: the names of the tensor arguments the kernel stores to (what the opaque launch op
    declares as mutated; ``wrap_triton`` finds them itself from the kernel's IR)."""
    if not _traced(kwargs):
        kernel[grid](**kwargs)
    elif TRACED_LAUNCHES == "opaque" or isinstance(kernel, InterpretedFunction):
        name = _name(kernel)
        _KERNELS[name] = kernel
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        reads = [k for k in tensors if k not in writes]
        scalars = {k: v for k, v in kwargs.items() if k not in tensors}
        _opaque_launch(name, [int(g) for g in grid], [tensors[k] for k in writes], [tensors[k] for k in reads],
                       json.dumps(dict(w=list(writes), r=reads, s=scalars)))
    else:
        torch.library.wrap_triton(kernel)[grid](**kwargs)


def row_geometry(x: torch.Tensor, axis: int) -> tuple[int, int, int, int]:
    """``(rows, kc, stride_r, stride_k)`` of a 2-D ``x`` quantized along ``axis`` (0 or 1): the
    quantizers' row-major view of it, whatever its memory layout. Sizes and strides are read as
    ints: the launch configuration is a function of them, so a symbolic size is specialized here."""
    size, stride = [int(s) for s in x.shape], [int(s) for s in x.stride()]
    if axis == 1:
        return size[0], size[1], stride[0], stride[1]
    return size[1], size[0], stride[1], stride[0]
