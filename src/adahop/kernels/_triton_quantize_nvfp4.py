"""Triton kernels: optional block Hadamard + NVFP4 quantize (+ the GEMM's exact BF16 operand).

Imported lazily (only when the Triton backend runs), so importing `adahop` never needs Triton.

Two launches per operand, as the format needs (the FP32 tensor scale is a function of the whole
tensor): pass 1 reduces the tensor amax (of the finite 1×16 blocks, or 16×16 tiles) into one int32
word by ``atomic_max`` of its bits (non-negative floats order as their bit patterns); pass 2
recomputes each tile's blocks and writes packed E2M1 codes, E4M3 block scales, the tensor scale
and, if asked, ``q · s_block`` as BF16 (exact: `adahop.kernels.nvfp4_matmul`). With a given
``global_scale`` pass 1 is skipped.

A third kernel decodes saved packed NVFP4 into the same BF16 operand (the backward GEMMs').

The quantizer reads a *logical* matrix ``X'[rows, kc]`` through two strides (``axis=1``: ``X' = x``;
``axis=0``: ``X' = xᵀ``), so the transposed operands (Wᵀ, ∇Yᵀ, X along T) are read in place. Every
step repeats `adahop.formats.nvfp4.quantize_nvfp4` operation for operation: FP32 divisions are
``div_rn`` (Triton's ``/`` is an approximate ``div.full.f32`` on NVIDIA GPUs), the E4M3 scale is
rounded by integer arithmetic on its bits (nearest-even, or up under stochastic rounding), E2M1 by
`_triton_quantize._e2m1_round`. So round-to-nearest results equal the reference bit for bit.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._triton_launch import launch, row_geometry
from ._triton_quantize import _e2m1_round, _e2m1_sr, _e2m1_value, _f32, _fwht, _max_propagate_nan

NV_BLOCK = 16
_B = tl.constexpr(NV_BLOCK)  # the block size inside the kernels (a global they read must be a constexpr)


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _e4m3_round(s, UP: tl.constexpr):
    """``s`` (finite, in [0, 448]) rounded onto the E4M3 grid as float32: nearest-even, or up (UP).

    Normal range (s >= 2^-6): keep 3 mantissa bits of the float32 (a carry moves into the
    exponent). Subnormal range: a multiple of 2^-9, rounded by adding and removing 2^23 (the
    float32 spacing there is 1). IEEE arithmetic keeps the add and the subtract (the sm_90 PTX
    fuses ``s · 512 + 2^23`` into one FMA, the same number: the product is exact)."""
    bits = s.to(tl.int32, bitcast=True)
    if UP:
        nb = (bits + 0xFFFFF) & -0x100000
    else:
        nb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    q = s * 512.0  # exact: a power of two
    big = tl.full(s.shape, 150 << 23, tl.int32).to(tl.float32, bitcast=True)  # 2^23
    r = (q + big) - big  # nearest-even integer (q < 8)
    if UP:
        r = r + (r < q).to(tl.float32)
    return tl.where(s >= 0.015625, nb.to(tl.float32, bitcast=True), r * 0.001953125)


@triton.jit
def _e4m3_bits(v):
    """The E4M3 byte of a value already on the grid (``_e4m3_round``), as int32."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)  # biased exponent e + 7
    return tl.where(v >= 0.015625, normal, (v * 512.0).to(tl.int32))


