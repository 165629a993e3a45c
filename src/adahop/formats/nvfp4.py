"""NVFP4 (NVIDIA): blocks of 16 E2M1 elements with an E4M3 block scale and an FP32 tensor scale.

Semantics follow TransformerEngine's reference recipe (`specs/baselines.md` §1.7, §2.4):
``value = q · s_block · s_global`` with ``s_global = amax_tensor / (448 · 6)`` and
``s_block = E4M3(amax_block / 6 / s_global)``. Weights may use 16×16 2-D tiles so that the row-wise
and column-wise quantized weights are identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .common import check_float_input, move_and_pad, unpad_and_restore
from .e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1

__all__ = ["NVFP4Tensor", "quantize_nvfp4", "E4M3_MAX", "KEPT_SCALE_MARGIN"]

E4M3_MAX = 448.0
NVFP4_BLOCK = 16
#: Relative margin on the bounds within which a stored block scale is kept (``block_scales``): a stored maximum of
#: exactly 6 (or 3) steps of its scale reads back a few FP32 ulps off it (6.0000005), and without the margin
#: stochastic rounding re-derived the scale and re-rounded the whole block at random, so a step of zero moved
#: weights (helper 66); a value up to 6·(1 + margin) rounds to 6, a bias below any ulp of it.
KEPT_SCALE_MARGIN = 2.0**-20


@dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """A tensor quantized to NVFP4.

    Attributes:
        codes: uint8 ``[*outer, padded_len // 2]``, packed E2M1 (even index in the low nibble),
            quantized axis moved last and zero-padded to a multiple of 16.
        scales: float8_e4m3fn ``[*outer, padded_len // 16]``: the block decode scales (for 2-D
            tiles each row repeats the scale of its 16×16 tile).
        global_scale: float32 scalar tensor, the per-tensor decode scale.
        shape, axis: original shape and blocked axis (non-negative).
        tile_2d: whether the scales come from 16×16 tiles.
        values: optional bfloat16 ``[*outer, padded_len]``: ``q · s_block`` (exact in BF16), the NVFP4
            GEMM's operand, written by the fused quantizer (`adahop.kernels.iht_quantize_nvfp4`);
            ``None`` elsewhere. An operand the GEMM consumes at once may hold only this form:
            ``codes`` is then ``[*outer, 0]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, ...]
    axis: int
    tile_2d: bool = False
    block_size: int = NVFP4_BLOCK
    values: torch.Tensor | None = field(default=None, repr=False)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values in ``dtype``, original ``shape``, padding removed.

        Raises:
            ValueError: a values-only tensor (``codes`` ``[*outer, 0]``) whose ``values`` were dropped.
        """
        s = self.scales.float().unsqueeze(-1)
        if self.codes_dropped:
            if self.values is None:
                raise ValueError("NVFP4Tensor holds neither E2M1 codes nor values; quantize with outputs='all'")
            v = self.values.float().reshape(*self.values.shape[:-1], -1, self.block_size)
            q = torch.where(s == 0, 0.0, v / s)  # exact: v = q · s_block; so the same FP32 product as from codes
        else:
            q = decode_e2m1(unpack_e2m1(self.codes))
            q = q.reshape(*q.shape[:-1], -1, self.block_size)
        x = q * (s * self.global_scale)
        return unpad_and_restore(x.flatten(-2), self.shape, self.axis).to(dtype)

    @property
    def codes_dropped(self) -> bool:
        """True when only the BF16 values were written (``codes`` ``[*outer, 0]`` of a non-empty tensor)."""
        return self.codes.shape[-1] == 0 and self.scales.shape[-1] > 0

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes, one byte per block scale, 4 bytes of tensor scale, plus the BF16
        values when present."""
        n = self.codes.numel() + self.scales.numel() + 4
        return n + (2 * self.values.numel() if self.values is not None else 0)


