"""Philox4x32-10 in plain PyTorch: the counter-based generator behind Triton's ``tl.randint``.

The fused optimizer step (``optim_step.py``) rounds stochastically with bits from
``tl.randint(seed, offset)``; its reference draws the same bits here, so the two twins agree bit for
bit under stochastic rounding too. Philox4x32 (Salmon et al., SC'11, "Parallel random numbers: as
easy as 1, 2, 3"): a 4×32-bit counter and a 2×32-bit key; each of 10 rounds multiplies two counter
words by fixed constants, splits the 64-bit products into halves and mixes them with the key, which
is bumped by the Weyl constants. Triton's ``randint`` (32-bit offsets) puts the offset in counter
word 0, zeros in words 1 to 3, the seed's low and high 32 bits in the key, and returns word 0. The
fused optimizer step calls Triton's ``philox`` with counter word 1 = a stream number (the
parameter's index), so that one key per step gives every tensor of a launch its own stream; with
stream 0 it is ``randint``. (64-bit offsets switch Triton to Philox4x64, which is not reproduced here.)

Arithmetic is on int64 tensors holding uint32 values; the 32×32-bit products are formed from 16-bit
halves so that nothing overflows int64.
"""

from __future__ import annotations

import torch

__all__ = ["philox_randint", "PHILOX_ROUNDS"]

PHILOX_ROUNDS = 10
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # the multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # the key increments (golden ratio, sqrt(3) - 1)
_M32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of ``a * b`` for a uint32 constant ``a`` and uint32 values ``b``."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    lo_lo = a_lo * b_lo  # < 2^32 each: the partial products fit int64 easily
    mid = a_hi * b_lo + a_lo * b_hi  # < 2^33
    hi_hi = a_hi * b_hi
    low = (lo_lo + ((mid & 0xFFFF) << 16)) & _M32
    carry = (lo_lo + ((mid & 0xFFFF) << 16)) >> 32
    high = (hi_hi + (mid >> 16) + carry) & _M32
    return high, low


def philox_randint(seed: int, offsets: torch.Tensor, rounds: int = PHILOX_ROUNDS, stream: int = 0) -> torch.Tensor:
    """The uint32 that ``tl.randint(seed, offsets)`` returns, element by element (``stream`` 0), or
    word 0 of Triton's ``philox(seed, offsets, stream, 0, 0)``.

    Args:
        seed: the 64-bit seed (``0 <= seed < 2**64``); its low half is key word 0, its high half
            key word 1.
        offsets: integer tensor of counters, ``0 <= offset < 2**32`` (Triton's int32 offsets).
        rounds: Philox rounds (10, Triton's default).
        stream: counter word 1, ``0 <= stream < 2**32``.

    Returns:
        int64 tensor of ``offsets``' shape with values in ``[0, 2**32)``.

    Raises:
        ValueError: a seed, an offset or a stream out of range.
    """
    if not 0 <= seed < 2**64:
        raise ValueError(f"philox_randint: seed={seed} must be in [0, 2**64)")
    if not 0 <= stream <= _M32:
        raise ValueError(f"philox_randint: stream={stream} must be in [0, 2**32)")
    c0 = offsets.to(torch.int64)
    if c0.numel() and (int(c0.min()) < 0 or int(c0.max()) > _M32):
        raise ValueError("philox_randint: offsets must be in [0, 2**32); split longer tensors into several seeds")
    c1 = torch.full_like(c0, stream)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0
