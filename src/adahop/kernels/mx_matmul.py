"""MXFP4 GEMM ``dequant(A) @ dequant(B)`` with FP32 accumulation: reference and FP8 twins.

The fast path is the Hopper fold of `DESIGN.md` §3: both operands as FP8 E4M3 with one FP32 scale
per row of A and per column of B, multiplied by cuBLAS (``torch._scaled_mm``, row-wise scales,
no fast accumulation). The operands are exact; the sum is not quite FP32: Hopper's FP8 MMA adds the
32 products of each instruction with fewer bits than FP32 before cuBLAS promotes the partial sum
(‖Δ‖/‖|A|·|B|‖ ≈ 4e-6–1.5e-5 at K = 32768–4096 on the H200, falling as 1/√K: a fixed error per
instruction; the BF16 tensor cores give 1e-8 on the same operands; `scripts/diag_gemm.py`).
``accumulation="fp32"`` multiplies the same FP8 operands on the BF16 tensor cores instead (exact
products, FP32 sums) at BF16 GEMM speed; converted layers take it from their recipe
(``GemmSpec.accumulation``, ``Recipe.with_accumulation``).

An operand quantized without the row exponent-range limit (``max_scale_range=None``, the
``msr-none`` variant) has no exact FP8 fold. The fast path then multiplies the dequantized
operands on the BF16 tensor cores instead (:func:`mx_matmul_dequant`): every E2M1 value times
its E8M0 scale is exact in BF16 (two significant bits, exponents within BF16's range for any
finite BF16 or FP32 input), so it is the same exact-products, FP32-sums GEMM as ``"fp32"``
accumulation, at BF16 GEMM speed plus one dequantizing pass per operand.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..device_constants import tf32_may_round
from ..formats.mxfp4 import MXTensor, folds_exactly
from ..recipes.spec import ACCUMULATIONS
from .backend import resolve_backend
from .fold import fold_to_fp8

__all__ = ["mx_matmul", "mx_matmul_reference", "mx_matmul_fp8", "mx_matmul_dequant", "mx_transpose", "check_mm_layout",
           "ACCUMULATIONS"]



def mx_transpose(q: MXTensor) -> MXTensor:
    """The logical transpose of a 2-D :class:`MXTensor`, sharing its storage (and ``fp8`` cache).

    ``W [N, K]`` quantized along K (``axis=1``) is ``Wᵀ [K, N]`` blocked along ``axis=0``: the
    B operand of the fprop GEMM ``Y = X · Wᵀ``, without requantizing.
    """
    if len(q.shape) != 2:
        raise ValueError(f"mx_transpose needs a 2-D MXTensor, got shape {q.shape}")
    return dataclasses.replace(q, shape=(q.shape[1], q.shape[0]), axis=1 - q.axis)


def check_mm_layout(qa: MXTensor, qb: MXTensor) -> tuple[int, int, int]:
    """Check the layouts the FP8 GEMM needs; return ``(M, Kc, N)``.

    A is ``[M, Kc]`` blocked along axis 1 (codes ``[M, Kp/2]``: rows of A, K contiguous), B is
    ``[Kc, N]`` blocked along axis 0 (codes ``[N, Kp/2]``: B column-major, K contiguous).

    Raises:
        ValueError: naming the operand, what it has and what it needs.
    """
    for name, q, want in (("qa", qa, 1), ("qb", qb, 0)):
        if not isinstance(q, MXTensor):
            raise ValueError(f"mx_matmul: {name} must be an MXTensor, got {type(q).__name__}")
        if len(q.shape) != 2:
            raise ValueError(f"mx_matmul: {name} must be 2-D, got shape {q.shape}")
        if q.axis != want:
            role = "A [M, Kc] must be blocked along axis=1" if want == 1 else "B [Kc, N] must be blocked along axis=0"
            raise ValueError(f"mx_matmul: {name} is blocked along axis={q.axis}; {role} (the contracted dim); "
                             f"quantize it with axis={want} or use mx_transpose")
    (m, kc), (kb, n) = qa.shape, qb.shape
    if kc != kb:
        raise ValueError(f"mx_matmul: contracted dims differ: qa is {qa.shape}, qb is {qb.shape}")
    if qa.block_size != qb.block_size:
        raise ValueError(f"mx_matmul: block sizes differ ({qa.block_size} vs {qb.block_size})")
    kp = -(-kc // qa.block_size) * qa.block_size
    for name, q, rows in (("qa", qa, m), ("qb", qb, n)):
        codes_cols = 0 if q.codes_dropped and q.fp8 is not None else kp // 2  # FP8-only: codes [rows, 0]
        if tuple(q.codes.shape) != (rows, codes_cols) or tuple(q.scales.shape) != (rows, kp // q.block_size):
            raise ValueError(f"mx_matmul: {name} codes {tuple(q.codes.shape)} / scales {tuple(q.scales.shape)} do not "
                             f"match shape {q.shape} with axis={q.axis} (want {(rows, codes_cols)} / {(rows, kp // q.block_size)})")
    if qa.codes.device != qb.codes.device:
        raise ValueError(f"mx_matmul: operands on different devices ({qa.codes.device}, {qb.codes.device})")
    return m, kc, n


def mx_matmul_reference(qa: MXTensor, qb: MXTensor, *, out_dtype: torch.dtype = torch.float32,
                        backend: str = "reference") -> torch.Tensor:
    """Emulated MXFP4 GEMM: ``qa.dequantize() @ qb.dequantize()`` in FP32, cast to ``out_dtype``.

    Checks the same layouts as the FP8 path (:func:`check_mm_layout`). On CUDA with TF32 matmuls
    enabled it multiplies in float64 instead, so the reference never drops to TF32.
    """
    check_mm_layout(qa, qb)
    a, b = qa.dequantize(), qb.dequantize()  # [M, Kc], [Kc, N] fp32
    if tf32_may_round(a):
        return (a.double() @ b.double()).to(out_dtype)
    return (a @ b).to(out_dtype)


def _fp8_rowwise_mm_impl(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                         out_dtype: torch.dtype, fp32_accumulation: bool = False) -> torch.Tensor:
    # out [M, N] = (a [M, Kp] · a_scale[:, None]) @ (b [N, Kp] · b_scale[:, None])ᵀ ; b.t() is column-major.
    # a_scale / b_scale may also have one element (a tensor scale: the NVFP4 GEMM, kernels.nvfp4_matmul)
    if fp32_accumulation:  # E4M3 values (and NVFP4's q·s_block, already BF16) are exact in BF16: exact products, FP32 sums
        if a.is_cuda:
            out = torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16).t(), out_dtype=torch.float32)
        else:  # the CPU has no BF16 GEMM with FP32 output
            out = a.float() @ b.float().t()
        return (out * a_scale[:, None] * b_scale[None, :]).to(out_dtype)
    n = b.shape[0]
    pad = (-n) % 16  # cuBLAS wants N % 16 == 0; Kp is a multiple of 32 already
    if pad:
        b = F.pad(b.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
        b_scale = F.pad(b_scale, (0, pad), value=1.0)
    out = torch._scaled_mm(a, b.t(), scale_a=a_scale.view(-1, 1), scale_b=b_scale.view(1, -1),
                           out_dtype=out_dtype, use_fast_accum=False)
    return out[:, :n].contiguous() if pad else out


# Under torch.compile the FP8 GEMM is traced as the aten ops it is (``_scaled_mm``: Inductor emits the
# cuBLAS call in its own code); only the FP32-accumulation form goes through this opaque op, since
# ``torch.mm(..., out_dtype=)`` is not lowered by every Inductor. Eager calls skip the op's dispatch. The NVFP4
# GEMM (``nvfp4_matmul.py``) multiplies its exact BF16 operands through the same op.
_fp8_rowwise_mm = torch.library.custom_op("adahop::fp8_rowwise_mm", _fp8_rowwise_mm_impl, mutates_args=())


@_fp8_rowwise_mm.register_fake
def _(a, a_scale, b, b_scale, out_dtype, fp32_accumulation=False):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


def _check_accumulation(accumulation: str) -> str:
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation={accumulation!r} is not supported; use one of {ACCUMULATIONS}")
    return accumulation


def mx_matmul_fp8(qa: MXTensor, qb: MXTensor, *, out_dtype: torch.dtype = torch.float32,
                  backend: str = "triton", accumulation: str = "fp8-mma") -> torch.Tensor:
    """FP8 fast path of :func:`mx_matmul`: fold (or reuse ``q.fp8``), then one row-wise-scaled FP8 GEMM."""
    check_mm_layout(qa, qb)
    exact = _check_accumulation(accumulation) == "fp32"
    fa, sa = qa.fp8 if qa.fp8 is not None else fold_to_fp8(qa, backend=backend)  # [M, Kp], [M]
    fb, sb = qb.fp8 if qb.fp8 is not None else fold_to_fp8(qb, backend=backend)  # [N, Kp], [N]
    op = _fp8_rowwise_mm if exact and torch.compiler.is_dynamo_compiling() else _fp8_rowwise_mm_impl
    return op(fa, sa, fb, sb, out_dtype, exact)


def _folds(q: MXTensor) -> bool:
    """True when ``q`` has an FP8 form or can be folded into one exactly (row exponent range <= 8)."""
    return q.fp8 is not None or folds_exactly(q.scale_range)


def mx_matmul_dequant(qa: MXTensor, qb: MXTensor, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fast path of :func:`mx_matmul` for operands with no exact FP8 fold (``max_scale_range=None``).

    Both operands dequantized to BF16 (exact: see the module docstring), multiplied with FP32
    accumulation (``torch.mm(..., out_dtype=torch.float32)`` on CUDA, FP32 on the CPU). Same
    arguments, layouts and result as :func:`mx_matmul_reference` (``[M, N]`` in ``out_dtype``), up to
    the order of the FP32 sums.

    Raises:
        ValueError: operands whose layouts do not multiply (:func:`check_mm_layout`).
    """
    m, _, n = check_mm_layout(qa, qb)
    a = qa.dequantize(torch.bfloat16)  # [M, Kc]
    b = qb.dequantize(torch.bfloat16).t()  # [N, Kc]
    ones_m, ones_n = a.new_ones(m, dtype=torch.float32), a.new_ones(n, dtype=torch.float32)
    op = _fp8_rowwise_mm if torch.compiler.is_dynamo_compiling() else _fp8_rowwise_mm_impl
    return op(a, ones_m, b, ones_n, out_dtype, True)


