"""The fused optimizer update of one tensor: reference and Triton twins (`DESIGN.md` §2 layer 5).

One elementwise pass reads the master weight ``w`` (FP32 or BF16), its gradient ``g`` and the
optimizer states (FP32 or BF16), computes the update in FP32, rounds once to each storage dtype and
writes everything back in place. The algorithms (``ALGORITHMS``; `specs/related_methods.md` §3):

- ``adamw``: AdamW with decoupled weight decay (Loshchilov & Hutter), states ``exp_avg``,
  ``exp_avg_sq``; the master update is rounded to nearest-even or stochastically;
- ``kahan``: the same step added with Kahan compensation: ``y = Δ + c``, ``w' = round(w + y)``,
  ``c' = y − (w' − w)`` (extra state ``comp``);
- ``madam-arxiv``: M+Adam as the arXiv Algorithm 1 is read by a third party (spec §3.2 B):
  ``w' = (1 − η_a λ) w + w·u_e/ρ − η_a m̂/(√v̂ + ε)`` with ``u_e = −η_mul g_e/(√v̂_e + ε)``,
  ``g_e = ln2·w·g``, ``ρ = sign0(w)·max(|w|, τ)`` (states ``exp_avg``, ``exp_avg_sq``, ``exp_avg_sq_e``);
- ``madam-arxiv-relative``: the same with the multiplicative term ``ln2·ρ·u_e`` (spec §3.2, "[Ours]
  dimensional warning": a step proportional to ``|w|``, floored at τ);
- ``madam-workshop``: the workshop's mantissa–exponent form (spec §3.2 A): ``w = m·2^e`` with
  ``2^e = 2^⌊log2 max(|w|, τ)⌋``, Adam on ``g_m = 2^e g`` and on ``g_e = ln2·w·g`` (four states),
  each normalized step clamped to ``±cap``; ``w' = ((1 − η λ) m − η r_m)·2^e · 2^(−η_mul r_e)``,
  clamped to ``±w_max``.

Bit-exactness of the twins: the reference uses only correctly rounded FP32 operations (``*``, ``+``,
``-``, ``/``, ``sqrt``) in the kernel's order, every scalar is an FP32 value computed once on the
host (:func:`step_scalars`), the kernel uses ``div_rn``/``sqrt_rn`` and is compiled without FMA
contraction, ``2^y`` is the same Horner polynomial in both, and stochastic rounding takes 16 bits of
Philox(key ``seed``, counter ``(index, stream, 0, 0)``) (:func:`adahop.kernels.philox.philox_randint`
reproduces Triton's ``philox``): ``index`` is the element's flat index in its tensor, ``stream`` a
number per tensor (the optimizer passes the parameter's index), so one seed per step serves every
tensor of a launch.

:func:`optim_step_multi` updates a list of tensors in one launch (a table of their addresses; the
per-tensor launches of :func:`optim_step` were host-bound); its results are those of
:func:`optim_step` on each tensor with its stream, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .backend import resolve_backend
from .exp2_poly import EXP_COEFFS, LN2
from .philox import philox_randint

__all__ = ["ALGORITHMS", "ROUNDINGS", "STATE_NAMES", "StepScalars", "step_scalars", "optim_update", "round_bf16",
           "optim_step", "optim_step_reference", "optim_step_triton", "optim_step_multi", "MultiTensorStep",
           "bit_mismatches", "bit_mismatches_multi", "LN2"]

#: The update rules, with the names of their state buffers (in kernel argument order).
STATE_NAMES: dict[str, tuple[str, ...]] = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "kahan": ("exp_avg", "exp_avg_sq", "comp"),
    "madam-arxiv": ("exp_avg", "exp_avg_sq", "exp_avg_sq_e"),
    "madam-arxiv-relative": ("exp_avg", "exp_avg_sq", "exp_avg_sq_e"),
    "madam-workshop": ("exp_avg_m", "exp_avg_sq_m", "exp_avg_e", "exp_avg_sq_e"),
}
ALGORITHMS = tuple(STATE_NAMES)
ALG_IDS = {a: i for i, a in enumerate(ALGORITHMS)}
ROUNDINGS = ("nearest", "stochastic")


def _f32(v: float) -> float:
    return float(np.float32(v))


@dataclass(frozen=True)
class StepScalars:
    """The per-step constants of an update, each already an FP32 value (a Python float).

    ``b1, omb1, b2, omb2``: β1, 1−β1, β2, 1−β2; ``eps``; ``decay = 1 − lr·λ``; ``wdlr = lr·λ``;
    ``step_size = lr / (1 − β1^t)``; ``rbc1 = 1 / (1 − β1^t)``; ``rsbc2 = 1 / √(1 − β2^t)``;
    ``lr``; ``mul_lr`` (η_mul of the multiplicative branch); ``tau``; ``cap`` (largest |normalized
    step| of the workshop form, inf: none); ``w_max`` (inf: none).
    """

    lr: float
    b1: float
    omb1: float
    b2: float
    omb2: float
    eps: float
    decay: float
    wdlr: float
    step_size: float
    rbc1: float
    rsbc2: float
    mul_lr: float
    tau: float
    cap: float
    w_max: float


def step_scalars(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 mul_lr: float = 0.0, tau: float = 1e-6, cap: float = math.inf, w_max: float = math.inf) -> StepScalars:
    """The FP32 constants of optimizer step ``step`` (1 for the first), computed in float64 once.

    Raises:
        ValueError: ``step < 1``, β outside [0, 1), non-positive ``eps``, ``tau`` or ``cap``.
    """
    if step < 1:
        raise ValueError(f"step={step} must be >= 1 (the first update is step 1)")
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"betas=({beta1}, {beta2}) must be in [0, 1)")
    if not (eps > 0 and tau > 0 and cap > 0):
        raise ValueError(f"eps={eps}, tau={tau} and cap={cap} must be > 0")
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    return StepScalars(lr=_f32(lr), b1=_f32(beta1), omb1=_f32(1 - beta1), b2=_f32(beta2), omb2=_f32(1 - beta2),
                       eps=_f32(eps), decay=_f32(1 - lr * weight_decay), wdlr=_f32(lr * weight_decay),
                       step_size=_f32(lr / bc1), rbc1=_f32(1 / bc1), rsbc2=_f32(1 / math.sqrt(bc2)), mul_lr=_f32(mul_lr),
                       tau=_f32(tau), cap=_f32(cap), w_max=_f32(w_max))


# ----------------------------------------------------------------------------- reference


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 square root (torch's vectorized CPU sqrt is not; float64 then one
    rounding is, since 53 >= 2·24 + 2)."""
    return torch.sqrt(x.double()).float()


