"""The autograd function of a converted linear layer: three GEMMs, each under its own spec.

    fprop:  Y  = X · Wᵀ     A = X   [T, K],  B = Wᵀ [K, N],  contract K
    dgrad:  ∇X = ∇Y · W     A = ∇Y  [T, N],  B = W  [N, K],  contract N
    wgrad:  ∇W = ∇Yᵀ · X    A = ∇Yᵀ [N, T],  B = X  [T, K],  contract T

X and W are saved already prepared (transformed + packed MXFP4) for the backward GEMM that
consumes them, unless that GEMM needs them in high precision (`DESIGN.md` §2).
"""

from __future__ import annotations

import torch

from ..gemm import draw_signs, gemm, multiply, prepare

__all__ = ["LowPrecisionLinearFn", "fprop", "forward_body", "backward_body"]


SALTS = {"fprop": 0, "dgrad": 1, "wgrad": 2}
"""Stream of each GEMM's signs drawn from the compiled-path seed (see :func:`adahop.gemm.draw_signs`);
layer ``i`` uses ``SALTS[g] + 3 * i``."""


def salt(layer, gemm: str) -> int:
    """The sign stream of ``gemm`` of ``layer`` (a :class:`~adahop.nn.LowPrecisionLinear`)."""
    return SALTS[gemm] + 3 * layer.layer_id


def fprop(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, spec, generator, backend: str,
          dtype: torch.dtype, seed: torch.Tensor | None = None, sign_salt: int = 0) -> torch.Tensor:
    """The layer's fprop ``Y = X·Wᵀ + bias``: ``x`` [T, K] and ``w`` [N, K] in ``dtype``, ``bias`` [N]
    or None, ``spec`` the fprop :class:`~adahop.recipes.spec.GemmSpec` or None (exactly
    ``nn.Linear``: the bias joins the GEMM's accumulation, one rounding), ``seed`` the compiled
    path's sign seed and ``sign_salt`` its stream (:func:`adahop.gemm.draw_signs`). Returns [T, N] in ``dtype``, a fresh tensor.
    Shared by training (:class:`LowPrecisionLinearFn`) and forward-only calls, which must agree.
    Source: the fprop of `DESIGN.md` §2 under the strategies of `specs/adahop.md` §3–§5.

    Raises:
        ValueError: from :func:`adahop.gemm.gemm`, for shapes or options ``spec`` cannot take."""
    b = None if bias is None else bias.to(dtype)
    if spec is None:
        return torch.nn.functional.linear(x, w, b)
    y = gemm(x, w.t(), spec, generator=generator, out_dtype=dtype, backend=backend, seed=seed, salt=sign_salt)
    return y if b is None else y + b


def _needs_hp_b(spec) -> bool:
    """B must stay high precision: a BF16 GEMM, or OE-Left (its A slab multiplies B exactly)."""
    return spec.strategy in ("bf16", "iht+oe_left")


