"""The autograd function of a converted linear layer: three GEMMs, each under its own spec.

    fprop:  Y  = X · Wᵀ     A = X   [T, K],  B = Wᵀ [K, N],  contract K
    dgrad:  ∇X = ∇Y · W     A = ∇Y  [T, N],  B = W  [N, K],  contract N
    wgrad:  ∇W = ∇Yᵀ · X    A = ∇Yᵀ [N, T],  B = X  [T, K],  contract T

X and W are saved already prepared (transformed + packed MXFP4) for the backward GEMM that
consumes them, unless that GEMM needs them in high precision (`DESIGN.md` §2).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..gemm import check_outer, draw_signs, gemm, multiply, prepare

__all__ = ["LowPrecisionLinearFn", "fprop", "forward_body", "backward_body", "flatten", "unflatten"]


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


class _Slot:
    """Where a tensor was in a flattened structure: its index in the tensor list (a plain class: not walked by :func:`_map`)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


_FIELDS: dict[type, tuple[str, ...]] = {}  # field names per dataclass type, () for other types


def _field_names(tp: type) -> tuple[str, ...]:
    # cached per type: flatten/unflatten run at every forward and backward (eager host time)
    names = _FIELDS.get(tp)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(tp)) if dataclasses.is_dataclass(tp) else ()
        _FIELDS[tp] = names
    return names


_ATOMS = frozenset((type(None), bool, int, float, str, torch.dtype))
"""Types :func:`_map` keeps as they are without calling ``fn``: no tensor hides in them."""


def _map(obj, fn):
    """``obj`` rebuilt through its tuples, lists and dataclasses (copies), ``fn`` applied to every other
    value but atoms (:data:`_ATOMS`, kept as they are)."""
    if isinstance(obj, tuple):
        return tuple(_map(v, fn) for v in obj)
    if isinstance(obj, list):
        return [_map(v, fn) for v in obj]
    names = _field_names(type(obj))
    if names:
        if hasattr(obj, "__dict__"):  # a plain dataclass: a quicker shallow copy than copy.copy's
            new = object.__new__(type(obj))
            new.__dict__.update(obj.__dict__)
        else:
            new = copy.copy(obj)
        for name in names:
            v = getattr(obj, name)
            if type(v) not in _ATOMS:  # most fields are None or ints: skipping the call halves the eager host time here
                object.__setattr__(new, name, _map(v, fn))
        return new
    return obj if type(obj) in _ATOMS else fn(obj)


def flatten(obj, leaves: list):
    """``obj`` (tuples, lists and dataclasses such as :class:`~adahop.gemm.Prepared`) with every
    tensor replaced by a slot into ``leaves``, to which each distinct tensor object is appended once.
    The result holds no tensor; :func:`unflatten` puts them back."""
    seen: dict[int, int] = {}

    def slot(v):
        if not isinstance(v, torch.Tensor):
            return v
        if id(v) not in seen:
            seen[id(v)] = len(leaves)
            leaves.append(v)
        return _Slot(seen[id(v)])

    return _map(obj, slot)


def unflatten(tpl, leaves):
    """The inverse of :func:`flatten`: ``tpl`` with each slot replaced by its tensor of ``leaves``."""
    return _map(tpl, lambda v: leaves[v.index] if isinstance(v, _Slot) else v)


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
        if ctx.specs is None or not torch.is_grad_enabled():  # exact GEMMs (calibration, BF16): differentiable again
            return backward_body(ctx, dy)
        with torch.no_grad():
            grads = backward_body(ctx, dy)
        return _once_differentiable(grads, dy)


_TWICE = (b"adahop: a second derivative (create_graph=True) through a converted layer's low-precision backward: its "
          b"quantizers and FP8 GEMMs have no derivative autograd can take, so that term would be missing. Exclude the "
          b"layer from convert_model, or use the bf16 recipe, for gradient penalties or Hessian-vector products")


