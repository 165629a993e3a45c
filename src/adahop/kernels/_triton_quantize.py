"""Triton kernels: fused block Hadamard + MXFP4 quantize + FP8 fold.

Imported lazily (only when the Triton backend runs), so importing `adahop` never needs Triton.

The kernels read a *logical* matrix ``X'[rows, kc]`` through two strides, so one kernel serves
``axis=1`` (``X' = x``) and ``axis=0`` (``X' = xᵀ``: read row-coalesced, written transposed; Triton
moves the outputs through shared memory). For every output row (one row of ``X'``):

1. load 32-blocks so that each thread holds whole blocks (see :func:`_load_blocks`), in fp32;
   apply ``H_b`` along ``kc`` as the same add/sub sequence as
   :func:`adahop.kernels.quantize_mxfp4.hadamard_butterfly`, so the twins agree bit for bit;
2. per 32-block: amax, a non-finite flag, the E8M0 exponent (bit arithmetic, the same function
   of amax as `formats.mxfp4.block_exponents`);
3. the row maximum exponent ``E`` (= the rule applied to the row's largest finite block amax,
   since every rule is monotone in amax): in the program when it owns whole rows (K
   contiguous), else from the per-tile amaxes of a first kernel (the transposing case);
4. clamp exponents to ``>= E - max_scale_range``, round to E2M1 (nearest-even by a magic-number
   add, or stochastic), write packed codes, E8M0 scales, the FP8 E4M3 fold ``q·2^(e-E)`` and the
   row scale ``2^E``.

Design notes and H200 timings: `docs/kernels_notes.md`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import triton
import triton.language as tl

from ..formats.mxfp4 import folds_exactly
from ._triton_launch import launch, row_geometry

RULE_IDS = {"floor": 0, "rceil": 1, "adahop": 2, "tseng": 3}
#: K-tiles of pass 1's amaxes the transposing quantizer reads per loop step (a fixed width, so the
#: kernel does not specialize on each shape's tile count)
PAMAX_CHUNK = tl.constexpr(64)


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _exp2i(p):
    """Exact 2^p in fp32 for int32 p in [-149, 127] (subnormals included)."""
    normal = ((p + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(p + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(p >= -126, normal, sub)


@triton.jit
def _block_exp(amax, RULE: tl.constexpr):
    """E8M0 exponent from a finite amax >= 0 (int32), as `formats.mxfp4.block_exponents`."""
    bits = amax.to(tl.int32, bitcast=True)
    f = ((bits >> 23) & 0xFF) - 127  # floor(log2 amax) for normals; subnormals end clamped below
    mant = bits & 0x7FFFFF
    e = f - 2
    if RULE == 1:  # rceil: + [m > 1.5]
        e = e + (mant > 0x400000).to(tl.int32)
    if RULE == 2:  # adahop: + [m >= 1.75], at least -126, a zero block too (code 1, as the official encoder)
        e = tl.maximum(e + (mant >= 0x600000).to(tl.int32), -126)
        e = tl.where(amax > 0, e, -126)
    else:
        e = tl.where(amax > 0, e, -127)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _e2m1_value(mag):
    """E2M1 magnitude of code 0..7: 0, .5, 1, 1.5, 2, 3, 4, 6."""
    v = mag.to(tl.float32) * 0.5
    return tl.where(mag == 5, 3.0, tl.where(mag == 6, 4.0, tl.where(mag == 7, 6.0, v)))


@triton.jit
def _e2m1_round(a):
    """Round a >= 0 (finite) half-to-even onto the E2M1 grid, saturating at 6: (value, code 0..7).

    Same results as the interval table of `formats.e2m1`, in a few instructions: adding then
    subtracting ``M = 1.5·2^(23+s)`` rounds to a multiple of the grid spacing ``2^s`` (0.5 below
    2, 1 on [2, 4), 2 on [4, 8)), and ties go to the even multiple, which is the even code.
    """
    ef = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127)  # binade of a, at least [1, 2)
    mbits = ((ef + 22) << 23) | 0x400000
    t = a + mbits.to(tl.float32, bitcast=True)  # t's low mantissa bits = a / spacing, rounded
    val = tl.minimum(t - mbits.to(tl.float32, bitcast=True), 6.0)
    code = tl.minimum(t.to(tl.int32, bitcast=True) - mbits + 2 * (ef - 127), 7)  # + 2 per binade above [1, 2)
    return val, code


@triton.jit
def _e2m1_sr(a, u):
    """Code 0..7 of |v| rounded stochastically: up with probability (a - lo) / (hi - lo)."""
    a = tl.minimum(a, 6.0)
    lo = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
    lo += (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
    lo += (a >= 6.0).to(tl.int32)
    width = tl.where(lo < 4, 0.5, tl.where(lo < 6, 1.0, 2.0))
    p_up = (a - _e2m1_value(lo)) / width
    return lo + ((u < p_up) & (lo < 7)).to(tl.int32)


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fwht(v, G: tl.constexpr, HB: tl.constexpr, LOG_HB: tl.constexpr):
    """Unnormalized Walsh-Hadamard of each row of v [G, HB], bit 0 first.

    Stage j pairs i (bit j clear) with i + 2^j: (a, b) -> (a + b, a - b). Written as a sum over a
    size-2 axis so the data never changes layout; the values equal the Pease butterfly's.
    """
    pair = tl.arange(0, 2)[None, :, None]
    sgn = tl.where(pair == 0, 1.0, -1.0)
    for j in tl.static_range(LOG_HB):
        w = tl.reshape(v, [G * HB // (2 << j), 2, 1 << j])
        s = tl.sum(w, axis=1, keep_dims=True)  # a + b
        d = tl.sum(w * sgn, axis=1, keep_dims=True)  # a + (-b) == a - b
        v = tl.reshape(tl.where(pair == 0, s, d), [G, HB])
    return v


@triton.jit
def _load_blocks(x_ptr, stride_r, stride_k, r, k0, rows, kc, signs_ptr, keep_ptr,
                 BR: tl.constexpr, BK: tl.constexpr, LAYOUT: tl.constexpr, VEC: tl.constexpr,
                 MASK_R: tl.constexpr, MASK_K: tl.constexpr, INT64: tl.constexpr,
                 HB: tl.constexpr, LOG_HB: tl.constexpr, HSCALE: tl.constexpr, HAS_SIGNS: tl.constexpr,
                 ZERO_ROWS: tl.constexpr):
    """Tile ``X'[r, k0:k0+BK]`` as H_b-transformed fp32 ``[BR, BK/32, 32]``, with block amax and
    non-finite flags ``[BR, BK/32]``.

    The index shapes steer Triton's layout so that every thread holds whole 32-blocks: the
    butterfly, amax and encoding never leave a thread. LAYOUT 0 (K contiguous): a
    ``[BR, NB, 32/VEC, VEC]`` tile of VEC-element (16-byte) vectors; Triton orders the dims it cannot
    tell apart by index, so lanes go across rows and blocks and the 32/VEC vectors of a block stay
    in one thread. LAYOUT 1 (rows contiguous, the transposing case):
    rows vectorized VEC at a time (the index arithmetic hides longer runs), lanes across rows.
    ZERO_ROWS: rows whose ``keep`` byte is 0 read as zeros (OE's extracted rows; a where, not a
    multiply, so a NaN there is dropped as ``index_fill`` drops it).
    """
    NB: tl.constexpr = BK // 32
    if LAYOUT == 0:
        rr = r[:, None, None, None]
        k = (k0 + tl.arange(0, NB)[None, :, None, None] * 32 + tl.arange(0, 32 // VEC)[None, None, :, None] * VEC
             + tl.arange(0, VEC)[None, None, None, :])
    else:
        rr = ((r // VEC) * VEC + r % VEC)[:, None, None]  # same values; provable contiguity VEC
        k = (k0 + tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :])[None, :, :]
    if INT64:
        offs = rr.to(tl.int64) * stride_r + k.to(tl.int64) * stride_k
    else:
        offs = rr * stride_r + k * stride_k
    if MASK_R or MASK_K:
        v = tl.load(x_ptr + offs, mask=(rr < rows) & (k < kc), other=0.0)
    else:
        v = tl.load(x_ptr + offs)
    v = v.to(tl.float32)
    if ZERO_ROWS:
        keep = tl.load(keep_ptr + rr, mask=rr < rows, other=1)
        v = tl.where(keep != 0, v, 0.0)
    if LAYOUT == 0:
        v = tl.reshape(v, [BR, NB, 32])
    if HB > 1:
        G: tl.constexpr = BR * BK // HB
        v = tl.reshape(v, [G, HB])
        if HAS_SIGNS:
            v = v * tl.load(signs_ptr + tl.arange(0, HB))[None, :]
        v = _fwht(v, G, HB, LOG_HB) * HSCALE
        v = tl.reshape(tl.where(v == 0, 0.0, v), [BR, NB, 32])  # -0 -> +0, as hadamard_butterfly
    amax = tl.reduce(tl.abs(v), 2, _max_propagate_nan)  # NaN if the block holds one, Inf if an Inf
    bad = (amax != amax) | (amax == float("inf"))
    return v, tl.where(bad, 0.0, amax), bad


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _mx_amax_kernel(x_ptr, stride_r, stride_k, rows, kc, pamax_ptr, n_kt, signs_ptr, keep_ptr,
                    BR: tl.constexpr, BK: tl.constexpr, LAYOUT: tl.constexpr, VEC: tl.constexpr,
                    MASK_R: tl.constexpr, MASK_K: tl.constexpr, INT64: tl.constexpr,
                    HB: tl.constexpr, LOG_HB: tl.constexpr, HSCALE: tl.constexpr, HAS_SIGNS: tl.constexpr,
                    ZERO_ROWS: tl.constexpr):
    """Pass 1 of 2: the largest finite-block amax of each (row, K-tile) -> pamax [rows, n_kt]."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = pid_r * BR + tl.arange(0, BR)
    _, amax, _ = _load_blocks(x_ptr, stride_r, stride_k, r, pid_k * BK, rows, kc, signs_ptr, keep_ptr, BR, BK, LAYOUT,
                              VEC, MASK_R, MASK_K, INT64, HB, LOG_HB, HSCALE, HAS_SIGNS, ZERO_ROWS)
    tl.store(pamax_ptr + r * n_kt + pid_k, tl.max(amax, axis=1), mask=r < rows)


