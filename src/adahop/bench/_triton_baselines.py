"""Triton kernels of the two MXFP4 emulations that `adahop bench linear` compares the fast path with.

Not used by any recipe. Both read MXFP4 as the quantizer stores it (packed E2M1 codes
``[rows, kp/2]`` uint8, even index in the low nibble; E8M0 scales ``[rows, kp/32]`` uint8):

- :func:`dequant_bf16`: MXFP4 → BF16, the cast of the torchao-style emulation (dequantize both
  operands, then a BF16 GEMM);
- :func:`dot_scaled_mm`: ``tl.dot_scaled`` with e2m1 operands (Triton's MXFP4 GEMM; on Hopper it
  upcasts inside the kernel).

Imported lazily (needs Triton). Shapes must be multiples of 128 (no masks): the Llama shapes are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dequant_bf16", "dot_scaled_mm"]


@triton.jit
def _dequant_bf16_kernel(codes_ptr, scales_ptr, out_ptr, rows, KP, BR: tl.constexpr, BK: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    kh = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (r[:, None] < rows) & (k < KP)[None, :]
    byte = tl.load(codes_ptr + r[:, None].to(tl.int64) * (KP // 2) + kh[None, :],
                   mask=(r[:, None] < rows) & (kh < KP // 2)[None, :], other=0).to(tl.int32)
    c = tl.reshape(tl.join(byte & 15, byte >> 4), [BR, BK])  # even index in the low nibble
    mag = c & 7
    v = tl.where(mag == 5, 3.0, tl.where(mag == 6, 4.0, tl.where(mag == 7, 6.0, mag.to(tl.float32) * 0.5)))
    v = tl.where((c & 8) != 0, -v, v)
    sc = tl.load(scales_ptr + r[:, None].to(tl.int64) * (KP // 32) + (k // 32)[None, :], mask=m, other=127)
    v = v * ((sc.to(tl.int32) << 23).to(tl.float32, bitcast=True))  # 2^(s-127); s = 0 (2^-127) and 255 (NaN) not kept
    tl.store(out_ptr + r[:, None].to(tl.int64) * KP + k[None, :], v.to(tl.bfloat16), mask=m)


def dequant_bf16(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``codes`` [rows, kp/2] uint8 (packed E2M1), ``scales`` [rows, kp/32] uint8 (E8M0) → bfloat16
    [rows, kp] (the OCP MX decode, `specs/baselines.md`; E8M0 0 and 255 are not kept). CUDA or the
    Triton interpreter; raises what Triton raises for other devices."""
    rows, kp = codes.shape[0], codes.shape[1] * 2
    out = torch.empty(rows, kp, dtype=torch.bfloat16, device=codes.device)
    _dequant_bf16_kernel[(triton.cdiv(rows, 32), triton.cdiv(kp, 128))](codes, scales, out, rows, kp, BR=32, BK=128)
    return out


@triton.jit
def _dot_scaled_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, KP: tl.constexpr,  # constexpr: the interpreter's loop bound
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    first_m = (pid // (GROUP * n_n)) * GROUP  # GROUP row tiles share their B tiles in L2
    size = tl.minimum(n_m - first_m, GROUP)  # the last group may be shorter (M/BM not a multiple of GROUP)
    pid_m = first_m + (pid % (GROUP * n_n)) % size
    pid_n = (pid % (GROUP * n_n)) // size
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, KP, BK):
        kk = k // 2 + tl.arange(0, BK // 2)
        ks = k // 32 + tl.arange(0, BK // 32)
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * (KP // 2) + kk[None, :])
        b = tl.load(b_ptr + rn[None, :].to(tl.int64) * (KP // 2) + kk[:, None])
        sa = tl.load(as_ptr + rm[:, None].to(tl.int64) * (KP // 32) + ks[None, :])
        sb = tl.load(bs_ptr + rn[:, None].to(tl.int64) * (KP // 32) + ks[None, :])
        acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(c_ptr.dtype.element_ty))


def dot_scaled_mm(a_codes: torch.Tensor, a_scales: torch.Tensor, b_codes: torch.Tensor, b_scales: torch.Tensor,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``C = A·Bᵀ`` [M, N] in ``out_dtype``, FP32 accumulation, for MXFP4 A [M, kp] and B [N, kp], both
    blocked along kp (the contracted dimension) and stored as the quantizer writes them (codes
    [rows, kp/2] uint8, E8M0 scales [rows, kp/32] uint8). The `tl.dot_scaled` baseline of `DESIGN.md` §4.

    Raises:
        ValueError: M, N or kp not a multiple of 128, or A and B of different kp."""
    m, n, kp = a_codes.shape[0], b_codes.shape[0], a_codes.shape[1] * 2
    if m % 128 or n % 128 or kp % 128 or b_codes.shape[1] * 2 != kp:
        raise ValueError(f"dot_scaled_mm: needs M, N, kp multiples of 128 and equal kp; got M={m}, N={n}, "
                         f"kp={kp} and {b_codes.shape[1] * 2}")
    c = torch.empty(m, n, dtype=out_dtype, device=a_codes.device)
    grid = (triton.cdiv(m, 128) * triton.cdiv(n, 128),)
    _dot_scaled_kernel[grid](a_codes, a_scales, b_codes, b_scales, c, m, n, kp,
                             BM=128, BN=128, BK=128, GROUP=8, num_warps=8, num_stages=3)
    return c