def _once_differentiable(grads: tuple, dy: torch.Tensor) -> tuple:
    """``grads`` as outputs that raise :data:`_TWICE` if autograd differentiates them (as
    ``torch.autograd.function.once_differentiable`` does): the second-order terms through a quantized backward were
    silently dropped (helper 65: ‖∂penalty/∂W‖ 1.92 against BF16's 8.86, no error)."""
    if not dy.requires_grad:
        return grads
    err = torch._C._functions.DelayedError(_TWICE, len(grads))

    def alias(g):
        if g is None:
            return None
        g = g.detach()
        g.requires_grad = True
        return g

    return err(*[alias(g) for g in grads])


def _saved_outputs(layer, spec) -> str:
    """What the quantizer writes of a B operand saved for ``spec``'s backward GEMM: the packed codes,
    or the FP8 fold where the recipe saves that and the operand has one (`Recipe.saved_operands`)."""
    return "fp8" if layer.recipe.saved_operands == "fp8" and spec.b.folds_to_fp8 else "codes"


def forward_body(ctx, x, weight, bias, layer, dtype, seed=None) -> torch.Tensor:
    """The forward of :class:`LowPrecisionLinearFn` on ``ctx`` (its autograd ctx, or the stand-in of
    the opaque compiled ops, :mod:`adahop.nn.opaque`): returns ``y`` [T, N] in ``dtype``, a fresh
    tensor, and leaves on ``ctx`` what :func:`backward_body` reads."""
    w = weight.to(dtype)
    ctx.layer, ctx.dtype = layer, dtype
    ctx.has_bias, ctx.bias_dtype = bias is not None, None if bias is None else bias.dtype
    # what a plain nn.Linear in this compute dtype saves for backward: X, and under autocast the cast copy of W
    # (without a cast it keeps a reference to the parameter itself, which costs nothing extra)
    layer.hp_saved_bytes = (x.numel() + (weight.numel() if weight.dtype != dtype else 0)) * dtype.itemsize
    specs = layer.current_specs()
    if specs is None:  # calibration or a BF16 layer: exact GEMMs, patterns observed
        layer.observe("x", x)
        layer.observe("w", w)
        ctx.specs = None
        ctx.save_for_backward(x, weight)
        layer.saved_bytes = 0 if layer.recompute_x else x.numel() * x.element_size()
        return fprop(x, w, bias, None, None, layer.backend, dtype)
    else:
        if not torch.compiler.is_compiling():  # (a traced graph's token count may be symbolic: its GEMM checks it)
            # HALO-2's token Hadamard on ∇Y needs a power-of-two token count: refused here, not in the backward after it
            check_outer(x.shape[0], specs["dgrad"].outer_a, 0, f"{layer.name}: dgrad's ∇Y [{x.shape[0]}, {weight.shape[0]}]")
        ctx.specs = specs
        y = fprop(x, w, bias, specs["fprop"], layer.generator("fprop"), layer.backend, dtype, seed, salt(layer, "fprop"))
        # save X for wgrad (B operand, contract T) and W for dgrad (B operand, contract N)
        wg, dg = specs["wgrad"], specs["dgrad"]
        gw, gd = layer.generator("wgrad"), layer.generator("dgrad")
        ctx.gens = (gd, gw)
        # drawn once here and saved: backward never draws them again (compiled: hashed from seed)
        signs_w = draw_signs(wg, gw, x.device, seed=seed, salt=salt(layer, "wgrad"))
        signs_d = draw_signs(dg, gd, x.device, seed=seed, salt=salt(layer, "dgrad"))
        # saved operands hold only the packed MXFP4 (4.25 bits/element; backward unpacks it straight
        # to FP8, `DESIGN.md` §3), or under recipe.saved_operands="fp8" only the fold; the GEMMs' own
        # operands only the FP8 fold
        # under selective recompute X is saved by reference and prepared in backward (adahop.nn.recompute)
        x_prep = None if _needs_hp_b(wg) or layer.recompute_x else prepare(x, "b", wg, signs=signs_w, generator=gw, backend=layer.backend,
                                                      outputs=_saved_outputs(layer, wg))
        w_prep = None if _needs_hp_b(dg) else prepare(w, "b", dg, signs=signs_d, generator=gd, backend=layer.backend,
                                                      outputs=_saved_outputs(layer, dg))
        # every tensor of them goes through save_for_backward, none stays on ctx: saved-tensor hooks
        # must see them all, or torch.utils.checkpoint (non-reentrant) kept them alive from forward
        # to backward as ctx attributes (a checkpointed layer held its whole packed X and W)
        leaves: list[torch.Tensor] = []
        state = (signs_w, signs_d, x_prep, w_prep)
        if torch.compiler.is_dynamo_compiling():
            # the traced form: torch 2.11's dynamo cannot trace flatten's dataclass walk ("Unsupported
            # hasattr call", H200 round 15) and a traced graph has no saved-tensor hooks to serve
            ctx.saved_state, ctx.live_state = None, state
        else:
            ctx.saved_state = flatten(state, leaves)
        ctx.save_for_backward(x if x_prep is None else None, weight, *leaves)
        # under recompute X is held by no one between forward and backward: the checkpoint recomputes it
        layer.saved_bytes = 0 if layer.recompute_x else x.numel() * x.element_size() if x_prep is None else x_prep.nbytes
        if w_prep is not None:
            layer.saved_bytes += w_prep.nbytes
    return y