@triton.jit
def _mx_quantize_kernel(x_ptr, stride_r, stride_k, rows, kc, kp,
                        codes_ptr, scales_ptr, fp8_ptr, rscale_ptr, pamax_ptr, n_kt, signs_ptr, seed_ptr, keep_ptr,
                        BR: tl.constexpr, BK: tl.constexpr, NCHUNK: tl.constexpr,
                        LAYOUT: tl.constexpr, VEC: tl.constexpr, MASK_R: tl.constexpr, MASK_K: tl.constexpr,
                        INT64: tl.constexpr,
                        HB: tl.constexpr, LOG_HB: tl.constexpr, HSCALE: tl.constexpr, HAS_SIGNS: tl.constexpr,
                        RULE: tl.constexpr, STOCHASTIC: tl.constexpr, MSR: tl.constexpr, ROW_SRC: tl.constexpr,
                        WRITE_CODES: tl.constexpr, WRITE_FP8: tl.constexpr, ELEM_SCALE: tl.constexpr,
                        ZERO_ROWS: tl.constexpr):
    """Quantize rows ``X'[r]`` over ``NCHUNK`` K-tiles of BK to packed E2M1 codes, E8M0 scales and FP8.

    ROW_SRC: 0 no row maximum; 1 from this program's own tiles (it owns whole rows: one tile, or a
    first loop over its tiles whose re-read hits L2); 2 from pass 1's per-tile amaxes.
    WRITE_CODES / WRITE_FP8: which of the two forms to store (E8M0 scales are always stored): an
    operand the GEMM consumes at once needs only the FP8 fold, one saved for backward only codes.
    """
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = pid_r * BR + tl.arange(0, BR)
    rmask = r < rows
    row_amax = tl.zeros([BR], dtype=tl.float32)
    if ROW_SRC == 2:  # a runtime loop over pass 1's amaxes: one compiled kernel for every K (cold compile, issue 18)
        # elementwise max across chunks, one reduction after the loop: a reduction inside the loop
        # breaks Triton 3.6's TritonGPUOptimizeThreadLocality pass (compile failure on sm_90)
        pa_max = tl.zeros([BR, PAMAX_CHUNK], dtype=tl.float32)
        for t0 in range(0, n_kt, PAMAX_CHUNK):
            t = t0 + tl.arange(0, PAMAX_CHUNK)
            pa = tl.load(pamax_ptr + r[:, None] * n_kt + t[None, :], mask=rmask[:, None] & (t < n_kt)[None, :], other=0.0)
            pa_max = tl.maximum(pa_max, pa)
        row_amax = tl.max(pa_max, axis=1)  # amaxes are >= 0 and masked lanes 0: the max of maxes is exact
    if ROW_SRC == 1 and NCHUNK > 1:
        for c in range(NCHUNK):
            _, amax, _ = _load_blocks(x_ptr, stride_r, stride_k, r, c * BK, rows, kc, signs_ptr, keep_ptr, BR, BK, LAYOUT,
                                      VEC, MASK_R, MASK_K, INT64, HB, LOG_HB, HSCALE, HAS_SIGNS, ZERO_ROWS)
            row_amax = tl.maximum(row_amax, tl.max(amax, axis=1))
    for c in range(NCHUNK):
        k0 = (pid_k * NCHUNK + c) * BK
        vb, amax, bad = _load_blocks(x_ptr, stride_r, stride_k, r, k0, rows, kc, signs_ptr, keep_ptr, BR, BK, LAYOUT,
                                     VEC, MASK_R, MASK_K, INT64, HB, LOG_HB, HSCALE, HAS_SIGNS, ZERO_ROWS)
        if ROW_SRC == 1 and NCHUNK == 1:
            row_amax = tl.max(amax, axis=1)
        e = _block_exp(amax, RULE)  # [BR, NB]
        row_e = _block_exp(row_amax, RULE)  # [BR]: the row's largest finite block exponent
        if MSR >= 0:
            e = tl.maximum(e, row_e[:, None] - MSR)

        s = vb * _exp2i(-tl.where(bad, 0, e))[:, :, None]  # exact: e <= 126, so 2^-e is a normal power of two
        if RULE == 3:
            s = s * 0.75
        a = tl.abs(s)
        if STOCHASTIC:
            # one Philox call per 4 elements: counter = element index // 4
            k4 = k0 // 4 + tl.arange(0, BK // 32)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NB, 8]
            u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr), (r[:, None, None] * (kp // 4) + k4[None, :, :]).to(tl.uint32))
            u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [BR, BK // 32, 32])
            mag = _e2m1_sr(a, u)
            val = _e2m1_value(mag)
        else:
            val, mag = _e2m1_round(a)
        neg = s.to(tl.int32, bitcast=True) < 0  # the sign bit, kept at magnitude 0 too (code 8 = -0)
        code = tl.where(bad[:, :, None], 0, mag | (neg.to(tl.int32) << 3))  # [BR, NB, 32]

        kb = k0 + tl.arange(0, BK // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]  # [NB, 32]
        row_ok = rmask[:, None, None]
        lo, hi = tl.split(tl.reshape(code, [BR, BK // 32, 16, 2]))  # even index in the low nibble
        kh = k0 // 2 + tl.arange(0, BK // 32)[:, None] * 16 + tl.arange(0, 16)[None, :]  # byte index [NB, 16]
        cptr = codes_ptr + r[:, None, None] * (kp // 2) + kh[None, :, :]
        nb = k0 // 32 + tl.arange(0, BK // 32)
        sptr = scales_ptr + r[:, None] * (kp // 32) + nb[None, :]
        sval = tl.where(bad, 255, e + 127).to(tl.uint8)
        if MASK_R or MASK_K:
            if WRITE_CODES:
                tl.store(cptr, (lo | (hi << 4)).to(tl.uint8), mask=row_ok & (kh < kp // 2)[None, :, :])
            tl.store(sptr, sval, mask=rmask[:, None] & (nb < kp // 32)[None, :])
        else:
            if WRITE_CODES:
                tl.store(cptr, (lo | (hi << 4)).to(tl.uint8))
            tl.store(sptr, sval)

        if WRITE_FP8:  # q · 2^(e - E), exact in E4M3 because e - E is in [-8, 0]
            # a code-8 (-0) element folds to +0, as the reference table has it: a GEMM operand, where
            # the sign of a zero is no number. The sign comes from a float where() on nonzero
            # magnitudes only, the round-6 form: negating 0.0, or OR-ing the sign as a bit, gave wrong
            # bytes in some tiles on the H200 (Triton 3.6, round 7)
            f = tl.where(neg & (mag > 0), -val, val) * _exp2i(e - row_e[:, None])[:, :, None]
            bits = tl.where(bad[:, :, None], 0x7F, f.to(tl.float8e4nv).to(tl.uint8, bitcast=True))  # 0x7F: NaN
            fptr = fp8_ptr + r[:, None, None] * kp + kb[None, :, :]
            if MASK_R or MASK_K:
                tl.store(fptr, bits, mask=row_ok & (kb < kp)[None, :, :])
            else:
                tl.store(fptr, bits)
            if pid_k == 0 and c == 0:
                rs = _exp2i(row_e)
                if ELEM_SCALE != 1.0:
                    rs = rs * ELEM_SCALE
                tl.store(rscale_ptr + r, rs, mask=rmask)


# ----------------------------------------------------------------------------- launcher


def _f32(v: float) -> float:
    """The float32 nearest to ``v``, as a Python float (passed to kernels so no re-rounding occurs)."""
    return float(np.float32(v))


def default_plan(rows: int, kp: int, stride_r: int, stride_k: int, elem_size: int, hb: int = 0,
                 row_max: bool = True, stochastic: bool = False) -> dict:
    """Tiles, warps and passes for one problem (H200 timings in `docs/kernels_notes.md`).

    - K contiguous (or neither dim contiguous): programs own whole rows, one 32-block per thread;
      one tile of ``next_pow2(kp)`` up to 8192 (at least 256 with a Hadamard block ``hb`` above
      32), and 16384 with 16 warps at ``kp`` in (8192, 16384] for a 32-block Hadamard, round to nearest and
      a row maximum (∇Y of a 14336-wide layer: 16-18% faster than the loop on the H200; without the
      row maximum, with SR or without a Hadamard the loop was faster or was not measured,
      `docs/kernels_notes.md` §9); else a loop over tiles of up to 2048, run twice when the row
      maximum is needed (row maximum first; the re-read hits L2).
    - rows contiguous (``axis=0`` of a row-major x, the transposing case): two kernels (the row
      maximum needs all of K) over tiles of ``32·VEC`` rows × 128 K, one block per warp. (Round 4's sweep:
      64 × 256 with 8 warps is faster when codes and FP8 are both written, not when only the
      one form an operand needs is: `docs/kernels_notes.md` §8.)
    """
    if stride_k == 1 or stride_r != 1:
        vec = 16 // elem_size
        if kp <= 8192:
            bk = triton.next_power_of_2(kp)
            if hb > 32:  # compiled for sm_90 (Triton 3.6) the [64, 4, 32] tile of kp=128 with a 64-block Hadamard
                bk = max(bk, 256)  # gave wrong codes (the interpreter's were right); [32, 8, 32] is validated
            br = max(1, (4096 if bk >= 2048 else 8192) // bk)
            return dict(mode="rows", BR=br, BK=bk, NCHUNK=1, LAYOUT=0, VEC=vec, num_warps=max(1, min(16, br * bk // 1024)))
        if kp <= 16384 and hb == 32 and row_max and not stochastic:  # the measured case: one row per program,
            # 32 elements per thread as above, masked up to the power of two; it saves the loop's second read
            return dict(mode="rows", BR=1, BK=16384, NCHUNK=1, LAYOUT=0, VEC=vec, num_warps=16)
        bk = 2048
        while kp % bk and bk > 512:
            bk //= 2
        return dict(mode="rows", BR=2, BK=bk, NCHUNK=-(-kp // bk), LAYOUT=0, VEC=vec, num_warps=max(1, 2 * bk // 1024))
    vec = 2 if elem_size == 2 else 1
    return dict(mode="tiles", BR=32 * vec, BK=128, NCHUNK=1, LAYOUT=1, VEC=vec, num_warps=4)


@functools.lru_cache(maxsize=1024)
def _launch_config(rows, kc, stride_r, stride_k, elem_size, hb, has_signs, stochastic, scale_rule, msr, plan_items,
                   write_codes=True, want_fp8=True, zero_rows=False):
    """Everything about a launch that follows from shapes and options (cached: host time matters)."""
    kp = -(-kc // 32) * 32
    p = dict(plan_items) if plan_items else default_plan(rows, kp, stride_r, stride_k, elem_size, hb, msr >= 0, stochastic)
    row_max, write_fp8 = msr >= 0, want_fp8 and folds_exactly(msr)
    br, bk = p["BR"], max(p["BK"], hb, 32)
    if p["mode"] == "rows":
        nchunk = p["NCHUNK"] if bk == p["BK"] else -(-kp // bk)
        n_kt, row_src = 1, (1 if row_max else 0)
    else:
        nchunk, n_kt = 1, triton.cdiv(kp, bk)
        row_src = 2 if row_max else 0
    common = dict(BR=br, BK=bk, LAYOUT=p["LAYOUT"], VEC=p["VEC"], MASK_R=rows % br != 0,
                  MASK_K=kc % (bk * nchunk) != 0 or kc != kp, INT64=False,
                  HB=hb, LOG_HB=int(math.log2(hb)) if hb else 0, HSCALE=_f32(1 / math.sqrt(hb)) if hb else 1.0,
                  HAS_SIGNS=has_signs, ZERO_ROWS=zero_rows, num_warps=p["num_warps"])
    quant = dict(common, NCHUNK=nchunk, RULE=RULE_IDS[scale_rule],
                 STOCHASTIC=stochastic, MSR=msr, ROW_SRC=row_src, WRITE_CODES=write_codes, WRITE_FP8=write_fp8,
                 ELEM_SCALE=_f32(4.0 / 3.0) if scale_rule == "tseng" else 1.0)
    return kp, write_fp8, (triton.cdiv(rows, br), n_kt), n_kt, row_src, common, quant


def mx_quantize(x: torch.Tensor, axis: int, hadamard_block: int, signs: torch.Tensor | None,
                stochastic: bool, scale_rule: str, max_scale_range: int, seed: torch.Tensor | None,
                write_codes: bool = True, want_fp8: bool = True, keep: torch.Tensor | None = None,
                *, plan: dict | None = None, out: tuple | None = None):
    """Launch the fused quantizer on a 2-D ``x``; arguments as the op :data:`quantize_op`.

    ``hadamard_block`` 0 means no transform; ``max_scale_range`` -1 means None. Returns
    ``(codes [rows, kp/2] uint8, scales [rows, kp/32] uint8, fp8 [rows, kp] e4m3, row_scale [rows] fp32)``;
    the last two are empty when ``max_scale_range`` is -1 or above 8 (no exact FP8 fold) or
    ``want_fp8`` is False; codes are ``[rows, 0]`` when ``write_codes`` is False. ``keep``: optional
    uint8 ``[rows]``, rows where it is 0 are quantized as zeros (OE).
    ``plan`` overrides :func:`default_plan` (benchmarks); ``out`` supplies the four output buffers
    (tests: poisoned ones). Traceable (the body of :data:`quantize_op`): shapes and strides are
    read as ints (a dynamic size is specialized), the launches go through :func:`launch`.
    """
    rows, kc, stride_r, stride_k = row_geometry(x, axis)
    hb = hadamard_block if hadamard_block > 1 else 0
    kp, write_fp8, grid, n_kt, row_src, common, quant = _launch_config(
        rows, kc, stride_r, stride_k, x.element_size(), hb, signs is not None, stochastic, scale_rule,
        max_scale_range, tuple(sorted(plan.items())) if plan else None, write_codes, want_fp8, keep is not None)
    dev = x.device
    if out is None:
        codes = torch.empty(rows, kp // 2 if write_codes else 0, dtype=torch.uint8, device=dev)  # outputs may not alias
        scales = torch.empty(rows, kp // 32, dtype=torch.uint8, device=dev)
        # the FP8 bytes are allocated as uint8 (the kernel stores bytes) and viewed as E4M3 at the end
        fp8 = torch.empty((rows, kp) if write_fp8 else (0,), dtype=torch.uint8, device=dev)
        rscale = torch.empty((rows,) if write_fp8 else (0,), dtype=torch.float32, device=dev)
    else:
        codes, scales, fp8, rscale = out
        want = [(rows, kp // 2 if write_codes else 0), (rows, kp // 32), (rows, kp) if write_fp8 else (0,),
                (rows,) if write_fp8 else (0,)]
        if [tuple(t.shape) for t in out] != want or not all(t.is_contiguous() for t in out):
            raise ValueError(f"mx_quantize: out buffers must be contiguous with shapes {want}")
        fp8 = fp8.view(torch.uint8)
    if rows == 0:
        return codes, scales, fp8.view(torch.float8_e4m3fn), rscale
    if max(rows * kp, (rows - 1) * abs(stride_r) + (kc - 1) * abs(stride_k) + 1) >= 2**31 - 2**20:
        common, quant = dict(common, INT64=True), dict(quant, INT64=True)
    signs_arg = signs if signs is not None else x  # never read without HAS_SIGNS
    keep_arg = keep if keep is not None else x  # never read without ZERO_ROWS
    pamax = x  # read only when ROW_SRC == 2
    if row_src == 2:
        pamax = torch.empty(rows, n_kt, dtype=torch.float32, device=dev)
        launch(_mx_amax_kernel, grid, ("pamax_ptr",), x_ptr=x, stride_r=stride_r, stride_k=stride_k, rows=rows, kc=kc,
               pamax_ptr=pamax, n_kt=n_kt, signs_ptr=signs_arg, keep_ptr=keep_arg, **common)
    launch(_mx_quantize_kernel, grid, ("codes_ptr", "scales_ptr", "fp8_ptr", "rscale_ptr"),
           x_ptr=x, stride_r=stride_r, stride_k=stride_k, rows=rows, kc=kc, kp=kp, codes_ptr=codes, scales_ptr=scales,
           fp8_ptr=fp8, rscale_ptr=rscale, pamax_ptr=pamax, n_kt=n_kt, signs_ptr=signs_arg,
           seed_ptr=seed if seed is not None else x, keep_ptr=keep_arg, **quant)
    return codes, scales, fp8.view(torch.float8_e4m3fn), rscale


@torch.library.triton_op("adahop::iht_quantize_mxfp4", mutates_args=())
def quantize_op(x: torch.Tensor, axis: int, hadamard_block: int, signs: torch.Tensor | None, stochastic: bool,
                scale_rule: str, max_scale_range: int, seed: torch.Tensor | None, write_codes: bool = True,
                want_fp8: bool = True, keep: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused quantizer as a ``triton_op`` (what ``torch.compile`` sees: Inductor inlines its
    launches); :func:`mx_quantize` is its body and the eager path."""
    return mx_quantize(x, axis, hadamard_block, signs, stochastic, scale_rule, max_scale_range, seed, write_codes,
                       want_fp8, keep)