class LowPrecisionLinearFn(torch.autograd.Function):
    """``y = x·wᵀ + bias`` with per-GEMM low-precision strategies; see the module docstring.

    Inputs: ``x`` [T, K] in the compute dtype, ``weight`` [N, K] (the master parameter, any float
    dtype), ``bias`` [N] or None, ``layer`` (the owning :class:`~adahop.nn.LowPrecisionLinear`,
    which resolves specs, generators and calibration), ``dtype`` (compute dtype), ``seed`` (None
    in eager mode; under torch.compile the 0-d int64 tensor the per-call signs are hashed from).
    Returns ``y`` [T, N], never a view (in-place ops on it work as on ``nn.Linear``'s output).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, layer, dtype, seed=None):
        y = forward_body(ctx, x, weight, bias, layer, dtype, seed)
        if ctx.specs is not None and bias is None and torch.compiler.is_compiling():
            # torch 2.11's dynamo (the GPU image's; not seen with 2.13 on the CPU) can return the
            # output tensor twice from the traced function and bind y's gradient to the later copy:
            # layer 0 of a compiled Llama then got no gradient (H200, round 5 and this round). A view
            # is a distinct output that keeps dY. Eager mode returns y itself, never a view.
            y = y.view_as(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return backward_body(ctx, dy)


def forward_body(ctx, x, weight, bias, layer, dtype, seed=None) -> torch.Tensor:
    """The forward of :class:`LowPrecisionLinearFn` on ``ctx`` (its autograd ctx, or the stand-in of
    the opaque compiled ops, :mod:`adahop.nn.opaque`): returns ``y`` [T, N] in ``dtype``, a fresh
    tensor, and leaves on ``ctx`` what :func:`backward_body` reads."""
    w = weight.to(dtype)
    ctx.layer, ctx.dtype = layer, dtype
    ctx.has_bias = bias is not None
    # what a BF16 nn.Linear saves for backward: X and the compute-dtype copy of W
    layer.hp_saved_bytes = (x.numel() + weight.numel()) * x.element_size()
    specs = layer.current_specs()
    if specs is None:  # calibration or a BF16 layer: exact GEMMs, patterns observed
        layer.observe("x", x)
        layer.observe("w", w)
        ctx.specs = None
        ctx.save_for_backward(x, weight)
        layer.saved_bytes = x.numel() * x.element_size()
        return fprop(x, w, bias, None, None, layer.backend, dtype)
    else:
        ctx.specs = specs
        y = fprop(x, w, bias, specs["fprop"], layer.generator("fprop"), layer.backend, dtype, seed, salt(layer, "fprop"))
        # save X for wgrad (B operand, contract T) and W for dgrad (B operand, contract N)
        wg, dg = specs["wgrad"], specs["dgrad"]
        gw, gd = layer.generator("wgrad"), layer.generator("dgrad")
        ctx.gens = (gd, gw)
        # drawn once here and saved: backward never draws them again (compiled: hashed from seed)
        ctx.signs_w = draw_signs(wg, gw, x.device, seed=seed, salt=salt(layer, "wgrad"))
        ctx.signs_d = draw_signs(dg, gd, x.device, seed=seed, salt=salt(layer, "dgrad"))
        # saved operands hold only the packed MXFP4 (4.25 bits/element; backward unpacks it straight
        # to FP8, `DESIGN.md` §3); the GEMMs' own operands only the FP8 fold
        ctx.x_prep = None if _needs_hp_b(wg) else prepare(x, "b", wg, signs=ctx.signs_w, generator=gw,
                                                          backend=layer.backend, outputs="codes")
        ctx.w_prep = None if _needs_hp_b(dg) else prepare(w, "b", dg, signs=ctx.signs_d, generator=gd,
                                                          backend=layer.backend, outputs="codes")
        ctx.save_for_backward(x if ctx.x_prep is None else None, weight)
        layer.saved_bytes = x.numel() * x.element_size() if ctx.x_prep is None else ctx.x_prep.nbytes
        if ctx.w_prep is not None:
            layer.saved_bytes += ctx.w_prep.nbytes
    return y


def backward_body(ctx, dy):
    """The backward of :class:`LowPrecisionLinearFn` from the ``ctx`` :func:`forward_body` filled:
    ``(dx, dw, grad_bias, None, None, None)``."""
    x, weight = ctx.saved_tensors
    layer, dtype, specs = ctx.layer, ctx.dtype, ctx.specs
    dy = dy.to(dtype)
    grad_bias = dy.sum(0).to(weight.dtype) if ctx.has_bias else None
    if specs is None:
        layer.observe("dy", dy)
        w = weight.to(dtype)
        dx = dy @ w  # dgrad
        dw = dy.t() @ x  # wgrad
        return dx, dw.to(weight.dtype), grad_bias, None, None, None

    if ctx.x_prep is None and x is None:  # only X's packed MXFP4 was saved, and the first backward freed it
        raise RuntimeError("adahop: a second backward through a converted layer (retain_graph=True) is not supported: "
                           "the first backward frees the saved MXFP4 copy of its input to save memory. Run the "
                           "forward again for each backward (double backward, create_graph=True, is not supported "
                           "either)")
    gd, gw = ctx.gens
    # operands not saved prepared (they need high precision) are prepared now, with the signs
    # drawn in forward, so both GEMMs always run as prepare(A) · saved-or-prepared(B)
    be = layer.backend
    w_prep = ctx.w_prep or prepare(weight.to(dtype), "b", specs["dgrad"], signs=ctx.signs_d, generator=gd, backend=be,
                                   outputs="fp8")
    x_prep = ctx.x_prep or prepare(x, "b", specs["wgrad"], signs=ctx.signs_w, generator=gw, backend=be, outputs="fp8")
    # dgrad: ∇X = ∇Y·W
    pa = prepare(dy, "a", specs["dgrad"], signs=ctx.signs_d, generator=gd, backend=be, outputs="fp8")
    dx = multiply(pa, w_prep, specs["dgrad"], out_dtype=dtype, backend=be)
    # wgrad: ∇W = ∇Yᵀ·X
    pa = prepare(dy.t(), "a", specs["wgrad"], signs=ctx.signs_w, generator=gw, backend=be, outputs="fp8")
    dw = multiply(pa, x_prep, specs["wgrad"], out_dtype=torch.float32, backend=be)
    ctx.x_prep = ctx.w_prep = None
    return dx, dw.to(weight.dtype), grad_bias, None, None, None
