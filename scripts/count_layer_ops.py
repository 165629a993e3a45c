#!/usr/bin/env python
"""How many separate ops one converted layer's forward + backward runs, per recipe (CPU analysis).

Inside the opaque layer ops of ``adahop.nn.opaque`` a frozen layer runs eager mode's code, so each
aten op counted here is one kernel launch on the GPU (CUDA graphs replay them all, one by one), and
each Triton launch one fused kernel. The count is what separated the recipes whose quantizers are
fused kernels (mxfp4, quartet, HALO) from those made of plain PyTorch ops (nvfp4, Averis) until the
NVFP4 quantizer became one too (`adahop.kernels.iht_quantize_nvfp4`); what is left of such chains
(Averis's mean vectors in MXFP4, taken by the reference quantizer) ``COMPILED_LAYERS="traced"`` lets
Inductor fuse (too slow to compile for a whole model: round 13).

Usage (CPU; the Triton kernels run in the interpreter, so keep the shapes small)::

    TRITON_INTERPRET=1 python scripts/count_layer_ops.py --backend triton --shape 64,128,64
    python scripts/count_layer_ops.py --backend reference --shape 512,1344,256

``--shape K,N,T``: in_features, out_features, tokens (HALO-2 needs T a power of two). Counted on
2026-12-02 (torch 2.13 CPU, triton 3.9 interpreter, ``--backend triton --shape 64,128,64``; ops other
than views and allocations, the interpreter's own ``set_``/``copy_`` left out; one forward+backward),
before and after the fused NVFP4 quantizer:

============  ==========  ===============  =========  ===============
recipe        ops before  launches before  ops after  launches after
============  ==========  ===============  =========  ===============
quartet       19          10               19         10
mxfp4         7           10               7          10
halo-2        16          11               16         11
nvfp4         410         0                36         12
averis        624         0                90         16
averis-mxfp4  220         10               220        10
============  ==========  ===============  =========  ===============

What the CPU count of nvfp4 still holds that a GPU does not run: 6 ``_to_copy`` of the NVFP4 GEMM's
CPU emulation (BF16 operands to FP32; CUDA multiplies BF16 with FP32 output), and the 8 ops
(``_to_copy``, ``index``, ``mul``) that build the two saved operands' BF16 values in the backward,
which on CUDA are one decode launch each (``_nv_decode_kernel``). So on the GPU an nvfp4 layer runs
14 Triton launches and about 22 other kernels: 6 zero-fills (the tensor-amax words), 3 GEMMs with
their 6 tensor-scale multiplies, 2 ``randint`` (SR seeds) and autograd's own.

At ``--shape 512,64,512`` halo-2's whole-dimension Hadamards (above the fused quantizer's 256) add
Kronecker GEMMs: 31 ops + 11 launches (82 ops + 10 launches while the quantizer's own 512-point
transform was a butterfly: 9 passes of add, sub and cat each way; changed 2026-12-02).
"""

from __future__ import annotations

import argparse
import collections
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# views, metadata and allocations: no kernel of their own
NO_KERNEL = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select",
             "slice", "narrow", "alias", "detach", "as_strided", "split", "unbind", "movedim", "flatten", "lift_fresh",
             "empty", "empty_like", "new_empty", "empty_strided", "_reshape_alias", "view_as", "unflatten"}
INTERPRETER = {"set_", "copy_"}  # what TRITON_INTERPRET=1 does around each launch (real copy_ ops are counted with it)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _count_launches() -> collections.Counter:
    """Count Triton kernel launches by name (the interpreter's or the JIT's)."""
    launches = collections.Counter()
    try:
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit
    except ImportError:
        return launches
    for cls in (interp.InterpretedFunction, jit.JITFunction):
        orig = cls.__getitem__

        def getitem(self, grid, orig=orig):
            launch = orig(self, grid)

            def counted(*a, **k):
                launches[getattr(self.fn, "__name__", str(self.fn))] += 1
                return launch(*a, **k)

            return counted

        cls.__getitem__ = getitem
    return launches


def count(recipe: str, k: int, n: int, t: int, backend: str, launches: collections.Counter) -> dict:
    """One warm forward+backward of a converted ``nn.Linear(k, n)`` on ``t`` tokens, then one counted."""
    import adahop

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(k, n, bias=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adahop.convert_model(m, recipe, backend=backend, exclude=())
    if adahop.get_controller(m).calibrating:
        raise SystemExit(f"{recipe} calibrates first; pick a recipe without calibration")
    x = torch.randn(t, k, requires_grad=True)
    m(x).sum().backward()
    launches.clear()
    with _Count() as c:
        m(x).sum().backward()
    ops = {o: v for o, v in c.ops.items() if o not in NO_KERNEL and o not in INTERPRETER}
    return dict(recipe=recipe, ops=sum(ops.values()), triton_launches=sum(launches.values()),
                interpreter_copies=sum(v for o, v in c.ops.items() if o in INTERPRETER),
                top=sorted(ops.items(), key=lambda kv: -kv[1])[:12], kernels=dict(launches))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default="quartet,nvfp4,averis,halo-2,mxfp4")
    ap.add_argument("--backend", default="auto", choices=("auto", "triton", "reference"))
    ap.add_argument("--shape", default="64,128,64", help="K,N,T")
    args = ap.parse_args()
    k, n, t = (int(v) for v in args.shape.split(","))
    launches = _count_launches()
    for r in args.recipes.split(","):
        row = count(r, k, n, t, args.backend, launches)
        print(f"{r:10s} ops {row['ops']:4d}  triton launches {row['triton_launches']:3d}  {row['kernels']}")
        print(f"{'':10s} top ops: {row['top']}")


if __name__ == "__main__":
    main()
