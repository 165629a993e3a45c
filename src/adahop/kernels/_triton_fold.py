"""Triton kernel: unpack packed MXFP4 (codes + E8M0 scales) straight into the FP8 E4M3 fold.

The backward GEMMs read X and W from their saved packed MXFP4 (4.25 bits/element); this kernel
turns them into the operand the FP8 GEMM takes, with one read of the codes and scales and one
write of the FP8 bytes (`DESIGN.md` §3, issue #6 item 4). Same result as
:func:`adahop.kernels.fold.fold_to_fp8_reference`, byte for byte. Imported lazily.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._triton_launch import launch
from ._triton_quantize import _e2m1_value, _exp2i


@triton.jit
def _fold_kernel(codes_ptr, scales_ptr, fp8_ptr, rscale_ptr, rows, kp,
                 BR: tl.constexpr, NBP: tl.constexpr, BK: tl.constexpr, NCHUNK: tl.constexpr,
                 MASK: tl.constexpr, ELEM_SCALE: tl.constexpr):
    """Rows ``r`` of a ``[rows, kp]`` MXFP4 tensor: row exponent E, then ``q·2^(e−E)`` tile by tile.
    Program (i, j) folds rows ``i·BR…`` over ``NCHUNK`` tiles from ``j·NCHUNK·BK``: each program reads
    its rows' scales whole (kp/32 bytes a row) for E, so a row split over programs folds the same bytes."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = pid * BR + tl.arange(0, BR)
    rmask = r < rows
    nb = kp // 32
    j = tl.arange(0, NBP)
    s_all = tl.load(scales_ptr + r[:, None] * nb + j[None, :], mask=rmask[:, None] & (j < nb)[None, :], other=0)
    s_all = s_all.to(tl.int32)
    row_e = tl.max(tl.where(s_all == 255, -127, s_all - 127), axis=1)  # largest finite block exponent
    NB: tl.constexpr = BK // 32
    for c in range(NCHUNK):
        k0 = (pid_k * NCHUNK + c) * BK
        bi = k0 // 32 + tl.arange(0, NB)  # block index [NB]
        byte = k0 // 2 + tl.arange(0, NB)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [NB, 16]
        k = k0 + tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]  # element index [NB, 32]
        if MASK:
            b = tl.load(codes_ptr + r[:, None, None] * (kp // 2) + byte[None, :, :],
                        mask=rmask[:, None, None] & (byte < kp // 2)[None, :, :], other=0)
            sc = tl.load(scales_ptr + r[:, None] * nb + bi[None, :], mask=rmask[:, None] & (bi < nb)[None, :], other=0)
        else:
            b = tl.load(codes_ptr + r[:, None, None] * (kp // 2) + byte[None, :, :])
            sc = tl.load(scales_ptr + r[:, None] * nb + bi[None, :])
        b = b.to(tl.int32)
        code = tl.reshape(tl.join(b & 15, b >> 4), [BR, NB, 32])  # even index in the low nibble
        sc = sc.to(tl.int32)
        bad = sc == 255
        # blocks more than 8 below the row hold only zeros (the quantizer's max_scale_range=8)
        shift = tl.minimum(row_e[:, None] - tl.where(bad, row_e[:, None], sc - 127), 8)
        mag = _e2m1_value(code & 7) * _exp2i(-shift)[:, :, None]  # exact in E4M3
        # the sign as a bit, of nonzero magnitudes only: a -0 code (0x8) folds to +0, as in the reference table
        sign = tl.where((code & 7) != 0, (code & 8) << 4, 0).to(tl.uint8)
        bits = mag.to(tl.float8e4nv).to(tl.uint8, bitcast=True) | sign
        bits = tl.where(bad[:, :, None], 0x7F, bits)  # 0x7F: NaN
        fptr = fp8_ptr + r[:, None, None] * kp + k[None, :, :]
        if MASK:
            tl.store(fptr, bits, mask=rmask[:, None, None] & (k < kp)[None, :, :])
        else:
            tl.store(fptr, bits)
    if pid_k == 0:
        rs = _exp2i(row_e)
        if ELEM_SCALE != 1.0:
            rs = rs * ELEM_SCALE
        tl.store(rscale_ptr + r, rs, mask=rmask)


def default_config(rows: int, kp: int) -> dict:
    """Tiles of the fold: ``BR`` rows × ``BK`` elements, ``NCHUNK`` tiles per program, ``num_warps``."""
    bk = min(triton.next_power_of_2(kp), 2048)
    return dict(BR=max(1, 8192 // bk), BK=bk, NCHUNK=triton.cdiv(kp, bk), num_warps=4)


@functools.lru_cache(maxsize=256)
def _config(rows: int, kp: int, items: tuple | None = None) -> tuple:
    c = dict(items) if items else default_config(rows, kp)
    br, bk, nchunk = c["BR"], c["BK"], c["NCHUNK"]
    mask = rows % br != 0 or kp % (bk * nchunk) != 0
    return (triton.cdiv(rows, br), triton.cdiv(kp, bk * nchunk)), dict(
        BR=br, NBP=triton.next_power_of_2(max(kp // 32, 1)), BK=bk, NCHUNK=nchunk, MASK=mask, num_warps=c["num_warps"])


def fold(codes: torch.Tensor, scales: torch.Tensor, elem_scale: float, *,
         config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fold on contiguous ``codes [rows, kp/2]`` and ``scales [rows, kp/32]`` (uint8).

    Returns ``(fp8 [rows, kp] float8_e4m3fn, row_scale [rows] float32)``. ``elem_scale`` is the
    float32 value the row scale is multiplied by (4/3 for the ``tseng`` rule, else 1). Traceable
    (the body of :data:`fold_op`). ``config`` overrides :func:`default_config` (benchmarks, tests).
    """
    rows, kp = int(codes.shape[0]), int(codes.shape[1]) * 2
    fp8 = torch.empty(rows, kp, dtype=torch.uint8, device=codes.device)
    rscale = torch.empty(rows, dtype=torch.float32, device=codes.device)
    if rows and kp:
        grid, meta = _config(rows, kp, tuple(sorted(config.items())) if config else None)
        launch(_fold_kernel, grid, ("fp8_ptr", "rscale_ptr"), codes_ptr=codes, scales_ptr=scales, fp8_ptr=fp8,
               rscale_ptr=rscale, rows=rows, kp=kp, ELEM_SCALE=elem_scale, **meta)
    elif rows:
        rscale.fill_(2.0**-127 * elem_scale)
    return fp8.view(torch.float8_e4m3fn), rscale


@torch.library.triton_op("adahop::fold_mxfp4_to_fp8", mutates_args=())
def fold_op(codes: torch.Tensor, scales: torch.Tensor, elem_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold as a ``triton_op`` (what ``torch.compile`` sees); :func:`fold` is its body and the eager path."""
    return fold(codes, scales, elem_scale)
