"""The Triton kernels of decoding from `adahop ptq`'s packed artifact (:mod:`adahop.ptq.decode`): the int matvec
and one block stage of a rotation. Imported lazily, with Triton.

``int_matvec_kernel`` (:func:`adahop.ptq.decode.int_matvec`): ``y = x·Wᵀ`` with ``W`` read as packed codes.

At decode time (a few rows of ``x``) the layer is a matvec of few bytes (2-bit codes are an eighth of a BF16
weight), fast only with many loads in flight and few instructions a code. So the work is split both ways: one program computes ``BLOCK_M`` outputs of one row of ``x`` over ``TILES`` consecutive tiles of the
input dimension (split-K), and writes its partial sums to its own slice of ``y`` (``[splits, rows, M]``, summed
after in a fixed order, so the result does not depend on the schedule).

The little-endian bit stream :func:`adahop.ptq.quantize.pack_bits` writes is read as 32-bit words, in units of
whole words holding whole codes: one word of 16 codes at 2 bits, of 8 at 4 bits, three words of 32 codes at 3 bits
(two of those codes straddle a word). A tile is ``[BLOCK_M, BLOCK_U]`` units, each word loaded once. Code ``j`` of
every unit is pulled out of the tile with constant masks and shifts, so all arithmetic stays on that one 2-D
layout, and is multiplied with the matching strided slice ``x[u·codes + j]``. Codes become floats without an int→float
conversion: an int code's bits masked where they lie into the mantissa of 1.0 give ``1 + c·2^(P−23)``, and
a constant taken off leaves its level ``c − (2^(BITS−1) − ½)`` times ``2^(P−23)`` exactly (:func:`_int_level`; the
power of two goes onto ``x``); an E2M1 code's 3 magnitude bits placed in an FP16's exponent and mantissa are its
value times 2^-14 (subnormal at exponent 0, as E2M1's; the 2^14 goes onto ``x``).
Each unit's sum is then multiplied by its group's scale (FP16, or E8M0 for MXFP4 weights: 4 bits, groups of 32),
so the group size must be a multiple of a unit's codes. The caller guarantees that every row of ``W`` is whole
units (``N`` a multiple of a unit's codes).

``stage_kernel`` (:func:`adahop.ptq.staged.apply_stages`): one stage of ``B × B`` blocks at stride ``S``,
``y[hi·B·S + c·S + lo] = Σ_a x[hi·B·S + a·S + lo] · K[hi·S + lo, a, c]``. A program takes ``BLOCKS`` blocks and
``BLOCK_C`` of their outputs for one row; ``x`` is read in its own dtype and ``y`` written in its own (the
casts of the layer's input and output ride in its first and last stage), and ``x`` may be ``PARTS`` partial sums
``[PARTS, ROWS, D]``, added as they are read (the split-K matvec's, with no launch of their own to sum them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _code(w, w_next, POS: tl.constexpr, BITS: tl.constexpr):
    """The ``BITS``-bit code at bit ``POS`` of the words ``w`` (uint32), its high bits in ``w_next`` past bit 31."""
    if POS + BITS > 32:
        c = ((w >> POS) | (w_next << (32 - POS))) & ((1 << BITS) - 1)
    else:
        c = (w >> POS) & ((1 << BITS) - 1)
    return c


@triton.jit
def _int_level(w, w_next, xj, POS: tl.constexpr, BITS: tl.constexpr):
    """``(level·2^-k, xj·2^k)`` for the int code ``c`` at bit ``POS`` of ``w``, whose product is ``level·xj`` with
    ``level = c − (2^(BITS−1) − ½)``: the code's bits masked in place, at bit ``P ≥ 1`` of a shifted copy of the word
    (``w << 1`` for the low codes, ``w >> 15`` for the high ones: two shifts a word, shared by its codes), into
    the mantissa of 1.0, which gives ``1 + c·2^(P−23)`` exactly; the constant ``1 + (2^(BITS−1) − ½)·2^(P−23)``
    taken off leaves the level times ``2^(P−23)`` exactly (both in [1, 2), and ``P ≥ 1`` holds the ½); the
    power of two goes onto ``x`` (one multiply per unit, not per code). Exact for ``|x| < 2^(105+P)``."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if POS + BITS > 32:  # straddles into w_next (3 bits)
        v = _code(w, w_next, POS, BITS) << 1
        P: tl.constexpr = 1
    elif POS + BITS <= 22:
        v = (w << 1) & (MASK << (POS + 1))
        P: tl.constexpr = POS + 1
    else:  # POS >= 19 for BITS <= 4
        v = (w >> 15) & (MASK << (POS - 15))
        P: tl.constexpr = POS - 15
    level = (v | 0x3F800000).to(tl.float32, bitcast=True) - (1.0 + (MASK + 0.0) / (1 << (24 - P)))
    return level, xj * (1 << (23 - P))


