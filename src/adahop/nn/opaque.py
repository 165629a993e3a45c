"""A converted layer as two opaque ops under ``torch.compile`` (issue 18 item 4: cold compile).

Dynamo traces Python about a thousand times slower than CPython runs it, and a converted layer's
GEMMs are a lot of Python (specs, transforms, OE, quantizer and fold dispatch): a cold compile of
llama-125m AdaHOP-Lv2 on the H200 took 120.7 s against BF16's 26.4 s, with dynamo still tracing
the layers at 45 s (`docs/benchmarks_history.md`, round 9). Here, once the plan is frozen, the
compiled graph holds each layer as two ops instead of its traced GEMMs:

- ``adahop::lp_linear_fwd(x, weight, bias, layer, specs_version, dtype, seed) -> [y, *saved]`` (``specs_version``:
  :func:`specs_digest` of the layer's specs) runs the
  layer's fprop and prepares the backward operands (the very code of eager mode,
  :func:`adahop.nn.function.forward_body`); ``saved`` are the tensors of the prepared operands;
- ``adahop::lp_linear_bwd(dy, x, weight, saved, layer, dtype, has_bias) -> [dx, dw, dbias]``
  runs dgrad and wgrad (:func:`adahop.nn.function.backward_body`).

The fake impl of the forward op is its real body run on fake tensors, so a tensor that code
caches (a Hadamard block, the fold table) must be built outside the fake mode
(:func:`adahop.device_constants.on_device`), or a later real call would get a fake one.

The prepared operands are dataclasses (``Prepared``, ``MXTensor``...): their tensors travel as op
outputs and inputs, their structure (shapes, specs, flags) stays in a template on the Python side,
one per layer and token count (written by each real forward, read by its backward). Under
``mode="reduce-overhead"`` both ops are replayed from the CUDA graph like any kernel; in the
default mode they run their Python per call, as eager mode does. Random bits inside the ops come from the default generator, which the
training loop seeds per step (:func:`adahop.nn.seed_compiled_rng`), and the per-call signs from
the compiled path's seed tensor, as in a traced layer.

:data:`COMPILED_LAYERS` (``"auto"``, ``"opaque"`` or ``"traced"``, :func:`set_compiled_layers`) picks this
form or dynamo tracing of the layer's GEMMs; both compute the same numbers (same kernels, same
draws' distribution). ``"auto"``, the default, is the opaque form for every layer. It traced the
layers whose GEMMs were long chains of plain PyTorch ops (:func:`unfused_parts`: NVFP4, Averis) until
round 13 (H200, 2026-12-02, `docs/benchmarks_history.md#round-13`): traced, a llama-60m nvfp4 model's
cold compile did not reach step 1 in 240 s, since Inductor then compiles ~400 ops per layer and
direction. The NVFP4 quantizer has since become a fused kernel (`adahop.kernels.iht_quantize_nvfp4`).
``"traced"`` stays available by name.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import weakref

import torch

from .function import _needs_hp_b, backward_body, forward_body

__all__ = ["COMPILED_LAYERS", "FORMS", "set_compiled_layers", "unfused_parts", "layer_form", "register", "lp_linear",
           "in_opaque_layer", "specs_digest"]

#: The forms :data:`COMPILED_LAYERS` takes.
FORMS = ("auto", "opaque", "traced")
#: How ``torch.compile`` sees a frozen converted layer: ``"opaque"`` (the ops above), ``"traced"``, or
#: ``"auto"`` (the default: per layer, :func:`layer_form`); the environment variable
#: ``ADAHOP_COMPILED_LAYERS`` sets it for a process (and its children).
COMPILED_LAYERS = os.environ.get("ADAHOP_COMPILED_LAYERS", "auto")
if COMPILED_LAYERS not in FORMS:
    raise ValueError(f"ADAHOP_COMPILED_LAYERS={COMPILED_LAYERS!r}: use 'auto', 'opaque' or 'traced'")

_LAYERS: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()
# (layer key, tokens, weight dtype, compute dtype) -> the saved state's structure, tensors as _Slot
_TEMPLATES: dict[tuple, object] = {}
# the same key -> the shapes of the saved tensors the fake run returned (what the compiled graph expects)
_FAKE_SHAPES: dict[tuple, list[tuple[int, ...]]] = {}
_STATE = threading.local()


def set_compiled_layers(how: str) -> str:
    """Set :data:`COMPILED_LAYERS` for graphs traced from now on; returns the previous value.

    Raises:
        ValueError: ``how`` is not ``"auto"``, ``"opaque"`` or ``"traced"``.
    """
    global COMPILED_LAYERS
    if how not in FORMS:
        raise ValueError(f"compiled converted layers are 'auto', 'opaque' or 'traced', got {how!r}")
    prev, COMPILED_LAYERS = COMPILED_LAYERS, how
    return prev


def unfused_parts(specs: dict) -> tuple[str, ...]:
    """The parts of a frozen layer's GEMMs (``specs``: GEMM name -> resolved
    :class:`~adahop.recipes.spec.GemmSpec`) that run as long chains of small plain-PyTorch ops
    where the other recipes run one fused quantizer launch per operand: Averis's mean vectors in
    MXFP4 (``mean_split="inner"``), fake-quantized by the reference quantizer. Empty for mxfp4,
    quartet, tseng, HALO, AdaHOP, nvfp4 and Averis-in-NVFP4 layers.

    Inside an opaque op such a chain runs op by op, as in eager mode, and ``reduce-overhead``
    replays every op as its own kernel. Before the NVFP4 quantizer was a fused kernel
    (`adahop.kernels.iht_quantize_nvfp4`), one nvfp4 layer's forward and backward ran 410 ops and
    an averis layer 624, against 10 Triton launches and 19 ops (3 of them GEMMs) for quartet; with
    it, nvfp4 runs 12 launches and 36 ops, averis 16 and 90, averis-mxfp4 still 220 ops
    (`scripts/count_layer_ops.py`, CPU). Traced instead, the 410 ops of nvfp4 kept the cold
    compile of llama-60m past 240 s on the H200. HALO's whole-dimension Hadamards (Kronecker GEMMs
    above 256) are not listed: a few GEMMs per operand, not a chain."""
    parts = []
    for g, s in specs.items():
        if s.strategy == "bf16":
            continue
        if s.mean_split == "inner" and "mxfp4" in (s.a.fmt, s.b.fmt):
            parts.append(f"{g}: MXFP4 mean vectors (reference quantizer)")
    return tuple(parts)


def layer_form(specs: dict, how: str | None = None) -> str:
    """``"opaque"`` or ``"traced"``: how ``torch.compile`` sees a frozen layer of these ``specs``
    under ``how`` (default :data:`COMPILED_LAYERS`). ``"auto"`` is ``"opaque"`` for every layer:
    tracing the :func:`unfused_parts` chains made cold compiles too slow to use (module docstring).
    ``specs`` is kept in the signature so a per-layer rule can return without changing callers."""
    how = COMPILED_LAYERS if how is None else how
    return "opaque" if how == "auto" else how


def specs_digest(specs: dict | None, backend: str, recompute_x: bool = False) -> int:
    """A 56-bit digest of a layer's resolved GEMM specs (GEMM name -> ``GemmSpec``, or None), backend
    and ``recompute_x`` (X saved by reference, :mod:`adahop.nn.recompute`): what the opaque ops' saved
    tensors depend on besides the shapes and dtypes the graph already holds. The ops take it as a
    constant, so it keys dynamo's guards and Inductor's caches."""
    text = repr((backend, None if specs is None else sorted(specs.items()))) + ("+x" if recompute_x else "")
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def in_opaque_layer() -> bool:
    """True inside the ops' bodies: the layer then draws as compiled code does (no per-call Generator)."""
    return getattr(_STATE, "depth", 0) > 0


