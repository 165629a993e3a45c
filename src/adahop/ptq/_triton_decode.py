"""The Triton kernels of decoding from `adahop ptq`'s packed artifact (:mod:`adahop.ptq.decode`): the int matvec
and one block stage of a rotation. Imported lazily, with Triton.

``int_matvec_kernel`` (:func:`adahop.ptq.decode.int_matvec`): ``y = x·Wᵀ`` with ``W`` read as packed int codes.

At decode time (a few rows of ``x``) the layer is a matvec bound by the bytes of ``W``: 2-bit codes are an eighth
of a BF16 weight. Such a read is fast only with many loads in flight, so the work is split both ways: one
program computes ``BLOCK_M`` outputs of one row of ``x`` over ``TILES`` consecutive tiles of ``BLOCK_K`` inputs
(split-K), and writes its partial sums to its own slice of ``y`` (``[splits, rows, M]``, summed after, in a fixed
order, so the result does not depend on the schedule).

The little-endian bit stream :func:`adahop.ptq.quantize.pack_bits` writes is read in units of whole bytes holding
whole codes: one byte of ``8 / BITS`` codes at 2 and 4 bits, three bytes of eight codes at 3 bits. Each byte is
loaded once, as a ``[BLOCK_M, units]`` tile (at 3 bits its three bytes put together into one value first), then
split into its codes along a third axis that lines up with the matching ``[units, codes a unit]`` view of ``x``.
A code maps to ``(code − 2^(BITS−1) + ½)`` times its group's FP16 scale (the int grid), or with ``E2M1`` to its
E2M1 value times its group's E8M0 scale (MXFP4 weights: 4 bits, groups of 32); ``BLOCK_K`` divides the group size, so a
tile needs one scale per output. The caller guarantees that a row of ``W`` starts on a unit
(``N·BITS % 8 == 0`` and, at 3 bits, ``N % 8 == 0``).

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
def int_matvec_kernel(x_ptr, codes_ptr, scales_ptr, y_ptr, M, N, G, ROWS, TILES,
                      BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      UNIT_BYTES: tl.constexpr, UNIT_CODES: tl.constexpr, UNIT_BYTES_P2: tl.constexpr,
                      E2M1: tl.constexpr = False):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    NU: tl.constexpr = BLOCK_K // UNIT_CODES  # units (whole bytes of whole codes) per row of a tile
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < M
    us = tl.arange(0, NU)
    js = tl.arange(0, UNIT_CODES)
    row_bytes = N * BITS // 8
    code_rows = codes_ptr + ms[:, None].to(tl.int64) * row_bytes
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(split * TILES, (split + 1) * TILES):
        k0 = t * BLOCK_K
        kk = k0 + us[:, None] * UNIT_CODES + js[None, :]  # [NU, UNIT_CODES]: the input index of each code
        xk = tl.load(x_ptr + row * N + kk, mask=kk < N, other=0.0).to(tl.float32)
        b = (k0 // UNIT_CODES + us) * UNIT_BYTES  # each unit's first byte
        if UNIT_BYTES == 1:  # 2 and 4 bits: codes never straddle a byte
            unit = tl.load(code_rows + b[None, :], mask=mmask[:, None] & (b < row_bytes)[None, :], other=0).to(tl.int32)
        else:  # 3 bits: eight codes in three bytes, their 24-bit value put together first
            jb = tl.arange(0, UNIT_BYTES_P2)
            bi = b[:, None] + jb[None, :]
            byte = tl.load(code_rows[:, :, None] + bi[None, :, :],
                           mask=mmask[:, None, None] & ((jb < UNIT_BYTES)[None, :] & (bi < row_bytes))[None, :, :],
                           other=0).to(tl.int32)
            unit = tl.sum(byte << (jb * 8)[None, None, :], axis=2)  # [BLOCK_M, NU]
        code = (unit[:, :, None] >> (js * BITS)[None, None, :]) & ((1 << BITS) - 1)  # [BLOCK_M, NU, UNIT_CODES]
        if E2M1:  # MXFP4: sign bit 3, then 2 exponent bits and 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6
            e = (code >> 1) & 3
            man = (code & 1).to(tl.float32)
            mag = tl.where(e == 0, 0.5 * man, (1 << tl.maximum(e - 1, 0)).to(tl.float32) * (1.0 + 0.5 * man))
            level = tl.where((code & 8) != 0, -mag, mag)
        else:
            level = code.to(tl.float32) - ((1 << (BITS - 1)) - 0.5)
        part = tl.sum(tl.sum(level * xk[None, :, :], axis=2), axis=1)  # inputs past N have x = 0
        g = tl.minimum(k0 // GROUP, G - 1)  # a tile past N (the last split's overhang) has part = 0
        if E2M1:  # an E8M0 scale byte s is 2^(s − 127): s as a float32's exponent field (s = 0, 2^-127, reads 0)
            sb = tl.load(scales_ptr + ms.to(tl.int64) * G + g, mask=mmask, other=0).to(tl.int32)
            s = (sb << 23).to(tl.float32, bitcast=True)
        else:
            s = tl.load(scales_ptr + ms.to(tl.int64) * G + g, mask=mmask, other=0.0).to(tl.float32)
        acc += part * s
    tl.store(y_ptr + (split * ROWS + row) * M + ms, acc, mask=mmask)


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
