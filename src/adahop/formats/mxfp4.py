"""MXFP4 (OCP MX v1.0): blocks of E2M1 elements sharing one E8M0 power-of-two scale.

Reference implementation, written to be obviously right rather than fast; the CUDA fast paths in
`adahop.kernels` are tested against it bit for bit. Semantics: `specs/baselines.md` §1.2–§1.4,
`specs/adahop.md` §6.1, `DESIGN.md` §3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .common import check_float_input, move_and_pad, unpad_and_restore
from .e2m1 import E2M1_EMAX, decode_e2m1, decode_e8m0, encode_e2m1, encode_e8m0, pack_e2m1, unpack_e2m1

__all__ = ["MXTensor", "quantize_mxfp4", "SCALE_RULES", "block_exponents", "check_mx_options", "FOLD_RANGE", "folds_exactly"]

#: Scale rules: how the E8M0 exponent of a block follows from its amax.
SCALE_RULES = ("floor", "rceil", "adahop", "tseng")
_CLIPPING_RULES = ("floor", "adahop")
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
#: Largest block-exponent range within a row that folds exactly into FP8 E4M3 (`DESIGN.md` §3:
#: every E2M1 value times 2^d is an E4M3 value for d = 0 … −8, and not below).
FOLD_RANGE = 8


def folds_exactly(max_scale_range: int | None) -> bool:
    """Whether a quantizer with this ``max_scale_range`` (None or -1: no limit) yields rows that fold
    exactly into FP8, so that it can write the fold itself (`DESIGN.md` §3)."""
    return max_scale_range is not None and 0 <= max_scale_range <= FOLD_RANGE


@dataclass(frozen=True, eq=False)
class MXTensor:
    """A tensor quantized to MXFP4.

    Attributes:
        codes: uint8 ``[*outer, padded_len // 2]``; two E2M1 codes per byte, even index in the low
            nibble. The quantized axis is moved last and zero-padded to a multiple of ``block_size``.
        scales: uint8 ``[*outer, padded_len // block_size]``; E8M0 codes (255 = NaN block).
        shape: the original shape.
        axis: the quantized (blocked) axis of the original shape, non-negative.
        block_size: elements per scale (32 for MXFP4).
        elem_scale: decode multiplier applied on top of the E8M0 scale; 1 except for the
            ``"tseng"`` rule (4/3, undoing its 3/4 pre-scale).
        fp8: optional cache of the same values folded for the Hopper FP8 GEMM, set by the fused
            quantizer (`adahop.kernels`): ``(float8_e4m3fn [rows, padded_len], float32 [rows])``
            with ``values = fp8 · row_scale`` exactly (`DESIGN.md` §3). ``None`` elsewhere; drop
            it (``dataclasses.replace(q, fp8=None)``) before saving for backward. An operand the
            GEMM consumes at once may hold only this form: ``codes`` is then ``[rows, 0]``.
        scale_range: the ``max_scale_range`` the quantizer enforced (None: no limit). At most 8
            means every row folds exactly into FP8, so the fold skips its range check.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    axis: int
    block_size: int = 32
    elem_scale: float = 1.0
    fp8: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    scale_range: int | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values in ``dtype``, original ``shape``, padding removed.

        Raises:
            ValueError: an FP8-only tensor (``codes`` ``[rows, 0]``) whose ``fp8`` was dropped.
        """
        if self.codes_dropped:
            if self.fp8 is None:
                raise ValueError("MXTensor holds neither E2M1 codes nor the FP8 fold; quantize with outputs='all'")
            f8, row_scale = self.fp8
            x = f8.float() * row_scale[:, None]
            return unpad_and_restore(x.reshape(*self.scales.shape[:-1], -1), self.shape, self.axis).to(dtype)
        q = decode_e2m1(unpack_e2m1(self.codes))
        q = q.reshape(*q.shape[:-1], -1, self.block_size)
        x = q * decode_e8m0(self.scales).unsqueeze(-1)
        if self.elem_scale != 1.0:
            x = x * self.elem_scale
        return unpad_and_restore(x.flatten(-2), self.shape, self.axis).to(dtype)

    @property
    def codes_dropped(self) -> bool:
        """True when only the FP8 fold was written (``codes`` ``[rows, 0]`` of a non-empty tensor)."""
        return self.codes.shape[-1] == 0 and self.scales.shape[-1] > 0

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes plus scales (4.25 bits per element for block 32), plus the FP8
        fold and its row scales when present."""
        n = self.codes.numel() + self.scales.numel()
        if self.fp8 is not None:
            n += self.fp8[0].numel() + 4 * self.fp8[1].numel()
        return n

    @property
    def exponents(self) -> torch.Tensor:
        """int32 ``[*outer, n_blocks]``: the unbiased block exponents (NaN blocks read 128)."""
        return self.scales.to(torch.int32) - 127


def block_exponents(amax: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """E8M0 exponent of each block from its float32 amax (finite, >= 0), as int32.

    Notes:
        With ``amax = m · 2^f``, ``m ∈ [1, 2)``:

        - ``floor`` (OCP v1.0 §6.3): ``f − 2``; amax/scale ∈ [4, 8), values above 6 clip.
        - ``rceil``: the smallest power of two with amax/scale ≤ 6 (`specs/baselines.md` §1.4 RCEIL, torchao RCEIL,
          ``2^⌈log2(amax/6)⌉``): ``f − 2 + [m > 1.5]``; never clips.
        - ``adahop``: amax rounded to one mantissa bit, then floor (`specs/adahop.md` §6.1):
          ``f − 2 + [m ≥ 1.75]``, and at least −126 (code 1) as in the official code, which
          clamps every scale code to ≥ 1 — an all-zero block included.
        - ``tseng``: the floor exponent; the elements are pre-scaled by 3/4 so nothing clips
          (`specs/baselines.md` §2.1).

        amax = 0 gives −127 (code 0, the OCP/torchao convention) under ``floor``, ``rceil`` and
        ``tseng``, and −126 (code 1, the official AdaHOP encoder's) under ``adahop``. Results are
        clamped to the E8M0 range [−127, 127].
    """
    mant, exp = torch.frexp(amax)  # amax = mant · 2^exp, mant ∈ [0.5, 1)
    f = exp.to(torch.int32) - 1  # floor(log2 amax)
    m = mant * 2  # ∈ [1, 2)
    e = f - E2M1_EMAX
    if scale_rule == "rceil":
        e = e + (m > 1.5).to(torch.int32)
    elif scale_rule == "adahop":
        e = (e + (m >= 1.75).to(torch.int32)).clamp(min=-126)
    elif scale_rule not in ("floor", "tseng"):
        raise ValueError(f"scale_rule={scale_rule!r} is not supported; use one of {SCALE_RULES}")
    e = torch.where(amax > 0, e, torch.full_like(e, E8M0_MIN_EXP + (scale_rule == "adahop")))
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def check_mx_options(scale_rule: str, rounding: str, max_scale_range: int | None) -> None:
    """Raise ValueError for an unknown scale rule or rounding, a clipping rule under stochastic
    rounding (clipping biases it), or a bad ``max_scale_range``; shared by every MXFP4 quantizer."""
    if scale_rule == "ceil":  # the name this rule had until 2026-12-06, which the spec gives another rule
        raise ValueError("scale_rule='ceil' is now 'rceil' (2^ceil(log2(amax/6)), the spec's RCEIL); the spec's CEIL, "
                         "2^(ceil(log2 amax) - 2), is not a rule of adahop")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule={scale_rule!r} is not supported; use one of {SCALE_RULES}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding={rounding!r} is not supported; use 'nearest' or 'stochastic'")
    if rounding == "stochastic" and scale_rule in _CLIPPING_RULES:
        raise ValueError(
            f"scale_rule={scale_rule!r} clips block maxima above 6, which biases stochastic "
            "rounding toward zero; use scale_rule='rceil' (or 'tseng') with rounding='stochastic'"
        )
    if max_scale_range is not None and (not isinstance(max_scale_range, int) or max_scale_range < 0):
        raise ValueError(f"max_scale_range={max_scale_range!r} must be a non-negative int or None")


def quantize_mxfp4(
    x: torch.Tensor,
    *,
    axis: int = -1,
    block_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    max_scale_range: int | None = None,
) -> MXTensor:
    """Quantize ``x`` to MXFP4 with blocks of ``block_size`` along ``axis``.

    Args:
        x: float32, float16, bfloat16 or float64 tensor of any rank ≥ 1, on any device. A float64 ``x``
            is rounded to float32 first: amaxes, scales and ties are those of its float32 values, as in the
            fused kernels.
        axis: the blocked axis (the GEMM's contracted dimension). A length that is not a multiple
            of ``block_size`` is zero-padded per row; a block never spans two rows.
        block_size: elements per E8M0 scale, an even number (32 for MXFP4).
        scale_rule: ``"floor"`` (OCP), ``"rceil"`` (never clips), ``"adahop"`` or ``"tseng"``;
            see :func:`block_exponents`.
        rounding: ``"nearest"`` (round-half-to-even) or ``"stochastic"``.
        generator: source of the stochastic-rounding bits (on ``x``'s device); reproducible
            under a seed, fresh across calls.
        max_scale_range: if set to ``r``, every block exponent is raised to at least
            (the largest finite block exponent of its row) − ``r``. ``r = 8`` makes the result
            fold exactly into FP8 E4M3 with one FP32 scale per row (`DESIGN.md` §3).

    Returns:
        An :class:`MXTensor`. A block holding NaN or ±Inf gets scale code 255 and decodes to NaN. A finite
        block with amax ≥ 1.75·2^127 (``rceil``, ``adahop``) or ≥ 1.667·2^127 (``tseng``) can round up to
        2^128: an MXFP4 value (2^126 × 4; ``tseng``: 2^125 × 6 × 4/3), but not a float32, so it dequantizes to
        inf.

    Raises:
        TypeError: ``x`` is not a floating-point tensor (integer, bool, complex).
        ValueError: empty axis, bad ``block_size``, unknown rule or rounding, or a clipping
            scale rule (``floor``, ``adahop``) with stochastic rounding, whose clipping would
            bias the rounding; use ``"rceil"`` or ``"tseng"`` there.
    """
    check_float_input(x, axis, "quantize_mxfp4")
    if not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"block_size={block_size!r} must be an even integer >= 2 (MXFP4 uses 32)")
    check_mx_options(scale_rule, rounding, max_scale_range)

    axis = axis % x.ndim
    xm = move_and_pad(x.float(), axis, block_size)  # [*outer, padded]
    blocks = xm.reshape(*xm.shape[:-1], -1, block_size)  # [*outer, nb, bs]
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    e = block_exponents(torch.where(finite, amax, torch.zeros_like(amax)), scale_rule)
    if max_scale_range is not None:
        row_max = torch.where(finite, e, torch.full_like(e, E8M0_MIN_EXP)).amax(dim=-1, keepdim=True)
        e = torch.maximum(e, row_max - max_scale_range)

    scaled = torch.ldexp(blocks, (-e).unsqueeze(-1).float())
    if scale_rule == "tseng":
        scaled = scaled * 0.75
    codes = encode_e2m1(scaled, rounding=rounding, generator=generator)
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    scales = torch.where(finite, encode_e8m0(e), torch.full_like(e, 255).to(torch.uint8))
    return MXTensor(
        codes=pack_e2m1(codes.flatten(-2)),
        scales=scales,
        shape=tuple(x.shape),
        axis=axis,
        block_size=block_size,
        elem_scale=4.0 / 3.0 if scale_rule == "tseng" else 1.0,
        scale_range=max_scale_range,
    )
