"""NVFP4 GEMM ``dequant(A) @ dequant(B)`` with FP32 accumulation: reference and BF16 tensor-core twins.

Hopper has no FP4 tensor cores, and an NVFP4 value ``q · s_block · s_global`` does not fold into
FP8 as MXFP4 does (its block scales are E4M3, not powers of two). It folds into BF16 instead:

- ``q`` is E2M1: 0 or ``m · 2^e`` with a significand ``m ∈ {1, 1.5}`` (at most 2 significant
  bits), ``e ∈ [-1, 2]``; ``s_block`` is a finite E4M3 value: 0 or at most 4 significant bits
  (3 mantissa bits; a subnormal has fewer), magnitude in ``[2^-9, 448]``.
- Their product has at most 2 + 4 = 6 significant bits (the product of a 2-bit and a 4-bit
  integer significand is below 2^6) and a magnitude in ``[0.5 · 2^-9, 6 · 448] = [2^-10, 2688]``,
  far inside BF16's normal range ``[2^-126, 3.4e38]``. BF16 has 8 significant bits, so
  ``BF16(q · s_block)`` equals the exact product (``tests/test_nvfp4_matmul.py`` checks all 16
  codes against all 254 finite E4M3 values, bit for bit). NaN scales stay NaN.

So the GEMM is ``s_global(A) · s_global(B) · (V_A @ V_B)`` with ``V = q · s_block`` as BF16
operands multiplied by cuBLAS on the BF16 tensor cores with FP32 accumulation and FP32 output
(``torch.mm(..., out_dtype=torch.float32)``, CUDA only), the two FP32 tensor scales applied after
the sum: the semantics of NVFP4 on Blackwell's FP4 tensor cores (block scales inside the dot
product, the tensor scale as the GEMM's alpha; `specs/baselines.md` §1.7). The only differences
from the FP32 reference are FP32 rounding: the reference rounds each ``q · (s_block · s_global)``
to FP32 and sums in another order. The BF16 GEMM runs at BF16 tensor-core speed, against the
reference's FP32 GEMM on CUDA cores.

Under ``torch.compile`` the product goes through the opaque op ``adahop::fp8_rowwise_mm``
(`adahop.kernels.mx_matmul`, the FP32-accumulation form: ``torch.mm(..., out_dtype=)`` is not
lowered by every Inductor); on the CPU that op's body multiplies the same BF16 values in FP32,
which is exact up to the order of the FP32 sums, and is how the CPU tests run the fast path.
"""

from __future__ import annotations

import torch

from ..device_constants import on_device, tf32_may_round
from ..formats.e2m1 import decode_e2m1
from ..formats.nvfp4 import NVFP4_BLOCK, NVFP4Tensor
from .backend import resolve_backend
from .mx_matmul import _fp8_rowwise_mm, _fp8_rowwise_mm_impl

__all__ = ["nvfp4_matmul", "nvfp4_matmul_reference", "nvfp4_matmul_bf16", "nvfp4_block_values", "nvfp4_kc_sums",
           "check_nvfp4_layout"]