class _Inside:
    def __enter__(self):
        _STATE.depth = getattr(_STATE, "depth", 0) + 1

    def __exit__(self, *exc):
        _STATE.depth -= 1


class _Ctx:
    """What :func:`forward_body` / :func:`backward_body` read and write of an autograd ctx."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _layer(key: int):
    layer = _LAYERS.get(key)
    if layer is None:
        raise RuntimeError(f"adahop: compiled graph refers to converted layer #{key}, which no longer exists; "
                           "compile the model again (torch.compiler.reset())")
    return layer


def _fwd_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int, specs_version: int,
              dtype: torch.dtype, seed: torch.Tensor | None) -> list[torch.Tensor]:
    return _forward(x, weight, bias, layer, specs_version, dtype, seed, record=True)


def _forward(x, weight, bias, layer, specs_version, dtype, seed, record: bool) -> list[torch.Tensor]:
    mod = _layer(layer)
    if mod._specs_version != specs_version:
        raise RuntimeError(f"adahop: {mod.name}'s GEMM specs changed after the model was compiled (a new plan); "
                           "call torch.compiler.reset() and compile it again")
    ctx = _Ctx()
    counts = (mod.saved_bytes, getattr(mod, "hp_saved_bytes", 0))
    with _Inside():
        y = forward_body(ctx, x, weight, bias, mod, dtype, seed)
    if not record:  # the fake run: the layer's byte counts stay those of real calls (fake sizes may be symbolic)
        mod.saved_bytes, mod.hp_saved_bytes = counts
    # forward_body saved (x or None, weight, *the prepared operands' tensors) and left their structure on ctx
    leaves = list(ctx.saved_tensors[2:])
    tpl = (ctx.specs, ctx.saved_state)  # the specs hold no tensor
    key = (layer, x.shape[0], weight.dtype, dtype)
    if record:  # real calls only: fake shapes may be symbolic; one template per token count
        _TEMPLATES[key] = tpl
        _check_fake_shapes(mod, key, leaves)
    elif all(isinstance(d, int) for t in leaves for d in t.shape) and isinstance(x.shape[0], int):
        _FAKE_SHAPES[key] = [tuple(t.shape) for t in leaves]
    # an op's outputs may alias neither its inputs nor each other (views of one buffer): copy those
    out = [y]
    for t in leaves:
        if any(torch._C._is_alias_of(t, u) for u in (x, weight, *out)):
            t = t.clone()
        out.append(t)
    return out


def _check_fake_shapes(mod, key, leaves) -> None:
    """The real call must return the saved tensors the fake run promised the compiled graph (their
    number, order and shapes); say which differ, instead of Inductor's bare size assertion."""
    want = _FAKE_SHAPES.get(key)
    got = [tuple(t.shape) for t in leaves]
    if want is not None and want != got:
        diff = [(i, w, g) for i, (w, g) in enumerate(zip(want, got)) if w != g][:4]
        raise RuntimeError(f"adahop: {mod.name}: the compiled graph expects {len(want)} saved tensors from the opaque "
                           f"forward and the real call returned {len(got)}; first differences (index, fake, real): {diff}. "
                           "This is a bug of adahop.nn.opaque; run with ADAHOP_COMPILED_LAYERS=traced meanwhile")


