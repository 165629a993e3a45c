"""The Triton kernel of :func:`adahop.ptq.decode.int_matvec`: ``y = x·Wᵀ`` with ``W`` read as packed int codes.

At decode time (a few rows of ``x``) the layer is a matvec bound by the bytes of ``W``: 2-bit codes are an eighth
of a BF16 weight. Such a read is fast only with many loads in flight, so the work is split both ways: one
program computes ``BLOCK_M`` outputs of one row of ``x`` over ``TILES`` consecutive tiles of ``BLOCK_K`` inputs
(split-K), and writes its partial sums to its own slice of ``y`` (``[splits, rows, M]``, summed after, in a fixed
order, so the result does not depend on the schedule).

Each byte of the little-endian bit stream :func:`adahop.ptq.quantize.pack_bits` writes holds ``8 / BITS`` codes
and is loaded once, as a ``[BLOCK_M, BLOCK_K·BITS/8]`` tile, then split into its codes along a third axis that
lines up with the matching ``[BLOCK_K·BITS/8, 8/BITS]`` view of ``x``. A code maps to ``(code − 2^(BITS−1) + ½)``
times its group's FP16 scale; ``BLOCK_K`` divides the group size, so a tile needs one scale per output. The
caller guarantees that a row of ``W`` starts on a byte (``N·BITS % 8 == 0``). Imported lazily, with Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int_matvec_kernel(x_ptr, codes_ptr, scales_ptr, y_ptr, M, N, G, ROWS, TILES,
                      BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    PER: tl.constexpr = 8 // BITS  # codes per byte
    NB: tl.constexpr = BLOCK_K // PER  # bytes per row of a tile
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < M
    bs = tl.arange(0, NB)
    js = tl.arange(0, PER)
    row_bytes = N // PER
    code_rows = codes_ptr + ms[:, None].to(tl.int64) * row_bytes
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(split * TILES, (split + 1) * TILES):
        k0 = t * BLOCK_K
        kk = k0 + bs[:, None] * PER + js[None, :]  # [NB, PER]: the input index of each code of the tile
        xk = tl.load(x_ptr + row * N + kk, mask=kk < N, other=0.0).to(tl.float32)
        b = k0 // PER + bs
        byte = tl.load(code_rows + b[None, :], mask=mmask[:, None] & (b < row_bytes)[None, :], other=0).to(tl.int32)
        code = (byte[:, :, None] >> (js * BITS)[None, None, :]) & ((1 << BITS) - 1)  # [BLOCK_M, NB, PER]
        level = code.to(tl.float32) - ((1 << (BITS - 1)) - 0.5)
        part = tl.sum(tl.sum(level * xk[None, :, :], axis=2), axis=1)  # inputs past N have x = 0
        g = tl.minimum(k0 // GROUP, G - 1)  # a tile past N (the last split's overhang) has part = 0
        s = tl.load(scales_ptr + ms.to(tl.int64) * G + g, mask=mmask, other=0.0).to(tl.float32)
        acc += part * s
    tl.store(y_ptr + (split * ROWS + row) * M + ms, acc, mask=mmask)
