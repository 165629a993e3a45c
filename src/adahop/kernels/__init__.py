"""Fast paths (Triton + cuBLAS FP8) with PyTorch reference twins (`DESIGN.md` §2 layer 5, §3).

One op per file, each with a ``*_reference`` and a fast twin of the same signature and a
dispatcher taking ``backend: "auto" | "triton" | "reference"``:

- :func:`iht_quantize_mxfp4` (``quantize_mxfp4.py``): block Hadamard + MXFP4 quantize of a GEMM
  operand, fused with the FP8 fold (``MXTensor.fp8``);
- :func:`mx_matmul` (``mx_matmul.py``): the MXFP4 GEMM as a row-wise-scaled FP8 GEMM;
- :func:`iht_quantize_nvfp4` (``quantize_nvfp4.py``, Triton kernels in ``_triton_quantize_nvfp4.py``):
  block Hadamard + NVFP4 quantize of a GEMM operand, writing the GEMM's BF16 operand when asked;
- :func:`nvfp4_matmul` (``nvfp4_matmul.py``): the NVFP4 GEMM as a BF16 GEMM (FP32 accumulation) of
  the exact ``q · s_block`` values, tensor scales after the sum;
- :func:`fold_to_fp8` (``fold.py``, Triton kernel in ``_triton_fold.py``): saved packed MXFP4 →
  the FP8 operand, for the backward GEMMs;
- :func:`resolve_backend` (``backend.py``): which of the two runs, below every op module.

Triton is imported only when a Triton kernel runs. Under ``torch.compile`` the Triton kernels are
``torch.library.triton_op`` s (``adahop::iht_quantize_mxfp4``, ``adahop::quantize_nvfp4``,
``adahop::fold_mxfp4_to_fp8``, defined beside their kernels): AOTAutograd decomposes them into their bodies, so Inductor emits the
allocations and launches in its own code, or the launches as the opaque op ``adahop::triton_launch``
(``_triton_launch.py``: which one is ``TRACED_LAUNCHES``; under ``TRITON_INTERPRET=1`` always the
opaque op, so CPU tests compile the same ops). The FP8 GEMM is traced as
``torch._scaled_mm``; its FP32-accumulation form stays the custom op ``adahop::fp8_rowwise_mm``.
Eager calls run the same bodies without the ops' dispatch.
"""

from ..formats.mxfp4 import FOLD_RANGE, folds_exactly
from .backend import BACKENDS, resolve_backend, triton_available
from .fold import fold_to_fp8, fold_to_fp8_reference, fold_to_fp8_triton
from .mx_matmul import (ACCUMULATIONS, check_mm_layout, mx_matmul, mx_matmul_dequant, mx_matmul_fp8, mx_matmul_reference,
                        mx_transpose)
from .nvfp4_matmul import (
    check_nvfp4_layout,
    nvfp4_block_values,
    nvfp4_kc_sums,
    nvfp4_matmul,
    nvfp4_matmul_bf16,
    nvfp4_matmul_reference,
)
from .quantize_mxfp4 import (
    hadamard_butterfly,
    iht_quantize_mxfp4,
    iht_quantize_mxfp4_reference,
    iht_quantize_mxfp4_triton,
)
from .quantize_nvfp4 import iht_quantize_nvfp4, iht_quantize_nvfp4_reference, iht_quantize_nvfp4_triton

__all__ = [
    "ACCUMULATIONS",
    "BACKENDS",
    "FOLD_RANGE",
    "check_mm_layout",
    "check_nvfp4_layout",
    "fold_to_fp8",
    "fold_to_fp8_reference",
    "fold_to_fp8_triton",
    "folds_exactly",
    "hadamard_butterfly",
    "iht_quantize_mxfp4",
    "iht_quantize_mxfp4_reference",
    "iht_quantize_mxfp4_triton",
    "iht_quantize_nvfp4",
    "iht_quantize_nvfp4_reference",
    "iht_quantize_nvfp4_triton",
    "mx_matmul",
    "mx_matmul_fp8",
    "mx_matmul_dequant",
    "mx_matmul_reference",
    "mx_transpose",
    "nvfp4_block_values",
    "nvfp4_kc_sums",
    "nvfp4_matmul",
    "nvfp4_matmul_bf16",
    "nvfp4_matmul_reference",
    "resolve_backend",
    "triton_available",
]