def _exp2_small(y: torch.Tensor) -> torch.Tensor:
    """2^y as the kernel computes it: Horner on e^(f·ln2), the polynomial of |f| <= 1, times 2^n for
    ``y = n + f``; n is 0 where |y| <= 1 (those values are the polynomial's alone) and y rounded to an
    integer beyond (a workshop exponent step over one octave: clamped to ±1 until 2026-12-05). |y| is
    clamped to 126 octaves, beyond which w underflows or overflows anyway."""
    y = y.clamp(-126.0, 126.0)
    n = torch.where(y.abs() > 1.0, torch.floor(y + 0.5), torch.zeros_like(y))
    t = (y - n) * LN2
    p = torch.full_like(t, EXP_COEFFS[0])
    for c in EXP_COEFFS[1:]:
        p = p * t + c
    return p * ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # an exact power of two


def _pow2_floor(a: torch.Tensor) -> torch.Tensor:
    """2^⌊log2 a⌋ for positive normal FP32 ``a``: its exponent bits with a zero mantissa."""
    return (a.view(torch.int32) & 0x7F800000).view(torch.float32)


def _adam_dir(m, v, g, s: StepScalars):
    """Moments updated with ``g``, and the bias-corrected normalized step m̂ / (√v̂ + ε)."""
    m = m * s.b1 + g * s.omb1
    v = v * s.b2 + (g * g) * s.omb2
    return m, v, (m * s.rbc1) / (_sqrt(v) * s.rsbc2 + s.eps)