@triton.jit
def int_matvec_kernel(x_ptr, words_ptr, scales_ptr, y_ptr, M, N, G, ROWS, TILES, ROW_WORDS,
                      BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_U: tl.constexpr,
                      UNIT_WORDS: tl.constexpr, UNIT_CODES: tl.constexpr, E2M1: tl.constexpr = False):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < M
    units = N // UNIT_CODES
    word_rows = words_ptr + ms[:, None].to(tl.int64) * ROW_WORDS
    x_row = x_ptr + row * N
    acc = tl.zeros([BLOCK_M, BLOCK_U], dtype=tl.float32)
    for t in range(split * TILES, (split + 1) * TILES):
        u = t * BLOCK_U + tl.arange(0, BLOCK_U)  # unit index along the row
        umask = u < units
        mask = mmask[:, None] & umask[None, :]
        w0 = tl.load(word_rows + (u * UNIT_WORDS)[None, :], mask=mask, other=0).to(tl.uint32, bitcast=True)
        if UNIT_WORDS == 3:  # 3 bits: 32 codes in three words
            w1 = tl.load(word_rows + (u * 3 + 1)[None, :], mask=mask, other=0).to(tl.uint32, bitcast=True)
            w2 = tl.load(word_rows + (u * 3 + 2)[None, :], mask=mask, other=0).to(tl.uint32, bitcast=True)
        part = tl.zeros([BLOCK_M, BLOCK_U], dtype=tl.float32)
        for j in tl.static_range(UNIT_CODES):
            xj = tl.load(x_row + u * UNIT_CODES + j, mask=umask, other=0.0).to(tl.float32)
            # code j's first bit in the unit is BITS·j: word BITS·j // 32, bit BITS·j % 32 (all constexpr, so
            # each unrolled j keeps only its own branch)
            # (w_next: the word a straddling code, 3 bits' 10 and 21, ends in)
            if (BITS * j) // 32 == 0:
                w, w_next = w0, (w1 if UNIT_WORDS == 3 else w0)
            elif (BITS * j) // 32 == 1:
                w, w_next = w1, w2
            else:
                w, w_next = w2, w2
            if E2M1:  # magnitude bits to FP16 exponent and mantissa (value · 2^-14), sign bit to the sign; the
                # 2^14 goes onto x (a tiny x times a value·2^-14 would lose bits as a subnormal)
                c = _code(w, w_next, (BITS * j) % 32, BITS)
                h = ((c & 7) << 9) | ((c & 8) << 12)
                part += h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * (xj * 16384.0)[None, :]
            else:
                level, xs = _int_level(w, w_next, xj, (BITS * j) % 32, BITS)
                part += level * xs[None, :]
        scale_ptrs = scales_ptr + ms[:, None].to(tl.int64) * G + ((u * UNIT_CODES) // GROUP)[None, :]
        if E2M1:  # an E8M0 scale byte s is 2^(s − 127): s as a float32's exponent field, but 0 (2^-127, a
            # subnormal: two normal factors instead) and 255 (NaN)
            sb = tl.load(scale_ptrs, mask=mask, other=1).to(tl.int32)
            scaled = tl.where(sb == 0, (part * 5.421010862427522e-20) * 1.0842021724855044e-19,
                              part * (sb << 23).to(tl.float32, bitcast=True))
            acc += tl.where(sb == 255, float("nan"), scaled)
        else:
            acc += part * tl.load(scale_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + (split * ROWS + row) * M + ms, tl.sum(acc, axis=1), mask=mmask)


@triton.jit
def stage_kernel(x_ptr, k_ptr, y_ptr, D, NBLK, B, S, ROWS, PARTS,
                 BLOCKS: tl.constexpr, BP: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    blk = pid_b * BLOCKS + tl.arange(0, BLOCKS)
    a = tl.arange(0, BP)  # the radix padded to a power of two
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    bmask, amask, cmask = blk < NBLK, a < B, c < B
    base = (blk // S) * (B * S) + blk % S  # the coordinate of each block's digit 0
    xk = tl.zeros([BLOCKS, BP], dtype=tl.float32)
    for p in range(PARTS):  # x given as partial sums (the split-K matvec's): added as they are read
        xk += tl.load(x_ptr + (p * ROWS + row) * D + base[:, None] + a[None, :] * S,
                      mask=bmask[:, None] & amask[None, :], other=0.0).to(tl.float32)
    kp = k_ptr + blk[:, None, None].to(tl.int64) * B * B + a[None, :, None] * B + c[None, None, :]
    k = tl.load(kp, mask=bmask[:, None, None] & amask[None, :, None] & cmask[None, None, :], other=0.0)
    y = tl.sum(xk[:, :, None] * k, axis=1)  # [BLOCKS, BLOCK_C]
    tl.store(y_ptr + row * D + base[:, None] + c[None, :] * S, y, mask=bmask[:, None] & cmask[None, :])
