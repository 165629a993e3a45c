"""MXFP4 linear layers emulated the two ways Hopper allows without FP4 tensor cores: the baselines
that `adahop bench linear` compares the FP8-folded fast path with (`DESIGN.md` §4: "≥ 3× faster
than MXFP4 emulated by dequantize-to-BF16 and by ``tl.dot_scaled``").

- ``"dequant-bf16"`` (torchao-style): each operand quantized, dequantized to BF16 by a Triton
  cast, then a BF16 cuBLAS GEMM.
- ``"dot_scaled"``: Triton ``tl.dot_scaled`` on the packed E2M1 codes and E8M0 scales.

Both quantize with adahop's Triton quantizer (codes only; plain MXFP4: no transform, round to
nearest, OCP floor scale rule, no scale-range limit), each GEMM along its contracted dimension,
and save X and W for backward as MXFP4 (the bytes the fast path's plain recipe saves). CUDA (or
the Triton interpreter) only; shapes multiples of 128.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["EmulatedMXLinear", "EMULATIONS"]

EMULATIONS = ("dequant-bf16", "dot_scaled")


def _quantize(t: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of ``t`` [R, C] along ``axis``: (codes [rows, kp/2], E8M0 scales [rows, kp/32]), rows = the other dim."""
    from ..kernels._triton_quantize import mx_quantize

    codes, scales, _, _ = mx_quantize(t, axis, 0, None, False, "floor", -1, None, True, False)
    return codes, scales


def _mm(a, b, how: str, out_dtype: torch.dtype) -> torch.Tensor:
    """``A·Bᵀ`` for MXFP4 A [M, kp] and B [N, kp] given as (codes, scales)."""
    from ._triton_baselines import dequant_bf16, dot_scaled_mm

    if how == "dot_scaled":
        return dot_scaled_mm(*a, *b, out_dtype=out_dtype)
    return (dequant_bf16(*a) @ dequant_bf16(*b).t()).to(out_dtype)


def _fprop(x: torch.Tensor, w: torch.Tensor, how: str) -> torch.Tensor:
    """``X·Wᵀ`` [T, N] in ``x``'s dtype, both operands quantized along K."""
    return _mm(_quantize(x, 1), _quantize(w, 1), how, x.dtype)


class _EmulatedMXFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer):
        w = weight.to(x.dtype)
        y = _fprop(x, w, layer.how)
        ctx.x_t, ctx.w_n = _quantize(x, 0), _quantize(w, 0)  # X along T (wgrad), W along N (dgrad)
        ctx.layer, ctx.wdtype = layer, weight.dtype
        layer.saved_bytes = sum(t.numel() for t in (*ctx.x_t, *ctx.w_n))  # uint8 tensors
        return y

    @staticmethod
    def backward(ctx, dy):
        how = ctx.layer.how
        dy = dy.contiguous()
        dx = _mm(_quantize(dy, 1), ctx.w_n, how, dy.dtype)  # dgrad: ∇Y·W, along N
        dw = _mm(_quantize(dy, 0), ctx.x_t, how, torch.float32)  # wgrad: ∇Yᵀ·X, along T
        return dx, dw.to(ctx.wdtype), None


class EmulatedMXLinear(nn.Module):
    """A bias-free ``nn.Linear`` whose three GEMMs run as MXFP4 emulated by ``how`` (see the module
    docstring). Input ``[..., in_features]``; the GEMMs run in the autocast dtype when autocast is
    on, else in the input's dtype. ``saved_bytes``: what the last training forward saved (a
    forward without gradients saves nothing and leaves it).

    Raises:
        ValueError: an unknown ``how``, or a linear with a bias."""

    def __init__(self, linear: nn.Linear, how: str):
        super().__init__()
        if how not in EMULATIONS:
            raise ValueError(f"EmulatedMXLinear: how={how!r}; choose one of {EMULATIONS}")
        if linear.bias is not None:
            raise ValueError("EmulatedMXLinear: the benchmark baseline takes bias-free linears")
        self.weight, self.how, self.saved_bytes = linear.weight, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if torch.is_grad_enabled() and (x2.requires_grad or self.weight.requires_grad):
                y = _EmulatedMXFn.apply(x2, self.weight, self)
            else:  # no backward: the fprop alone, nothing saved
                y = _fprop(x2, self.weight.to(dtype), self.how)
        return y.reshape(*x.shape[:-1], y.shape[-1])