def _make_byte_pairs() -> torch.Tensor:
    """bfloat16 [256, 2]: the two E2M1 values of a packed byte (low nibble first), exact in BF16."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return torch.stack((decode_e2m1(b & 0x0F), decode_e2m1(b >> 4)), dim=-1).to(torch.bfloat16)


with torch.device("cpu"):  # built once, on the CPU, at import (even inside a `with torch.device("meta")` build)
    _BYTE_PAIRS = _make_byte_pairs()


def _byte_pairs(device) -> torch.Tensor:
    """:data:`_BYTE_PAIRS` on ``device``, cached per device (no host-to-device copy inside a CUDA graph)."""
    return on_device(("nvfp4_byte_pairs",), lambda: _BYTE_PAIRS, device)


def _check_operand(q, fn: str, name: str) -> None:
    """Raise ValueError unless ``q`` is a 2-D :class:`NVFP4Tensor` (named ``name`` in ``fn``'s message)."""
    if not isinstance(q, NVFP4Tensor):
        raise ValueError(f"{fn}: {name} must be an NVFP4Tensor, got {type(q).__name__} "
                         "(quantize it with adahop.formats.quantize_nvfp4)")
    if len(q.shape) != 2:
        raise ValueError(f"{fn}: {name} must be 2-D (a GEMM operand), got shape {tuple(q.shape)}")


def check_nvfp4_layout(qa: NVFP4Tensor, qb: NVFP4Tensor) -> tuple[int, int, int]:
    """Check that ``qa``, ``qb`` were prepared for one GEMM ``A·B``; return ``(M, Kc, N)``.

    A is ``[M, Kc]`` blocked along axis 1 (codes ``[M, Kp/2]``, scales ``[M, Kp/16]``), B is
    ``[Kc, N]`` blocked along axis 0 (stored with Kc last: codes ``[N, Kp/2]``, scales
    ``[N, Kp/16]``), ``Kp`` = Kc padded to 16. 2-D tiles (``tile_2d``) store a scale per row
    like 1×16 blocks, so they take the same layout.

    Raises:
        ValueError: naming the operand, what it has and what the GEMM needs.
    """
    for name, q, want in (("qa", qa, 1), ("qb", qb, 0)):
        _check_operand(q, "nvfp4_matmul", name)
        if q.axis != want:
            role = "A [M, Kc] must be blocked along axis=1" if want == 1 else "B [Kc, N] must be blocked along axis=0"
            raise ValueError(f"nvfp4_matmul: {name} is blocked along axis={q.axis}; {role} (the contracted dim): "
                             f"the operands were not prepared for the same GEMM; quantize it with axis={want}")
        if q.block_size != NVFP4_BLOCK:
            raise ValueError(f"nvfp4_matmul: {name} has block_size={q.block_size}; NVFP4 blocks are {NVFP4_BLOCK}")
    (m, kc), (kb, n) = qa.shape, qb.shape
    if kc != kb:
        raise ValueError(f"nvfp4_matmul: contracted dims differ: qa is {qa.shape}, qb is {qb.shape} "
                         "(the operands were not prepared for the same GEMM)")
    kp = -(-kc // NVFP4_BLOCK) * NVFP4_BLOCK
    for name, q, rows in (("qa", qa, m), ("qb", qb, n)):
        codes_cols = 0 if q.codes_dropped and q.values is not None else kp // 2  # values-only: codes [rows, 0]
        if tuple(q.codes.shape) != (rows, codes_cols) or tuple(q.scales.shape) != (rows, kp // NVFP4_BLOCK):
            raise ValueError(f"nvfp4_matmul: {name} codes {tuple(q.codes.shape)} / scales {tuple(q.scales.shape)} do "
                             f"not match shape {q.shape} with axis={q.axis} (want {(rows, codes_cols)} / "
                             f"{(rows, kp // NVFP4_BLOCK)})")
        if q.values is not None and (tuple(q.values.shape) != (rows, kp) or q.values.dtype != torch.bfloat16):
            raise ValueError(f"nvfp4_matmul: {name} values are {q.values.dtype} {tuple(q.values.shape)}; the GEMM "
                             f"operand is bfloat16 {(rows, kp)} (q · s_block, as iht_quantize_nvfp4 writes it)")
        if q.global_scale.numel() != 1:
            raise ValueError(f"nvfp4_matmul: {name} has a tensor scale of shape {tuple(q.global_scale.shape)}; "
                             "NVFP4 has one FP32 scale per tensor")
    if qa.codes.device != qb.codes.device:
        raise ValueError(f"nvfp4_matmul: operands on different devices ({qa.codes.device}, {qb.codes.device})")
    return m, kc, n


def nvfp4_block_values(q: NVFP4Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``q · s_block`` of a 2-D GEMM operand as BF16 ``[rows, Kp]`` (Kc last, zero padding kept): exact.

    Rows are the stored ones (M of A, N of B); the FP32 tensor scale is not applied. Exact
    because every E2M1 value times a finite E4M3 value has at most 6 significant bits and lies
    in [2^-10, 2688] (module docstring); a NaN block scale gives NaN values. BF16 times BF16
    rounds its FP32 product once, and the product is representable, so it is the exact one.
    The quantizer's own ``q.values`` when it wrote them; else built from the codes: by a Triton
    kernel (``backend`` ``"auto"`` on CUDA, or ``"triton"``), or by a table gather and a multiply
    (``"reference"``, the CPU); the same numbers.

    Raises:
        ValueError: ``q`` is not a 2-D :class:`NVFP4Tensor` (an MXTensor's E8M0 scale codes would
            read as wrong numbers), an unknown ``backend``.
    """
    _check_operand(q, "nvfp4_block_values", "q")
    return _block_values(q, backend)


def _block_values(q: NVFP4Tensor, backend: str = "auto") -> torch.Tensor:
    """:func:`nvfp4_block_values` of an operand already checked (the GEMM's and the sums' own check)."""
    if q.values is not None:
        return q.values
    if resolve_backend(backend, q.codes.device) == "triton":
        from . import _triton_quantize_nvfp4 as tq  # lazy: Triton is needed only here

        op = tq.decode_op if torch.compiler.is_dynamo_compiling() else tq.nv_decode
        return op(q.codes.contiguous(), q.scales.contiguous())
    rows, half = q.codes.shape
    pairs = _byte_pairs(q.codes.device)[q.codes.long()]  # [rows, Kp/2, 2] bf16: one gather, no unpack
    v = pairs.reshape(rows, -1, NVFP4_BLOCK) * q.scales.to(torch.bfloat16).unsqueeze(-1)  # E4M3 -> BF16 is exact
    return v.reshape(rows, 2 * half)


def nvfp4_kc_sums(q: NVFP4Tensor) -> torch.Tensor:
    """The sums of a 2-D operand's dequantized values along its contracted dim, float32 ``[rows]``:
    ``dequant(A) @ 1`` for A (``[M]``), ``1ᵀ @ dequant(B)`` for B (``[N]``).

    Equal to ``q.dequantize().sum(dim=Kc)`` to FP32 rounding: the exact BF16 values
    (:func:`nvfp4_block_values`) summed in FP32, then times the tensor scale. Averis's cross
    terms (`adahop.gemm.multiply`) read it.

    Raises:
        ValueError: ``q`` is not a 2-D :class:`NVFP4Tensor`.
    """
    _check_operand(q, "nvfp4_kc_sums", "q")
    return _block_values(q).sum(dim=-1, dtype=torch.float32) * q.global_scale


def nvfp4_matmul_reference(qa: NVFP4Tensor, qb: NVFP4Tensor, *, out_dtype: torch.dtype = torch.float32,
                           backend: str = "reference") -> torch.Tensor:
    """Emulated NVFP4 GEMM: ``qa.dequantize() @ qb.dequantize()`` in FP32, cast to ``out_dtype``.

    Checks the same layouts as the fast path (:func:`check_nvfp4_layout`). On CUDA with TF32 matmuls
    enabled it multiplies in float64 instead, so the reference never drops to TF32.
    """
    check_nvfp4_layout(qa, qb)
    a, b = qa.dequantize(torch.float32), qb.dequantize(torch.float32)  # [M, Kc], [Kc, N]
    if tf32_may_round(a):
        return (a.double() @ b.double()).to(out_dtype)
    return (a @ b).to(out_dtype)


def nvfp4_matmul_bf16(qa: NVFP4Tensor, qb: NVFP4Tensor, *, out_dtype: torch.dtype = torch.float32,
                      backend: str = "triton") -> torch.Tensor:
    """Fast path of :func:`nvfp4_matmul`: exact BF16 operands ``q · s_block``, one BF16 GEMM with FP32
    accumulation and output (cuBLAS), then the two FP32 tensor scales (module docstring).

    On the CPU the final product is the FP32 product of the same BF16 values (there is no CPU
    BF16 GEMM with FP32 output): the emulation the CPU tests run.
    """
    check_nvfp4_layout(qa, qb)
    va, vb = _block_values(qa), _block_values(qb)  # [M, Kp], [N, Kp] bf16, Kc contiguous
    sa, sb = qa.global_scale.reshape(1), qb.global_scale.reshape(1)  # broadcast as the op's per-row scales
    op = _fp8_rowwise_mm if torch.compiler.is_dynamo_compiling() else _fp8_rowwise_mm_impl
    return op(va, sa, vb, sb, out_dtype, True)


def nvfp4_matmul(qa: NVFP4Tensor, qb: NVFP4Tensor, *, out_dtype: torch.dtype = torch.float32,
                 backend: str = "auto") -> torch.Tensor:
    """NVFP4 GEMM ``dequant(qa) @ dequant(qb)`` with FP32 accumulation.

    Args:
        qa: A, logical ``[M, Kc]``, quantized along axis 1 (:func:`adahop.formats.quantize_nvfp4`).
        qb: B, logical ``[Kc, N]``, quantized along axis 0 (1×16 blocks or 16×16 tiles).
        out_dtype: the result's floating dtype (float32, bfloat16; float64 for a model moved to float64).
        backend: ``"auto"`` (the BF16 tensor-core path on CUDA, else the reference), ``"triton"``
            (the fast path; the name is shared by every op of `adahop.kernels`: see
            :func:`~adahop.kernels.resolve_backend`) or ``"reference"``.

    Returns:
        ``[M, N]`` tensor of ``out_dtype``; equal to the reference to FP32 rounding (relative
        error ≤ 1e-5, `scripts/validate_kernels.py`).

    Raises:
        ValueError: operands not prepared for the same GEMM (:func:`check_nvfp4_layout`), an
            unknown ``backend``.
    """
    check_nvfp4_layout(qa, qb)
    if resolve_backend(backend, qa.codes.device) == "triton":
        return nvfp4_matmul_bf16(qa, qb, out_dtype=out_dtype)
    return nvfp4_matmul_reference(qa, qb, out_dtype=out_dtype)