def backward_body(ctx, dy):
    """The backward of :class:`LowPrecisionLinearFn` from the ``ctx`` :func:`forward_body` filled:
    ``(dx, dw, grad_bias, None, None, None)``."""
    x, weight, *leaves = ctx.saved_tensors
    layer, dtype, specs = ctx.layer, ctx.dtype, ctx.specs
    dy = dy.to(dtype)
    # in the bias's dtype (the opaque op's ctx records none: its output is the weight's dtype, as its fake says)
    grad_bias = dy.sum(0).to(getattr(ctx, "bias_dtype", None) or weight.dtype) if ctx.has_bias else None
    if specs is None:
        layer.observe("dy", dy)
        w = weight.to(dtype)
        dx = dy @ w  # dgrad
        dw = dy.t() @ x  # wgrad
        return dx, dw.to(weight.dtype), grad_bias, None, None, None

    live = ctx.saved_state is None  # forward_body's traced form kept the structure itself
    signs_w, signs_d, x_prep, w_prep = ctx.live_state if live else unflatten(ctx.saved_state, leaves)
    if getattr(ctx, "gen_states", None) is None:
        # the generators' states as forward left them, taken at the first backward (not in forward: a CPU generator's
        # state is 5 KB a call, held by every saved graph): a second backward of a retained graph draws the bits the
        # first drew, so a monitoring autograd.grad before loss.backward() changes no gradient (helper 65)
        # (not while a CUDA graph captures this backward: a graph replays its one backward, never a second)
        capturing = dy.is_cuda and torch.cuda.is_current_stream_capturing()
        ctx.gen_states = tuple(None if g is None or capturing else g.get_state() for g in ctx.gens)
    gd, gw = (g if s is None else _restarted(g, s) for g, s in zip(ctx.gens, ctx.gen_states))
    # operands not saved prepared (they need high precision) are prepared now, with the signs
    # drawn in forward, so both GEMMs always run as prepare(A) · saved-or-prepared(B)
    be = layer.backend
    if w_prep is None:
        w_prep = prepare(weight.to(dtype), "b", specs["dgrad"], signs=signs_d, generator=gd, backend=be, outputs="fp8")
    if x_prep is None:
        x_prep = prepare(x, "b", specs["wgrad"], signs=signs_w, generator=gw, backend=be, outputs="fp8")
    # dgrad: ∇X = ∇Y·W
    pa = prepare(dy, "a", specs["dgrad"], signs=signs_d, generator=gd, backend=be, outputs="fp8")
    dx = multiply(pa, w_prep, specs["dgrad"], out_dtype=dtype, backend=be)
    # wgrad: ∇W = ∇Yᵀ·X
    pa = prepare(dy.t(), "a", specs["wgrad"], signs=signs_w, generator=gw, backend=be, outputs="fp8")
    dw = multiply(pa, x_prep, specs["wgrad"], out_dtype=torch.float32, backend=be)
    return dx, dw.to(weight.dtype), grad_bias, None, None, None


def _restarted(g: torch.Generator, state: torch.Tensor) -> torch.Generator:
    """A new generator on ``g``'s device at ``state``: ``g`` itself keeps the state a first backward leaves."""
    new = torch.Generator(device=g.device)
    new.set_state(state)
    return new