def mx_matmul(qa: MXTensor, qb: MXTensor, *, out_dtype: torch.dtype = torch.float32,
              backend: str = "auto", accumulation: str = "fp8-mma") -> torch.Tensor:
    """MXFP4 GEMM ``dequant(qa) @ dequant(qb)``, accumulated in FP32 (between FP8 MMA instructions
    on the default FP8 path; see ``accumulation``).

    Args:
        qa: A, logical ``[M, Kc]``, blocked along axis 1.
        qb: B, logical ``[Kc, N]``, blocked along axis 0 (e.g. ``mx_transpose`` of W quantized
            along K, or a wgrad operand quantized with ``axis=0``).
        out_dtype: float32 or bfloat16.
        backend: ``"auto"`` (FP8 GEMM on CUDA, else reference), ``"triton"`` (the FP8 path; for an
            operand with no exact fold, the BF16 GEMM of :func:`mx_matmul_dequant`) or ``"reference"``.
        accumulation: FP8 path only: ``"fp8-mma"`` (FP8 tensor cores) or ``"fp32"`` (BF16 tensor
            cores, exact FP32-accumulated MXFP4 GEMM). See the module docstring for the accuracy
            of each.

    Returns:
        ``[M, N]`` tensor of ``out_dtype``.

    Raises:
        ValueError: layouts the GEMM cannot take (:func:`check_mm_layout`), an unknown
            ``accumulation``, or (FP8 path) an operand whose row exponent range exceeds 8 without an
            ``fp8`` cache.
    """
    check_mm_layout(qa, qb)
    _check_accumulation(accumulation)
    if resolve_backend(backend, qa.codes.device) == "triton":
        if not (_folds(qa) and _folds(qb)):  # msr-none: no exact FP8 form, exact BF16 operands instead
            return mx_matmul_dequant(qa, qb, out_dtype=out_dtype)
        return mx_matmul_fp8(qa, qb, out_dtype=out_dtype, accumulation=accumulation)
    return mx_matmul_reference(qa, qb, out_dtype=out_dtype)