# nondeterministic_seeded: stochastic rounding draws from the default generator inside the op, so
# nothing may recompute it
_fwd = torch.library.custom_op("adahop::lp_linear_fwd", _fwd_impl, mutates_args=(),
                               tags=(torch.Tag.nondeterministic_seeded,))


@_fwd.register_fake
def _(x, weight, bias, layer, specs_version, dtype, seed):
    # the real body on fake tensors (the kernels' launches do nothing there): the same outputs'
    # shapes and dtypes. The body also meets real constants (cached Hadamard blocks, sign
    # tables), which the fake mode then takes as they are
    mode = torch._guards.detect_fake_mode((x, weight))
    prev = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        return _forward(x, weight, bias, layer, specs_version, dtype, seed, record=False)
    finally:
        mode.allow_non_fake_inputs = prev


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, saved: list[torch.Tensor], layer: int,
              dtype: torch.dtype, has_bias: bool) -> list[torch.Tensor]:
    ctx = _Ctx()
    ctx.layer, ctx.dtype, ctx.has_bias, ctx.gens = _layer(layer), dtype, has_bias, (None, None)
    tpl = _TEMPLATES[(layer, int(dy.shape[0]), weight.dtype, dtype)]  # the forward of this token count
    ctx.specs, ctx.saved_state = tpl
    ctx.saved_tensors = (x, weight, *saved)
    with _Inside():
        dx, dw, db = backward_body(ctx, dy)[:3]
    return [dx, dw] + ([db] if db is not None else [])


_bwd = torch.library.custom_op("adahop::lp_linear_bwd", _bwd_impl, mutates_args=(),
                               tags=(torch.Tag.nondeterministic_seeded,))


@_bwd.register_fake
def _(dy, x, weight, saved, layer, dtype, has_bias):
    n, k = weight.shape
    out = [dy.new_empty(dy.shape[0], k, dtype=dtype), weight.new_empty(n, k)]
    return out + ([weight.new_empty(n)] if has_bias else [])


def _setup(ctx, inputs, output):
    x, weight, bias, layer, specs_version, dtype, seed = inputs
    mod = _layer(layer)
    x_saved = mod.recompute_x or _needs_hp_b(mod._specs["wgrad"])  # no prepared X: wgrad takes X itself
    ctx.layer, ctx.dtype, ctx.has_bias = layer, dtype, bias is not None
    ctx.save_for_backward(x if x_saved else None, weight, *output[1:])


def _backward(ctx, grads):
    x, weight, *saved = ctx.saved_tensors
    out = torch.ops.adahop.lp_linear_bwd(grads[0], x, weight, saved, ctx.layer, ctx.dtype, ctx.has_bias)
    return out[0], out[1], (out[2] if ctx.has_bias else None), None, None, None, None


torch.library.register_autograd("adahop::lp_linear_fwd", _backward, setup_context=_setup)


def register(layer) -> int:
    """Give ``layer`` the key the ops find it by (its ``_op_key``; called when it is built or copied,
    never while tracing). Keys count up in the order layers are built, so that the same script in
    another process bakes the same keys into its graphs (Inductor's caches then hit), and two live
    models never share one."""
    layer._op_key = next(_KEYS)
    _LAYERS[layer._op_key] = layer
    return layer._op_key


def lp_linear(layer, x: torch.Tensor, dtype: torch.dtype, seed: torch.Tensor | None) -> torch.Tensor:
    """``layer`` (a frozen :class:`~adahop.nn.LowPrecisionLinear`, :func:`register` ed) on ``x``
    [T, K] through the opaque ops; returns ``y`` [T, N] in ``dtype``. Used under ``torch.compile``
    (issue 18 item 4; the GEMMs are those of :class:`~adahop.nn.LowPrecisionLinearFn`).

    Raises (when the op runs):
        RuntimeError: the layer no longer exists, or its specs changed since the graph was traced.
    """
    # the specs' digest is a constant of the graph, so dynamo guards on it: a new plan recompiles
    return torch.ops.adahop.lp_linear_fwd(x, layer.weight, layer.bias, layer._op_key, layer._specs_version, dtype, seed)[0]
