"""FP4 E2M1 elements and E8M0 / E4M3 scales: encode, decode, pack.

E2M1 (OCP MX v1.0 §5.3.3): 1 sign, 2 exponent bits (bias 1), 1 mantissa bit. No Inf, no NaN;
magnitudes by code 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are the negatives.
See `specs/baselines.md` §1.1–§1.2.

The encoder is written as an explicit interval table (as TransformerEngine's reference does), so it
can be read and checked by eye; it is the reference every fast path is tested against.
"""

from __future__ import annotations

import torch

from ..device_constants import on_device

__all__ = [
    "E2M1_VALUES",
    "E2M1_MAX",
    "E2M1_EMAX",
    "encode_e2m1",
    "decode_e2m1",
    "decode_e8m0",
    "encode_e8m0",
    "pack_e2m1",
    "unpack_e2m1",
]

#: The 8 non-negative E2M1 magnitudes, indexed by code 0..7 (float32).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32, device="cpu")
#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: Exponent of the largest normal E2M1 value (6 = 1.5 · 2^2); the MX scale rules subtract it.
E2M1_EMAX = 2

# Midpoints between consecutive magnitudes, and whether the code above each midpoint is even.
# Round-half-to-even: at an exact midpoint the even code wins (0.25→0, 0.75→1, 1.25→1, 1.75→2,
# 2.5→2, 3.5→4, 5→4), which is what `cvt.rn.satfinite.e2m1x2.f32` does.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_UPPER_IS_EVEN = (False, True, False, True, False, True, False)


def _magnitude_code_rne(a: torch.Tensor) -> torch.Tensor:
    """Code 0..7 of |v| rounded half-to-even onto the E2M1 grid; values above 6 saturate to 7."""
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for mid, upper_even in zip(_MIDPOINTS, _UPPER_IS_EVEN):
        code += (a >= mid) if upper_even else (a > mid)
    return code


def _grid(device) -> torch.Tensor:
    # cached per device: a host-to-device copy per call cannot be captured in a CUDA graph
    return on_device(("e2m1_values",), lambda: E2M1_VALUES, device)


def _magnitude_code_stochastic(a: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Code of |v| rounded stochastically between its two grid neighbours.

    P(round up) = (a - lo) / (hi - lo), so E[decode(code)] = a for a in [0, 6]. Values above 6
    would be biased; callers guarantee they never occur (the scale rules that clip are refused).
    """
    grid = _grid(a.device)
    a = a.clamp(max=E2M1_MAX)
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 7)  # largest code with value <= a
    hi = (lo + 1).clamp(max=7)
    v_lo, v_hi = grid[lo], grid[hi]
    width = torch.where(hi > lo, v_hi - v_lo, torch.ones_like(v_lo))
    p_up = (a - v_lo) / width
    u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    return torch.where(u < p_up, hi, lo).to(torch.uint8)


def encode_e2m1(v: torch.Tensor, *, rounding: str = "nearest", generator: torch.Generator | None = None) -> torch.Tensor:
    """Encode already-scaled float32 values to 4-bit E2M1 codes (one code per uint8, unpacked).

    The sign bit is kept whatever the magnitude: a negative value that rounds to zero, and -0
    itself, encode as code 8 (-0), as the official AdaHOP encoder (it ORs the float's sign bit
    into every code, `specs/adahop.md` §6.1), torchao and the hardware conversions do. So packed
    codes written here are byte-identical to theirs.

    Args:
        v: float32 tensor of scaled values (x / block scale), any shape. NaN encodes as +0; callers
            mark NaN blocks through the scale (E8M0 code 255), as the OCP spec requires.
        rounding: ``"nearest"`` (round-half-to-even, saturating at ±6) or ``"stochastic"``.
        generator: torch generator for stochastic rounding (on ``v``'s device).

    Returns:
        uint8 tensor of ``v``'s shape with codes 0..15 (bit 3 is the sign).

    Raises:
        ValueError: unknown ``rounding``.
    """
    a = v.abs().nan_to_num(nan=0.0)
    if rounding == "nearest":
        mag = _magnitude_code_rne(a)
    elif rounding == "stochastic":
        mag = _magnitude_code_stochastic(a, generator)
    else:
        raise ValueError(f"rounding={rounding!r} is not supported; use 'nearest' or 'stochastic'")
    sign = (torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << 3  # also for magnitude 0: code 8 is -0
    return mag | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Decode unpacked E2M1 codes (uint8, values 0..15) to float32 of the same shape."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode_e2m1 expects uint8 codes, got {codes.dtype}")
    grid = _grid(codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Encode integer exponents in [-127, 127] as E8M0 codes (bias 127); NaN marks are done by callers."""
    return (exponent + 127).to(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scale codes (uint8) to float32: 2^(code-127); code 0 is 2^-127 (an FP32
    subnormal, not 0), code 255 is NaN (`specs/baselines.md` §1.2)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode_e8m0 expects uint8 codes, got {codes.dtype}")
    e = codes.to(torch.int32) - 127
    # ldexp is exact for the whole range, including the subnormal 2^-127 that bit-shifting gets wrong.
    val = torch.ldexp(torch.ones(codes.shape, dtype=torch.float32, device=codes.device), e)
    return torch.where(codes == 255, torch.full_like(val, float("nan")), val)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack unpacked codes [..., 2n] into bytes [..., n]: even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: bytes [..., n] to codes [..., 2n]."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], -1)
