"""One linear layer under a PTQ method: optional incoherence (RHT or HARP), then RTN or GPTQ.

``--method`` is ``[rht-|harp-]rtn|gptq``. For a rotated method the backend quantizes
``W̃ = Uᵀ(S W S)V`` on ``H̃ = Vᵀ(S H S)V`` and the layer's weight becomes ``S U Q(W̃) Vᵀ S``
(`specs/related_methods.md` §2.1): what the BF16 export holds. The packed artifact keeps the codes,
scales, signs and HARP parameters instead, and :func:`stored_bits` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fit import FitOptions, FitResult, fit_harp, fit_harp_groups
from .ldlq import gptq, proxy_error, require_finite
from .grids import FP16_MAX, Grid, IntGrid
from .incoherence import MIN_BLOCK, RHTRotation, TwoSided
from .names import METHODS
from .rotation import HARPRotation

__all__ = ["METHODS", "parse_method", "RotationOptions", "quantize_layer", "fit_block", "LayerResult", "pack_bits", "unpack_bits"]


def parse_method(method: str) -> tuple[str | None, str]:
    """``"harp-gptq"`` → ``("harp", "gptq")``; ``"rtn"`` → ``(None, "rtn")``.

    Raises:
        ValueError: an unknown method (lists :data:`METHODS`).
    """
    if method not in METHODS:
        raise ValueError(f"--method {method!r} is not known; use one of {', '.join(METHODS)}")
    rot, _, backend = method.rpartition("-")
    return (rot or None), backend


@dataclass(frozen=True, slots=True, kw_only=True)
class RotationOptions:
    """HARP's parametrization (`specs/related_methods.md` §2.4 defaults) and the RHT's smallest block."""

    radix: int = 8
    max_radix: int = 8
    passes: int = 1
    mixer: str = "had_or_qr"
    min_block: int = MIN_BLOCK
    theta_format: str = "fp16"


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (uint8, each ``< 2^bits``, ``bits`` from 1 to 8) into a uint8 bit stream, little-endian
    within each code: ``ceil(numel·bits / 8)`` bytes, on ``codes``' device. Eight codes fill ``bits`` bytes
    exactly, so the stream is built eight codes at a time: their ``8·bits``-bit value, cut into bytes."""
    n = codes.numel()
    if 8 % bits == 0:  # whole codes in each byte: byte-wide int32 arithmetic, half the memory of the general case
        per = 8 // bits
        c = codes.reshape(-1).to(torch.int32)
        c = torch.cat([c, c.new_zeros((-n) % per)]).reshape(-1, per)
        return (c << torch.arange(0, 8, bits, device=c.device, dtype=torch.int32)).sum(1).to(torch.uint8)
    c = codes.reshape(-1).to(torch.int64)
    c = torch.cat([c, c.new_zeros((-n) % 8)]).reshape(-1, 8)
    v = (c << torch.arange(0, 8 * bits, bits, device=c.device)).sum(1)  # at most 64 bits: 8 codes of 8 bits
    out = (v[:, None] >> torch.arange(0, 8 * bits, 8, device=c.device)) & 0xFF
    return out.reshape(-1)[: -(-n * bits // 8)].to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as uint8, on ``packed``'s device."""
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
        return ((packed.reshape(-1).to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:numel].to(torch.uint8)
    p = packed.reshape(-1).to(torch.int64)
    p = torch.cat([p, p.new_zeros((-p.numel()) % bits)]).reshape(-1, bits)
    v = (p << torch.arange(0, 8 * bits, 8, device=p.device)).sum(1)
    codes = (v[:, None] >> torch.arange(0, 8 * bits, bits, device=p.device)) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel].to(torch.uint8)


@dataclass
class LayerResult:
    """A quantized layer: its new weight, what the artifact stores, and measurements."""

    weight: torch.Tensor
    """float32 ``[m, n]``: ``S U Q(W̃) Vᵀ S`` (or ``Q(W)`` unrotated)."""
    stored: dict[str, torch.Tensor]
    """The artifact's tensors of this layer (codes, scales, signs, rotation parameters)."""
    stored_bits: int
    """Bits of everything in ``stored``."""
    stats: dict
    """``proxy_error`` (``tr(ΔHΔᵀ)/m`` in the original space), the HARP fit's losses and time."""


def _rotation(kind: str, d: int, opts: RotationOptions, seed: int, device):
    if kind == "rht":
        return RHTRotation(d, min_block=opts.min_block)
    return HARPRotation(d, opts.radix, opts.max_radix, opts.passes, opts.mixer, seed=seed,
                        theta_format=opts.theta_format).to(device)


def _transform(rot: str, m: int, n: int, rot_opts: RotationOptions, seed: int, generator: torch.Generator, device) -> TwoSided:
    return TwoSided.random_signs(_rotation(rot, m, rot_opts, seed, device), _rotation(rot, n, rot_opts, seed, device),
                                 generator=generator, device=device)


def fit_block(items: list[tuple[str, torch.Tensor, torch.Tensor]], method: str, grid: Grid, *, generator: torch.Generator,
              rot_opts: RotationOptions = RotationOptions(), fit_opts: FitOptions = FitOptions(),
              seed: int = 0) -> dict[str, tuple[TwoSided, FitResult]]:
    """HARP's rotations of a block's layers, each shape's layers fitted together (q and o in one fit, gate
    and up in another, for llama-350m) and the shapes' fits side by side on a GPU (:func:`fit_harp_groups`),
    for :func:`quantize_layer`'s ``fitted``.

    ``items``: ``(name, weight [m, n], H [n, n])`` in the block's order; the signs are drawn from
    ``generator`` in that order, as :func:`quantize_layer` draws them layer by layer, so the result is the
    same transforms. Returns ``{}`` for a method without ``harp-``.

    Raises:
        ValueError: an unknown method, or a fit that fails (:func:`fit_harp_groups`), the message prefixed
            with the names of the layers fitted together.

    Source: `specs/related_methods.md` §2.3 (one fit per layer); fitting a shape's layers together is ours.
    """
    rot, _ = parse_method(method)
    if rot != "harp":
        return {}
    ts = {name: _transform(rot, *w.shape, rot_opts, seed, generator, w.device) for name, w, _ in items}
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault(tuple(item[1].shape), []).append(item)
    fits = fit_harp_groups([([w for _, w, _ in g], [h for _, _, h in g], [ts[n] for n, _, _ in g]) for g in groups.values()],
                           grid, fit_opts, labels=[", ".join(n for n, _, _ in g) for g in groups.values()])
    return {n: (ts[n], f) for g, gf in zip(groups.values(), fits) for (n, _, _), f in zip(g, gf)}


def quantize_layer(w: torch.Tensor, h: torch.Tensor, method: str, grid: Grid, *, generator: torch.Generator,
                   rot_opts: RotationOptions = RotationOptions(), fit_opts: FitOptions = FitOptions(),
                   damp: float = 0.01, seed: int = 0, fitted: tuple[TwoSided, FitResult] | None = None) -> LayerResult:
    """Quantize one weight ``w`` (``[m, n]``, out × in) with ``method`` on its Hessian ``h`` (``[n, n]``).

    ``generator`` (CPU) draws the random signs; ``seed`` seeds HARP's QR mixers (recorded in the
    artifact). Computation runs on ``w``'s device in float32. ``fitted``: a ``harp-`` method's transform
    and fit already made (:func:`fit_block`); no signs are drawn then.

    Raises:
        ValueError: an unknown method, shapes that do not fit, NaN or inf in ``w`` or ``h``, a weight too large
            for the int grid's FP16 scales, an RHT dimension with no Hadamard block
            that fits, or a quantized weight that is not finite (never written).
    """
    rot, backend = parse_method(method)
    w = w.float()
    h = h.float().to(w.device)
    if w.dim() != 2 or tuple(h.shape) != (w.shape[-1], w.shape[-1]):
        raise ValueError(f"{method}: the weight must be 2-D [out, in] and the Hessian [in, in]; got {tuple(w.shape)} and "
                         f"{tuple(h.shape)}")
    m, n = w.shape
    require_finite(method, weight=w, Hessian=h)
    stats: dict = {}
    stored: dict[str, torch.Tensor] = {}
    t = None
    if rot is not None:
        if fitted is not None and rot == "harp":
            t, fit = fitted
        else:
            t = _transform(rot, m, n, rot_opts, seed, generator, w.device)
            fit = fit_harp(w, h, t, grid, fit_opts) if rot == "harp" else None
        if fit is not None:
            stats["harp"] = {"loss_start": fit.loss_start, "loss_end": fit.loss_end, "lq_start": fit.lq_start,
                             "lq_end": fit.lq_end, "seconds": fit.seconds, "steps": fit.steps,
                             "cuda_graph": fit.cuda_graph, **({"graph_error": fit.graph_error} if fit.graph_error else {})}
        with torch.no_grad():
            wq_in, hq_in = t.weight(w), t.hessian(h)
        stored["signs_out"] = pack_bits((t.s_out < 0).to(torch.uint8), 1)
        stored["signs_in"] = pack_bits((t.s_in < 0).to(torch.uint8), 1)
        if rot == "harp":
            for side, r in (("out", t.u), ("in", t.v)):
                stored.update({f"theta_{side}.{k}": p for k, p in r.packed_params().items()})
    else:
        wq_in, hq_in = w, h
    with torch.no_grad():
        if backend == "gptq":
            out = gptq(wq_in, hq_in, grid, damp=damp)
            codes, scales, q = out["codes"], out["scales"], out["q"]
        else:
            codes, scales, q = grid.quantize(wq_in)
        weight = t.weight_inverse(q) if t is not None else q
        bad = int((~torch.isfinite(weight)).sum())
        top = float(wq_in.abs().max()) if bad and isinstance(grid, IntGrid) else 0.0
        need = top / grid._half() if top else 0.0  # the scale its largest group needs (the int grid's own rule)
        if need > FP16_MAX:
            raise ValueError(f"{method}: the int grid's FP16 group scales hold at most {FP16_MAX:g}, and this layer's "
                             f"largest (rotated) weight {top:.4g} needs {need:.4g} at {grid.bits} bits; "
                             "rescale the model's weights, or use --quantizer mxfp4 (E8M0 scales reach 2^127)")
        if bad:  # never write a model that decodes to NaN or inf (the inputs were finite: a bug of ours)
            raise ValueError(f"{method} with the {grid.name} grid produced {bad} non-finite weights of {m * n} from a "
                             "finite weight and Hessian: a bug, please report it with the command")
    stored["codes"] = pack_bits(codes, grid.bits)
    stored.update(grid.stored_scales(scales.cpu()))
    stats["proxy_error"] = proxy_error(w, weight, h)
    stats["proxy_error_rel"] = stats["proxy_error"] / max(proxy_error(w, torch.zeros_like(w), h), 1e-30)
    nbits = sum(8 * v.numel() * v.element_size() for v in stored.values())
    # the packed streams are byte-padded; count the bits they carry (codes and signs), not the padding
    nbits -= 8 * stored["codes"].numel() - m * n * grid.bits
    if rot is not None:
        nbits -= 8 * (stored["signs_out"].numel() + stored["signs_in"].numel()) - (m + n)
    return LayerResult(weight=weight, stored={k: v.cpu() for k, v in stored.items()}, stored_bits=int(nbits), stats=stats)