@triton.jit
def _fwht_mid(v, G: tl.constexpr, HB: tl.constexpr, LOG_HB: tl.constexpr, C: tl.constexpr):
    """`_triton_quantize._fwht` along axis 1 of ``v [G, HB, C]``: the same stages, pairs and sums, so
    the same values; the last axis (the rows of the transposing tile) is carried along."""
    pair = tl.arange(0, 2)[None, :, None, None]
    sgn = tl.where(pair == 0, 1.0, -1.0)
    for j in tl.static_range(LOG_HB):
        w = tl.reshape(v, [G * HB // (2 << j), 2, 1 << j, C])
        s = tl.sum(w, axis=1, keep_dims=True)  # a + b
        d = tl.sum(w * sgn, axis=1, keep_dims=True)  # a + (-b) == a - b
        v = tl.reshape(tl.where(pair == 0, s, d), [G, HB, C])
    return v


@triton.jit
def _nv_tile(x_ptr, stride_r, stride_k, r, k0, rows, kc, signs_ptr, keep_ptr,
             BR: tl.constexpr, BK: tl.constexpr, INT64: tl.constexpr, TILE2D: tl.constexpr,
             HB: tl.constexpr, LOG_HB: tl.constexpr, HSCALE: tl.constexpr, HAS_SIGNS: tl.constexpr,
             ZERO_ROWS: tl.constexpr, LAYOUT: tl.constexpr, VEC: tl.constexpr):
    """Tile ``X'[r, k0:k0+BK]`` (zeros outside, H_b-transformed if HB) as fp32 ``[BR, BK/16, 16]``,
    with each block's finite amax (0 where not finite) and non-finite flag ``[BR, BK/16]`` (of its
    16×16 tile under TILE2D: rows ``r`` start at a multiple of 16).

    LAYOUT 0 loads a ``[BR, BK]`` tile. LAYOUT 1 (rows contiguous, the transposing case) loads it
    K-major, ``[BK/16, 16, BR]`` with the rows last and shown in runs of VEC, so that lanes and warps
    go along the rows and each thread holds whole 16-blocks of K: the Hadamard's butterfly then stays
    in registers (with the ``[BR, BK]`` tile it exchanges data between lanes at every stage); a
    permute, which moves no data, gives the ``[BR, BK/16, 16]`` view. Same values either way."""
    NB: tl.constexpr = BK // _B
    if LAYOUT == 1:
        rr = ((r // VEC) * VEC + r % VEC)[None, None, :]  # same values; provable contiguity VEC
        k = (k0 + tl.arange(0, NB)[:, None] * _B + tl.arange(0, _B)[None, :])[:, :, None]
    else:
        rr = r[:, None]
        k = k0 + tl.arange(0, BK)[None, :]
    if INT64:
        offs = rr.to(tl.int64) * stride_r + k.to(tl.int64) * stride_k
    else:
        offs = rr * stride_r + k * stride_k
    v = tl.load(x_ptr + offs, mask=(rr < rows) & (k < kc), other=0.0).to(tl.float32)
    if ZERO_ROWS:  # OE's extracted rows read as zeros (a where: a NaN there is dropped, as index_fill drops it)
        keep = tl.load(keep_ptr + rr, mask=rr < rows, other=1)
        v = tl.where(keep != 0, v, 0.0)
    if HB > 1:  # the same add/sub sequence as kernels.quantize_mxfp4.hadamard_butterfly
        if LAYOUT == 1:
            GK: tl.constexpr = BK // HB
            v = tl.reshape(v, [GK, HB, BR])
            if HAS_SIGNS:
                v = v * tl.load(signs_ptr + tl.arange(0, HB))[None, :, None]
            v = _fwht_mid(v, GK, HB, LOG_HB, BR) * HSCALE
            v = tl.reshape(tl.where(v == 0, 0.0, v), [NB, _B, BR])  # -0 -> +0
        else:
            G: tl.constexpr = BR * BK // HB
            v = tl.reshape(v, [G, HB])
            if HAS_SIGNS:
                v = v * tl.load(signs_ptr + tl.arange(0, HB))[None, :]
            v = _fwht(v, G, HB, LOG_HB) * HSCALE
            v = tl.where(v == 0, 0.0, v)  # -0 -> +0
    if LAYOUT == 1:
        v = tl.permute(v, (2, 0, 1))
    else:
        v = tl.reshape(v, [BR, NB, _B])
    amax = tl.reduce(tl.abs(v), 2, _max_propagate_nan)  # NaN if the block holds one, Inf if an Inf
    if TILE2D:
        t = tl.reduce(tl.reshape(amax, [BR // _B, _B, NB]), 1, _max_propagate_nan)
        amax = tl.reshape(tl.broadcast_to(t[:, None, :], [BR // _B, _B, NB]), [BR, NB])
    bad = (amax != amax) | (amax == float("inf"))
    return v, tl.where(bad, 0.0, amax), bad


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _nv_amax_kernel(x_ptr, stride_r, stride_k, rows, kc, tamax_ptr, signs_ptr, keep_ptr,
                    BR: tl.constexpr, BK: tl.constexpr, INT64: tl.constexpr, TILE2D: tl.constexpr,
                    HB: tl.constexpr, LOG_HB: tl.constexpr, HSCALE: tl.constexpr, HAS_SIGNS: tl.constexpr,
                    ZERO_ROWS: tl.constexpr, LAYOUT: tl.constexpr, VEC: tl.constexpr):
    """Pass 1 of 2: ``tamax`` (int32 [1], zeroed) = max over the tensor of the finite block amaxes, as bits."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    _, amax, _ = _nv_tile(x_ptr, stride_r, stride_k, r, tl.program_id(1) * BK, rows, kc, signs_ptr, keep_ptr, BR, BK,
                          INT64, TILE2D, HB, LOG_HB, HSCALE, HAS_SIGNS, ZERO_ROWS, LAYOUT, VEC)
    tl.atomic_max(tamax_ptr, tl.max(tl.max(amax, axis=1), axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _nv_quantize_kernel(x_ptr, stride_r, stride_k, rows, kc, kp, tamax_ptr, gs_in_ptr,
                        codes_ptr, scales_ptr, gs_ptr, values_ptr, signs_ptr, seed_ptr, keep_ptr,
                        BR: tl.constexpr, BK: tl.constexpr, INT64: tl.constexpr, TILE2D: tl.constexpr,
                        HB: tl.constexpr, LOG_HB: tl.constexpr, HSCALE: tl.constexpr, HAS_SIGNS: tl.constexpr,
                        ZERO_ROWS: tl.constexpr, STOCHASTIC: tl.constexpr, GS_GIVEN: tl.constexpr,
                        WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, LAYOUT: tl.constexpr,
                        VEC: tl.constexpr):
    """Pass 2 of 2: codes ``[rows, kp/2]``, E4M3 scale bytes ``[rows, kp/16]``, the tensor scale
    ``[1]`` and (WRITE_VALUES) BF16 ``q · s_block`` ``[rows, kp]`` of one tile."""
    NB: tl.constexpr = BK // _B
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = pid_r * BR + tl.arange(0, BR)
    if INT64:  # the output offsets too (rows · kp near 2^31)
        r = r.to(tl.int64)
    k0 = pid_k * BK
    v, amax, bad = _nv_tile(x_ptr, stride_r, stride_k, r, k0, rows, kc, signs_ptr, keep_ptr, BR, BK, INT64, TILE2D,
                            HB, LOG_HB, HSCALE, HAS_SIGNS, ZERO_ROWS, LAYOUT, VEC)
    # the tensor scale: t_amax / (448 · 6), 1 for an all-zero tensor, at least 2^-149 (the reference's clamp)
    if GS_GIVEN:
        sg = tl.load(gs_in_ptr)
    else:
        t_amax = tl.load(tamax_ptr).to(tl.float32, bitcast=True)
        sg = tl.where(t_amax > 0, tl.math.div_rn(t_amax, 2688.0), 1.0)
        sg = tl.maximum(sg, tl.full([], 1, tl.int32).to(tl.float32, bitcast=True))
    s_exact = tl.minimum(tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)),
                                        tl.broadcast_to(sg, amax.shape)), 448.0)
    sb = _e4m3_round(s_exact, STOCHASTIC)  # [BR, NB]: rounded up under SR, so nothing clips
    denom = sb * sg
    ok = denom > 0
    dd = tl.broadcast_to(tl.where(ok, denom, 1.0)[:, :, None], [BR, NB, _B])
    s = tl.where(ok[:, :, None], tl.math.div_rn(v, dd), 0.0)  # +0 where the block scale is 0
    a = tl.minimum(tl.abs(s), 8.0)  # anything above 5 rounds to 6 (code 7): keeps the magic-number add in range
    if STOCHASTIC:
        k = k0 + tl.arange(0, NB)[:, None] * _B + tl.arange(0, _B)[None, :]  # [NB, 16]
        u = tl.rand(tl.load(seed_ptr), (r[:, None, None] * kp + k[None, :, :]).to(tl.uint32))
        mag = _e2m1_sr(a, u)
        val = _e2m1_value(mag)
    else:
        val, mag = _e2m1_round(a)
    neg = s.to(tl.int32, bitcast=True) < 0  # the sign bit, kept at magnitude 0 (code 8 = -0), as encode_e2m1
    code = mag | (neg.to(tl.int32) << 3)

    rmask = r < rows
    if WRITE_CODES:
        lo, hi = tl.split(tl.reshape(code, [BR, BK // 2, 2]))  # even index in the low nibble
        kh = k0 // 2 + tl.arange(0, BK // 2)
        tl.store(codes_ptr + r[:, None] * (kp // 2) + kh[None, :], (lo | (hi << 4)).to(tl.uint8),
                 mask=rmask[:, None] & (kh < kp // 2)[None, :])
    nb = k0 // _B + tl.arange(0, NB)
    sbyte = tl.where(bad, 0x7F, _e4m3_bits(sb)).to(tl.uint8)  # 0x7F: E4M3 NaN
    tl.store(scales_ptr + r[:, None] * (kp // _B) + nb[None, :], sbyte,
             mask=rmask[:, None] & (nb < kp // _B)[None, :])
    if WRITE_VALUES:  # q · s_block: at most 6 significant bits in [2^-10, 2688], exact in BF16
        qv = tl.where(neg, -val, val) * sb[:, :, None]
        qv = tl.where(bad[:, :, None], float("nan"), qv)
        kk = k0 + tl.arange(0, BK)
        tl.store(values_ptr + r[:, None] * kp + kk[None, :], tl.reshape(qv, [BR, BK]).to(tl.bfloat16),
                 mask=rmask[:, None] & (kk < kp)[None, :])
    if pid_r == 0 and pid_k == 0:
        tl.store(gs_ptr, sg)


@triton.jit
def _nv_decode_kernel(codes_ptr, scales_ptr, values_ptr, rows, kp, BR: tl.constexpr, BK: tl.constexpr,
                      INT64: tl.constexpr):
    """Saved packed NVFP4 ``[rows, kp]`` (codes, E4M3 scale bytes) -> BF16 ``q · s_block`` (NaN blocks NaN):
    the backward GEMMs' operands, one read of the codes and one write of the values.

    Every element loads its own byte and scale byte (each is read by 2 and 16 neighbours: L1 hits),
    so the tile stays 2-D, and signs are set as bits. The unpack this replaces (join + reshape, signs
    by negation) differed bitwise from the reference in 35-40% of the elements of two large operands
    on an H200 (round 14), not in the interpreter; the cause was not isolated, and a zero's sign is
    one candidate (``docs/kernels_notes.md`` §10)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    if INT64:
        r = r.to(tl.int64)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    m2 = (r < rows)[:, None] & (k < kp)[None, :]
    b = tl.load(codes_ptr + r[:, None] * (kp // 2) + (k // 2)[None, :], mask=m2, other=0).to(tl.int32)
    code = (b >> ((k & 1) * 4)[None, :]) & 15  # even index in the low nibble
    sb = tl.load(scales_ptr + r[:, None] * (kp // _B) + (k // _B)[None, :], mask=m2, other=0).to(tl.int32)
    e, m = (sb >> 3) & 15, sb & 7  # E4M3: 2^(e-7)·(1 + m/8), subnormal m·2^-9; 0x7F/0xFF NaN
    s = tl.where(e > 0, (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True), m.to(tl.float32) * 0.001953125)
    s = tl.where((sb & 0x7F) == 0x7F, float("nan"), s)
    p = _e2m1_value(code & 7) * s  # |q · s_block|, exact (6 significant bits)
    # the sign as a bit, so a zero keeps it (-0 for code 8, or a negative code times a zero scale)
    # whatever the compiler does with a negated zero
    sign = ((code >> 3) ^ (sb >> 7)) & 1
    v = (p.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)
    tl.store(values_ptr + r[:, None] * kp + k[None, :], v.to(tl.bfloat16), mask=m2)


# ----------------------------------------------------------------------------- launcher


def default_plan(rows: int, kp: int, stride_r: int, stride_k: int, hb: int, tile_2d: bool, elem_size: int) -> dict:
    """Tile ``[BR, BK]`` and warps. K contiguous: about 4096 elements per program, BK along K (a
    multiple of 16 and of the Hadamard block), BR a multiple of 16 for 16×16 tiles; 16 elements per
    thread: compiled for sm_90 (Triton 3.9, ptxas from its wheel) the pass-2 kernel then holds ~100
    registers (RNE) / ~140 (SR), against 184 / 255 with a spill at 32 per thread. Rows contiguous
    (the transposing case): :func:`transposing_plan`, which the H200 measured 2.0–16× faster than
    the row tile (:func:`row_tile_plan`) at the same bytes (`docs/benchmarks_history.md#round-15`),
    for no Hadamard or a 16-block one; larger Hadamard blocks keep the row tile until timed."""
    if stride_k == 1 or stride_r != 1:
        bk = max(min(triton.next_power_of_2(kp), 512), NV_BLOCK, hb)
        br = max(1, 4096 // bk)
        if tile_2d:  # whole 16x16 tiles, still about 4096 elements
            br = max(br, NV_BLOCK)
            bk = max(min(bk, 4096 // br), NV_BLOCK, hb)
        return dict(BR=br, BK=bk, num_warps=max(1, min(8, br * bk // 512)), LAYOUT=0, VEC=1)
    if hb > NV_BLOCK:  # 256·hb values per 128 threads (512 each at hb = 256): not timed on a GPU yet
        return row_tile_plan(hb, tile_2d)
    return transposing_plan(elem_size, hb, tile_2d)


def row_tile_plan(hb: int, tile_2d: bool) -> dict:
    """The LAYOUT-0 tile the transposing case had before round 15: 128 rows × 32 of K (or the
    Hadamard block), Triton coalescing along rows. Kept for the bit-exactness tests and the timing
    rows of ``scripts/validate_kernels.py --only nvfp4``."""
    br, bk = 128, max(32, hb)
    if tile_2d:
        bk = max(min(bk, 4096 // br), NV_BLOCK, hb)
    return dict(BR=br, BK=bk, num_warps=max(1, min(8, br * bk // 512)), LAYOUT=0, VEC=1)


def transposing_plan(elem_size: int, hb: int, tile_2d: bool) -> dict:
    """The LAYOUT-1 tile of `_nv_tile` for rows contiguous: ``[BK/16, 16, BR]`` K-major, BK = 16 (or
    the Hadamard block), BR = 32 lanes × VEC × 4 warps (VEC = 2 for 2-byte inputs, else 1), so each
    thread holds VEC rows × whole 16-blocks, and RHT-16 along T needs no warp shuffle (0 against 192
    in the row tile, sm_90 PTX). ``tile_2d`` needs no change: BR is a multiple of 16."""
    vec = 2 if elem_size == 2 else 1
    return dict(BR=32 * vec * 4, BK=max(NV_BLOCK, hb), num_warps=4, LAYOUT=1, VEC=vec)


@functools.lru_cache(maxsize=1024)
def _launch_config(rows, kc, stride_r, stride_k, hb, has_signs, tile_2d, zero_rows, plan_items, elem_size):
    """Everything about a launch that follows from shapes and options (cached: host time matters)."""
    kp = -(-kc // NV_BLOCK) * NV_BLOCK
    p = dict(plan_items) if plan_items else default_plan(rows, kp, stride_r, stride_k, hb, tile_2d, elem_size)
    br, bk = p["BR"], p["BK"]
    vec = p.get("VEC", 1)
    if (bk % NV_BLOCK or (hb and bk % hb) or (tile_2d and br % NV_BLOCK) or bk & (bk - 1) or br & (br - 1)
            or p.get("LAYOUT", 0) not in (0, 1) or vec & (vec - 1) or br % vec):
        raise ValueError(f"nvfp4 quantizer plan {p}: BR, BK must be powers of two, BK a multiple of 16 and of the "
                         f"Hadamard block {hb}, BR of 16 for 16x16 tiles and of VEC (a power of two); LAYOUT 0 or 1")
    common = dict(BR=br, BK=bk, INT64=False, TILE2D=tile_2d, HB=hb, LOG_HB=int(math.log2(hb)) if hb else 0,
                  HSCALE=_f32(1 / math.sqrt(hb)) if hb else 1.0, HAS_SIGNS=has_signs, ZERO_ROWS=zero_rows,
                  num_warps=p["num_warps"], LAYOUT=p.get("LAYOUT", 0), VEC=vec)
    return kp, (triton.cdiv(rows, br), triton.cdiv(kp, bk)), common


def nv_quantize(x: torch.Tensor, axis: int, hadamard_block: int, signs: torch.Tensor | None, stochastic: bool,
                tile_2d: bool, seed: torch.Tensor | None, global_scale: torch.Tensor | None,
                write_codes: bool = True, write_values: bool = False, keep: torch.Tensor | None = None,
                *, plan: dict | None = None, out: tuple | None = None):
    """Launch the NVFP4 quantizer on a 2-D ``x``; arguments as the op :data:`quantize_op`.

    ``hadamard_block`` 0 means no transform; ``global_scale``: a float32 one-element tensor on
    ``x``'s device, or None (derived from the tensor amax). Returns ``(codes uint8 [rows, kp/2]
    (``[rows, 0]`` unless ``write_codes``), scales float8_e4m3fn [rows, kp/16], global_scale float32 [],
    values bfloat16 [rows, kp] (``[rows, 0]`` unless ``write_values``))``. ``keep``: optional uint8
    ``[rows]``, rows where it is 0 quantize as zeros (OE). ``plan`` overrides :func:`default_plan`
    (benchmarks); ``out`` supplies the four output buffers (tests: poisoned ones; scales as uint8,
    the tensor scale as a 0-d float32). Traceable (the body of :data:`quantize_op`).
    """
    rows, kc, stride_r, stride_k = row_geometry(x, axis)
    hb = hadamard_block if hadamard_block > 1 else 0
    kp, grid, common = _launch_config(rows, kc, stride_r, stride_k, hb, signs is not None, tile_2d, keep is not None,
                                      tuple(sorted(plan.items())) if plan else None, x.element_size())
    dev = x.device
    want = [(rows, kp // 2 if write_codes else 0), (rows, kp // NV_BLOCK), (), (rows, kp if write_values else 0)]
    if out is None:
        codes = torch.empty(want[0], dtype=torch.uint8, device=dev)
        scales = torch.empty(want[1], dtype=torch.uint8, device=dev)  # bytes; viewed as E4M3 at the end
        gs = torch.empty((), dtype=torch.float32, device=dev)  # 0-d itself: no view of it to save for backward
        values = torch.empty(want[3], dtype=torch.bfloat16, device=dev)
    else:
        if [tuple(t.shape) for t in out] != want or not all(t.is_contiguous() for t in out):
            raise ValueError(f"nv_quantize: out buffers must be contiguous with shapes {want}")
        codes, scales, gs, values = out
    if max(rows * kp, (rows - 1) * abs(stride_r) + (kc - 1) * abs(stride_k) + 1) >= 2**31 - 2**20:
        common = dict(common, INT64=True)
    signs_arg = signs if signs is not None else x  # never read without HAS_SIGNS
    keep_arg = keep if keep is not None else x  # never read without ZERO_ROWS
    tamax = x  # read only without a given global scale
    if global_scale is None:
        tamax = torch.zeros(1, dtype=torch.int32, device=dev)
        launch(_nv_amax_kernel, grid, ("tamax_ptr",), x_ptr=x, stride_r=stride_r, stride_k=stride_k, rows=rows, kc=kc,
               tamax_ptr=tamax, signs_ptr=signs_arg, keep_ptr=keep_arg, **common)
    launch(_nv_quantize_kernel, grid, ("codes_ptr", "scales_ptr", "gs_ptr", "values_ptr"),
           x_ptr=x, stride_r=stride_r, stride_k=stride_k, rows=rows, kc=kc, kp=kp, tamax_ptr=tamax,
           gs_in_ptr=global_scale if global_scale is not None else x, codes_ptr=codes, scales_ptr=scales, gs_ptr=gs,
           values_ptr=values, signs_ptr=signs_arg, seed_ptr=seed if seed is not None else x, keep_ptr=keep_arg,
           STOCHASTIC=stochastic, GS_GIVEN=global_scale is not None, WRITE_CODES=write_codes,
           WRITE_VALUES=write_values, **common)
    return codes, scales.view(torch.float8_e4m3fn), gs, values


@torch.library.triton_op("adahop::quantize_nvfp4", mutates_args=())
def quantize_op(x: torch.Tensor, axis: int, hadamard_block: int, signs: torch.Tensor | None, stochastic: bool,
                tile_2d: bool, seed: torch.Tensor | None, global_scale: torch.Tensor | None, write_codes: bool = True,
                write_values: bool = False, keep: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The NVFP4 quantizer as a ``triton_op`` (what ``torch.compile`` sees when it traces a layer);
    :func:`nv_quantize` is its body and the eager path."""
    return nv_quantize(x, axis, hadamard_block, signs, stochastic, tile_2d, seed, global_scale, write_codes,
                       write_values, keep)


def nv_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Launch the decode on contiguous ``codes [rows, kp/2]`` (uint8) and ``scales [rows, kp/16]``
    (float8_e4m3fn); returns bfloat16 ``[rows, kp]``. Traceable (the body of :data:`decode_op`)."""
    rows, kp = int(codes.shape[0]), int(codes.shape[1]) * 2
    values = torch.empty(rows, kp, dtype=torch.bfloat16, device=codes.device)
    bk = max(min(triton.next_power_of_2(kp), 512), NV_BLOCK)
    br = max(1, 4096 // bk)
    launch(_nv_decode_kernel, (triton.cdiv(rows, br), triton.cdiv(kp, bk)), ("values_ptr",), codes_ptr=codes,
           scales_ptr=scales.view(torch.uint8), values_ptr=values, rows=rows, kp=kp, BR=br, BK=bk,
           INT64=rows * kp >= 2**31 - 2**20, num_warps=8)
    return values


@torch.library.triton_op("adahop::nvfp4_block_values", mutates_args=())
def decode_op(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The decode as a ``triton_op``; :func:`nv_decode` is its body and the eager path."""
    return nv_decode(codes, scales)