def optim_update(algorithm: str, w: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor],
                 s: StepScalars) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One update in FP32: ``(w_new, new_states)`` from FP32 ``w``, ``g`` and ``states``
    (:data:`STATE_NAMES` order), all of one shape. Pure (inputs are not modified). For ``kahan``
    ``w_new`` is the unrounded ``w + y`` and the new ``comp`` is computed by :func:`optim_step_reference`
    after rounding (it needs the stored value); here it is returned as ``y``."""
    if algorithm in ("adamw", "kahan"):
        m, v = _adam_dir(states[0], states[1], g, s)[:2]
        step = (m / (_sqrt(v) * s.rsbc2 + s.eps)) * s.step_size  # torch AdamW's order: m·lr/bc1 / denom
        if algorithm == "adamw":
            return w * s.decay - step, [m, v]
        y = (-(w * s.wdlr) - step) + states[2]  # the whole increment, plus what earlier roundings lost
        return w + y, [m, v, y]
    if algorithm in ("madam-arxiv", "madam-arxiv-relative"):
        m, v = _adam_dir(states[0], states[1], g, s)[:2]
        ge = (w * LN2) * g
        ve = states[2] * s.b2 + (ge * ge) * s.omb2
        u_add = (m / (_sqrt(v) * s.rsbc2 + s.eps)) * s.step_size
        u_e = -((ge * s.mul_lr) / (_sqrt(ve) * s.rsbc2 + s.eps))
        rho = torch.where(w >= 0, 1.0, -1.0) * torch.clamp(w.abs(), min=s.tau)
        mul = (w * u_e) / rho if algorithm == "madam-arxiv" else (rho * LN2) * u_e
        return (w * s.decay + mul) - u_add, [m, v, ve]
    if algorithm == "madam-workshop":
        p2 = _pow2_floor(torch.clamp(w.abs(), min=s.tau))
        mant = w / p2  # exact: a power of two
        mm, vm, r_m = _adam_dir(states[0], states[1], g * p2, s)
        me, ve, r_e = _adam_dir(states[2], states[3], (w * LN2) * g, s)
        r_m, r_e = r_m.clamp(-s.cap, s.cap), r_e.clamp(-s.cap, s.cap)
        w_new = ((mant * s.decay - r_m * s.lr) * p2) * _exp2_small(-(r_e * s.mul_lr))
        return w_new.clamp(-s.w_max, s.w_max), [mm, vm, me, ve]
    raise ValueError(f"algorithm={algorithm!r} is not known; use one of {ALGORITHMS}")


def round_bf16(x: torch.Tensor, rounding: str, seed: int = 0, stream: int = 0) -> torch.Tensor:
    """FP32 ``x`` → BF16, to nearest-even or stochastically: ``(bits + r) >> 16`` with ``r`` the low
    16 bits of ``philox_randint(seed, flat index, stream=stream)`` (up with probability = the dropped
    fraction). NaN stays NaN, ±Inf stays ±Inf. Shape kept; ``x`` must be contiguous FP32."""
    if rounding == "nearest":
        return x.to(torch.bfloat16)
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = philox_randint(seed, torch.arange(x.numel(), device=x.device), stream=stream).view(x.shape) & 0xFFFF
    hi = ((bits + r) >> 16) & 0xFFFF
    hi = torch.where(torch.isnan(x), 0x7FC0, hi)
    out = hi << 16
    out = torch.where(hi >= 0x8000, out - (1 << 32), out)  # the sign bit: as int32 bits
    return out.to(torch.int32).view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def _check(algorithm: str, w, g, states, rounding: str) -> None:
    if algorithm not in STATE_NAMES:
        raise ValueError(f"algorithm={algorithm!r} is not known; use one of {ALGORITHMS}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}; use one of {ROUNDINGS}")
    want = len(STATE_NAMES[algorithm])
    if len(states) != want:
        raise ValueError(f"{algorithm} takes {want} states {STATE_NAMES[algorithm]}, got {len(states)}")
    for name, t in [("w", w), ("g", g)] + list(zip(STATE_NAMES[algorithm], states)):
        if t.shape != w.shape or t.device != w.device:
            raise ValueError(f"{name}: shape {tuple(t.shape)} on {t.device}, but w is {tuple(w.shape)} on {w.device}")
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{name}: dtype {t.dtype}; the fused step takes float32 or bfloat16")
        if name != "g" and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is written in place)")
    if w.numel() >= 2**31:
        raise ValueError(f"w has {w.numel()} elements; the fused step takes fewer than 2**31 per tensor")


def optim_step_reference(algorithm: str, w: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor],
                         s: StepScalars, *, rounding: str = "nearest", seed: int = 0, stream: int = 0) -> None:
    """Update ``w`` and ``states`` in place (see the module docstring; arguments as :func:`optim_step`)."""
    _check(algorithm, w, g, states, rounding)
    w32, g32 = w.float(), g.float()
    new_w, new_states = optim_update(algorithm, w32, g32, [t.float() for t in states], s)
    if w.dtype == torch.bfloat16:
        stored = round_bf16(new_w, rounding, seed, stream)
    else:
        stored = new_w
    if algorithm == "kahan":  # what the stored weight failed to take up is carried to the next step
        new_states[2] = new_states[2] - (stored.float() - w32)
    w.copy_(stored)
    for t, v in zip(states, new_states):
        t.copy_(v)  # to the state's dtype: round to nearest-even


def optim_step_triton(algorithm: str, w: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor],
                      s: StepScalars, *, rounding: str = "nearest", seed: int = 0, stream: int = 0) -> None:
    """The fused Triton kernel: same arguments and results as :func:`optim_step_reference`, bit for
    bit (one launch per tensor; ``_triton_optim_step.py``)."""
    _check(algorithm, w, g, states, rounding)
    from . import _triton_optim_step  # lazy: Triton only here

    _triton_optim_step.launch(ALG_IDS[algorithm], w, g.contiguous(), states, s, rounding == "stochastic", seed, stream)


def optim_step(algorithm: str, w: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], s: StepScalars, *,
               rounding: str = "nearest", seed: int = 0, stream: int = 0, backend: str = "auto") -> None:
    """Apply one optimizer update to one tensor, in place.

    Args:
        algorithm: one of :data:`ALGORITHMS`.
        w: the master weight, float32 or bfloat16, contiguous, any shape (< 2^31 elements).
        g: its gradient, same shape, float32 or bfloat16.
        states: the algorithm's state tensors (:data:`STATE_NAMES`), each w's shape, float32 or
            bfloat16, contiguous; zeros before the first step.
        s: the step's FP32 constants (:func:`step_scalars`).
        rounding: ``"nearest"`` (even) or ``"stochastic"`` for a BF16 ``w`` (states always round to
            nearest; an FP32 ``w`` is not rounded).
        seed: 64-bit Philox seed (key) of the stochastic rounding (fresh per step and rank).
        stream: Philox counter word 1, ``0 <= stream < 2**32``: tensors rounded under one seed
            need distinct streams.
        backend: ``"auto"`` (Triton on CUDA, else reference), ``"triton"`` or ``"reference"``.

    Raises:
        ValueError: unknown algorithm or rounding, wrong state count, shape, dtype or layout.
        RuntimeError: ``backend="triton"`` without Triton or a CUDA device.
    """
    fn = optim_step_triton if resolve_backend(backend, w.device) == "triton" else optim_step_reference
    fn(algorithm, w, g, states, s, rounding=rounding, seed=seed, stream=stream)


def _check_multi(algorithm: str, ws, gs, states, streams, rounding: str) -> None:
    if not len(ws) == len(gs) == len(states) == len(streams):
        raise ValueError(f"optim_step_multi: {len(ws)} weights, {len(gs)} gradients, {len(states)} state lists and "
                         f"{len(streams)} streams; give one of each per tensor")
    if len(set(streams)) != len(streams) or any(not 0 <= k < 2**32 for k in streams):
        raise ValueError("optim_step_multi: streams must be distinct and in [0, 2**32) (one Philox stream per tensor)")
    for w, g, st in zip(ws, gs, states):
        _check(algorithm, w, g, st, rounding)
        if not g.is_contiguous():
            raise ValueError(f"optim_step_multi: a gradient of strides {g.stride()}; pass contiguous gradients")
    kinds = {(w.device, w.dtype, g.dtype, *(t.dtype for t in st)) for w, g, st in zip(ws, gs, states)}
    if len(kinds) > 1:
        raise ValueError(f"optim_step_multi: one launch takes one device and one dtype each for weights, gradients "
                         f"and states, got {len(kinds)} kinds; group the tensors (MasterOptimizer does)")


class MultiTensorStep:
    """:func:`optim_step_multi` prepared for fixed state tensors, for a training loop: the Triton
    table of addresses is built on the first call and again only when a weight or gradient has
    moved (its address is the key: a step of a training loop copies nothing to the device, checks
    nothing but the addresses and the gradients' layout, and never syncs).

    Args:
        algorithm, rounding, backend: as :func:`optim_step`.
        states: per tensor its state list (:data:`STATE_NAMES` order), one dtype for all, on one device.
        streams: distinct Philox streams, one per tensor, in ``[0, 2**32)``.
        block, num_warps: the Triton kernel's elements per program and warps (results do not depend
            on them; default ``_triton_optim_step.MULTI_BLOCK``/``MULTI_WARPS``).

    Call with ``(ws, gs, s, seed)``: the weights and their gradients, in the order of ``states``.
    ``builds`` counts the tables built (1 in a loop whose gradients keep their addresses, as the
    caching allocator's usually do).

    Raises:
        ValueError: as :func:`optim_step_multi`, at the first call or when the tensors have moved.
    """

    def __init__(self, algorithm: str, states: list[list[torch.Tensor]], streams: list[int], *,
                 rounding: str = "nearest", backend: str = "auto", block: int | None = None,
                 num_warps: int | None = None):
        if algorithm not in STATE_NAMES:
            raise ValueError(f"algorithm={algorithm!r} is not known; use one of {ALGORITHMS}")
        self.algorithm, self.states, self.streams, self.rounding = algorithm, states, list(streams), rounding
        dev = states[0][0].device if states else torch.device("cpu")
        self.triton = bool(states) and resolve_backend(backend, dev) == "triton"
        self.block, self.num_warps = block, num_warps
        self._key, self.builds = None, 0

    def __call__(self, ws: list[torch.Tensor], gs: list[torch.Tensor], s: StepScalars, seed: int) -> None:
        if not self.triton:
            _check_multi(self.algorithm, ws, gs, self.states, self.streams, self.rounding)
            for w, g, st, k in zip(ws, gs, self.states, self.streams):
                optim_step_reference(self.algorithm, w, g, st, s, rounding=self.rounding, seed=seed, stream=k)
            return
        from . import _triton_optim_step as K  # lazy: Triton only here

        key = (*map(torch.Tensor.data_ptr, ws), *map(torch.Tensor.data_ptr, gs))
        if key != self._key or not all(map(torch.Tensor.is_contiguous, gs)):
            self._key = None
            _check_multi(self.algorithm, ws, gs, self.states, self.streams, self.rounding)
            self.block, self.num_warps = self.block or K.MULTI_BLOCK, self.num_warps or K.MULTI_WARPS
            self._tab, self._blk, self._odd = K.build_table(ws, gs, self.states, self.streams, self.block)
            self._dtypes = (ws[0].dtype, gs[0].dtype, self.states[0][0].dtype)
            self._key, self.builds = key, self.builds + 1
        alg, sr = ALG_IDS[self.algorithm], self.rounding == "stochastic"
        for i in self._odd:
            K.launch(alg, ws[i], gs[i], self.states[i], s, sr, seed, self.streams[i])
        if self._tab is not None:
            K.launch_table(alg, self._tab, self._blk, s, sr, seed, *self._dtypes, self.block, self.num_warps)


def optim_step_multi(algorithm: str, ws: list[torch.Tensor], gs: list[torch.Tensor], states: list[list[torch.Tensor]],
                     s: StepScalars, *, rounding: str = "nearest", seed: int = 0, streams: list[int] | None = None,
                     backend: str = "auto", block: int | None = None, num_warps: int | None = None) -> None:
    """Apply one optimizer update to every tensor of a list, in place, in one kernel launch.

    The result is bit for bit that of ``optim_step(algorithm, ws[i], gs[i], states[i], s,
    rounding=rounding, seed=seed, stream=streams[i])`` for each ``i``. The Triton kernel reads a
    table of the tensors' addresses (and launches the one-tensor kernel for any tensor not 16-byte
    aligned); the reference loops. A training loop keeps a :class:`MultiTensorStep` instead, which
    builds that table once.

    Args:
        algorithm, s, rounding, seed, backend: as :func:`optim_step`.
        ws, gs, states: per tensor the weight, its gradient and its state list, as :func:`optim_step`
            takes them; all on one device, with one dtype for every weight, one for every gradient and
            one for every state; gradients contiguous.
        streams: distinct Philox streams, one per tensor (default ``0, 1, ...``).
        block, num_warps: as :class:`MultiTensorStep`.

    Raises:
        ValueError: as :func:`optim_step`; lists of different lengths, repeated streams, mixed
            devices or dtypes, non-contiguous gradients.
        RuntimeError: ``backend="triton"`` without Triton or a CUDA device.
    """
    if not ws:
        return
    streams = list(range(len(ws))) if streams is None else list(streams)
    if len(states) != len(ws):
        raise ValueError(f"optim_step_multi: {len(ws)} weights but {len(states)} state lists; give one per tensor")
    MultiTensorStep(algorithm, states, streams, rounding=rounding, backend=backend, block=block,
                    num_warps=num_warps)(ws, gs, s, seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def bit_mismatches(algorithm: str, w: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], s: StepScalars, *,
                   rounding: str = "nearest", seed: int = 0, stream: int = 0) -> tuple[int, int, torch.Tensor]:
    """The Triton step against its reference on copies of ``w`` and ``states`` (left as they are):
    ``(weight elements whose bits differ, state elements whose bits differ, Triton's new weight)``.
    Arguments as :func:`optim_step`; shared by the interpreter tests and ``scripts/validate_kernels.py``.

    Raises:
        as :func:`optim_step` with ``backend="triton"``."""
    bad_w, bad_s, ws = bit_mismatches_multi(algorithm, [w], [g], [states], s, rounding=rounding, seed=seed,
                                            streams=[stream], one_tensor=True)
    return bad_w, bad_s, ws[0]


def bit_mismatches_multi(algorithm: str, ws: list[torch.Tensor], gs: list[torch.Tensor],
                         states: list[list[torch.Tensor]], s: StepScalars, *, rounding: str = "nearest", seed: int = 0, streams: list[int] | None = None,
                         one_tensor: bool = False, **launch) -> tuple[int, int, list[torch.Tensor]]:
    """:func:`bit_mismatches` of :func:`optim_step_multi` (``one_tensor``: of :func:`optim_step` on
    each tensor): the Triton launch against the reference on copies; ``launch``: ``block``,
    ``num_warps``. Returns ``(weight bits differing, state bits differing, Triton's new weights)``."""
    streams = list(range(len(ws))) if streams is None else streams
    outs = []
    for backend in ("reference", "triton"):
        w1, st1 = [w.clone() for w in ws], [[t.clone() for t in st] for st in states]
        if one_tensor:
            for w, g, st, k in zip(w1, gs, st1, streams):
                optim_step(algorithm, w, g, st, s, rounding=rounding, seed=seed, stream=k, backend=backend)
        else:
            optim_step_multi(algorithm, w1, gs, st1, s, rounding=rounding, seed=seed, streams=streams, backend=backend,
                             **launch)
        outs.append((w1, st1))
    bad_w = sum(int((_bits(a) != _bits(b)).sum()) for a, b in zip(outs[0][0], outs[1][0]))
    bad_s = sum(int((_bits(a) != _bits(b)).sum()) for sa, sb in zip(outs[0][1], outs[1][1]) for a, b in zip(sa, sb))
    return bad_w, bad_s, outs[1][0]
