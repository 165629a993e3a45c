"""The Triton kernel of :func:`adahop.ptq.decode.int_matvec`: ``y = x·Wᵀ`` with ``W`` read as packed int codes.

One program computes ``BLOCK_M`` outputs of one row of ``x``. It walks the input dimension in tiles of
``BLOCK_K``, unpacks each code from its byte of the little-endian bit stream :func:`adahop.ptq.quantize.pack_bits`
writes (``8 / BITS`` codes a byte, row after row), maps it to its level ``(code − 2^(BITS−1) + ½)`` times its
group's FP16 scale, and accumulates in FP32. At decode time (a few rows of ``x``) the layer is a matvec, bound
by the bytes of ``W`` it reads: 2-bit codes are an eighth of BF16 weights. Imported lazily, with Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int_matvec_kernel(x_ptr, codes_ptr, scales_ptr, y_ptr, M, N, G,
                      BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < M
    per: tl.constexpr = 8 // BITS
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < N
        both = mmask[:, None] & kmask[None, :]
        xk = tl.load(x_ptr + row * N + ks, mask=kmask, other=0.0).to(tl.float32)
        flat = ms[:, None].to(tl.int64) * N + ks[None, :]
        byte = tl.load(codes_ptr + flat // per, mask=both, other=0).to(tl.int32)
        code = (byte >> ((flat % per) * BITS).to(tl.int32)) & ((1 << BITS) - 1)
        s = tl.load(scales_ptr + ms[:, None].to(tl.int64) * G + ks[None, :] // GROUP, mask=both, other=0.0).to(tl.float32)
        level = code.to(tl.float32) - ((1 << (BITS - 1)) - 0.5)
        acc += tl.sum(level * s * xk[None, :], axis=1)
    tl.store(y_ptr + row * M + ms, acc, mask=mmask)