def _e4m3_round_up(s: torch.Tensor) -> torch.Tensor:
    """The smallest E4M3 value >= s (s in [0, 448]), as float32."""
    rn = s.to(torch.float8_e4m3fn)
    below = rn.float() < s
    nxt = (rn.view(torch.uint8) + 1).view(torch.float8_e4m3fn)  # next code up (positive values)
    return torch.where(below, nxt.float(), rn.float())


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    axis: int = -1,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    tile_2d: bool = False,
    global_scale: torch.Tensor | None = None,
    block_scales: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 with blocks of 16 along ``axis`` (or 16×16 tiles).

    Args:
        x: float32/float16/bfloat16/float64 tensor (float64 is rounded to float32 first); 2-D when ``tile_2d``.
        axis: blocked axis (the GEMM's contracted dimension); zero-padded per row to 16.
        rounding: ``"nearest"`` (half-to-even) or ``"stochastic"``. Under stochastic rounding the
            block scale is rounded *up* to E4M3 so the block maximum never exceeds 6 and nothing
            clips (round-to-nearest of the scale can land 2^-4 low and clip, which biases SR:
            `specs/baselines.md` §1.7).
        generator: source of stochastic-rounding bits.
        tile_2d: one scale per 16×16 tile (NVIDIA's weight recipe).
        global_scale: the FP32 tensor scale to use (a positive scalar tensor, at least
            t_amax/2688 so no block scale exceeds 448) instead of t_amax/2688: a master weight
            re-packed every step keeps its tensor scale (`adahop.optim.master.pack`).
        block_scales: with ``global_scale``, the E4M3 block scales a master weight holds (the
            :attr:`NVFP4Tensor.scales` of its last write, along ``axis``): a block keeps its scale
            ``s`` while its new amax is within [3, 7)·s·global_scale ([3, 6] under stochastic
            rounding, where nothing may clip): the binade below the top, as an MXFP4 scale holds
            it. A write moving no element by half an ulp (half of 6 − 4 at the block maximum) then
            changes nothing; re-rounding the scale from each write's amax re-rounded every element
            of the block, and under SR churned a quarter of the scales per step. Other blocks take
            the rule above.

    Returns:
        An :class:`NVFP4Tensor`. A block with NaN/Inf decodes to NaN; an all-zero tensor gets
        tensor scale 1 and decodes to zeros.

    Raises:
        TypeError: non-floating ``x``. ValueError: empty axis, bad rounding, ``tile_2d`` on a
            tensor that is not 2-D, a ``global_scale`` that is not one positive number,
            ``block_scales`` without ``global_scale``, with ``tile_2d``, or not of the blocks' shape.
    """
    check_float_input(x, axis, "quantize_nvfp4")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding={rounding!r} is not supported; use 'nearest' or 'stochastic'")
    if tile_2d and x.ndim != 2:
        raise ValueError(f"tile_2d=True needs a 2-D tensor (a weight), got shape {tuple(x.shape)}")
    if global_scale is not None and (global_scale.numel() != 1 or not bool(global_scale.reshape(()) > 0)):
        raise ValueError(f"global_scale must be one positive number, got {global_scale!r}; pass None to derive it")
    axis = axis % x.ndim
    xm = move_and_pad(x.float(), axis, NVFP4_BLOCK)  # [*outer, padded]
    blocks = xm.reshape(*xm.shape[:-1], -1, NVFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)  # [*outer, nb], NaN/Inf propagate
    if tile_2d:
        rows = amax.shape[0]
        pad = (-rows) % NVFP4_BLOCK
        tiles = F.pad(amax, (0, 0, 0, pad)).reshape(-1, NVFP4_BLOCK, amax.shape[1]).amax(dim=1)
        amax = tiles.repeat_interleave(NVFP4_BLOCK, dim=0)[:rows]
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, torch.zeros_like(amax))
    t_amax = amax.max()
    # Divide by 0-dim tensors on x's device, never by Python numbers: CUDA turns `t / number` into
    # `t · (1/number)`, one ulp off IEEE division at times (the Triton quantizer's div_rn).
    s_global = torch.where(t_amax > 0, t_amax / t_amax.new_full((), E4M3_MAX * E2M1_MAX), torch.ones_like(t_amax))
    # A tensor amax below 2688·2^-150 underflows s_global to 0, and 0/0 below would make NaN scales;
    # keep it at least the smallest FP32 subnormal (this changes no s_global that was positive).
    s_global = s_global.clamp(min=2.0**-149)
    if global_scale is not None:
        s_global = global_scale.to(device=s_global.device, dtype=torch.float32).reshape(())
    s_exact = (amax / amax.new_full((), E2M1_MAX) / s_global).clamp(max=E4M3_MAX)
    if rounding == "stochastic":
        s_block = _e4m3_round_up(s_exact)
    else:
        s_block = s_exact.to(torch.float8_e4m3fn).float()
    if block_scales is not None:
        if global_scale is None or tile_2d or tuple(block_scales.shape) != tuple(s_block.shape):
            raise ValueError(f"block_scales (shape {tuple(block_scales.shape)}) must come with global_scale, without "
                             f"tile_2d, one per block of 16 along the axis ({tuple(s_block.shape)})")
        prev = block_scales.to(device=s_block.device).float()
        ratio = amax / (prev * s_global)  # where the block maximum falls on the kept scale's E2M1 grid
        tol = KEPT_SCALE_MARGIN
        fits = ratio <= 6.0 * (1 + tol) if rounding == "stochastic" else ratio < 7.0  # SR must not clip; up to 7 rounds to 6
        keep = (prev > 0) & torch.isfinite(prev) & (ratio >= 3.0 * (1 - tol)) & fits
        s_block = torch.where(keep, prev, s_block)
    denom = (s_block * s_global).unsqueeze(-1)
    scaled = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(blocks))
    codes = encode_e2m1(scaled, rounding=rounding, generator=generator)
    nan = torch.full_like(s_block, float("nan"))
    scales = torch.where(finite, s_block, nan).to(torch.float8_e4m3fn)
    return NVFP4Tensor(
        codes=pack_e2m1(codes.flatten(-2)),
        scales=scales,
        global_scale=s_global,  # float32 already (xm is): a no-op .float() alias breaks torch.compile capture
        shape=tuple(x.shape),
        axis=axis,
        tile_2d=tile_2d,
    )
