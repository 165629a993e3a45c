"""Master-weight storage: FP32, BF16, or block-scaled FP8 / FP4 with no wider copy kept anywhere.

Design (the least invasive one that keeps every module, the optimizer and autograd unchanged):

- ``fp32`` / ``bf16``: the ``nn.Parameter`` itself holds the master in that dtype
  (:func:`convert_master_weights` casts ``p.data``). Forward reads it as always; gradients arrive in
  the same dtype.
- ``fp8`` / ``fp4`` / ``nvfp4``: each matrix Parameter (``ndim == 2``: linear weights, embeddings)
  becomes a :class:`PackedMaster`: a tensor subclass that *presents* itself as a BF16 tensor of the
  weight's shape but stores only packed codes and block scales. Any op that reads it (``.to()``,
  ``F.linear``, ``F.embedding``, ...) sees the dequantized BF16 values, made on the fly and freed
  after use; autograd treats it as an ordinary BF16 leaf, so ``p.grad`` is a plain BF16 gradient.
  :class:`adahop.nn.LowPrecisionLinear` calls ``self.weight.to(dtype)``, which here returns the
  dequantized weight (a differentiable view in autograd terms), so the converted layers need no
  change. Vectors (norm gains, biases) stay BF16. The optimizer writes new codes and scales through
  :func:`write_master`; in-place ops on a packed weight from anywhere else are refused.

Formats (elements along the last dim, padded per row to the block):

- ``fp8``: E4M3 elements, one power-of-two (E8M0) scale per 32 elements, chosen so the block
  maximum rounds into range (never clips): 8.25 bits per weight.
- ``fp4``: MXFP4 (:func:`adahop.formats.quantize_mxfp4`; under stochastic rounding the ``rceil``
  scale rule, which never clips, so SR stays unbiased; under round-to-nearest the ``adahop`` rule):
  4.25 bits per weight.
- ``nvfp4``: NVFP4 (:func:`adahop.formats.quantize_nvfp4`): E2M1, an E4M3 scale per 16, one FP32 tensor
  scale: 4.5 bits per weight.

The block-scale policy of M+Adam's FP8/FP4 masters is not published (`specs/related_methods.md`
§3.3); this one rescales every block from its new values at every write, with rules under which a
write that changes no element by half an ulp changes nothing (:func:`pack`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..formats import MXTensor, NVFP4Tensor, quantize_mxfp4, quantize_nvfp4
from ..formats.common import move_and_pad, unpad_and_restore
from ..formats.nvfp4 import KEPT_SCALE_MARGIN
from .names import MASTER_FORMATS, PACKED_FORMATS

__all__ = ["MASTER_FORMATS", "PACKED_FORMATS", "PackedMaster", "convert_master_weights", "read_master",
           "write_master", "master_format", "weight_bytes", "pack_state_dict", "unpack_state_dict"]

E4M3_MAX = 448.0
E4M3_RNE_LIMIT = 464.0  # halfway between 448 and the next E4M3 step (480): RNE rounds (448, 464] to 448
FP8_BLOCK = 32
_SEP = "::"  # checkpoint keys of packed parts: "<param>::<format>.<part>"
REPLACEMENTS = [0]
"""How many parameters :func:`convert_master_weights` has replaced in this process: an optimizer's kept step
plan (`adahop.optim.base`) compares it, one int a step, instead of checking each parameter."""

aten = torch.ops.aten


# ----------------------------------------------------------------------------- packing
def _quantize_fp8(x: torch.Tensor, rounding: str, generator) -> dict[str, torch.Tensor]:
    """E4M3 codes [*, Kp] and E8M0 scales [*, Kp/32] of FP32 ``x`` [*, K].

    The block scale is the smallest power of two at which the block maximum *rounds* into range:
    amax/scale ≤ 448 under stochastic rounding (nothing may clip, or SR is biased), ≤ 464 (halfway
    to the next E4M3 step, 480) under round-to-nearest, where (448, 464] rounds to 448 anyway. So a
    write of an already stored block plus steps below half an ulp keeps its scale (see
    :func:`pack`)."""
    xm = move_and_pad(x.float(), x.ndim - 1, FP8_BLOCK)
    blocks = xm.reshape(*xm.shape[:-1], -1, FP8_BLOCK)
    amax = blocks.abs().amax(-1)
    limit = E4M3_MAX if rounding == "stochastic" else E4M3_RNE_LIMIT
    mant, ex = torch.frexp(amax / limit)  # amax/limit = mant·2^ex, mant in [0.5, 1)
    e = torch.where(mant == 0.5, ex - 1, ex).clamp(-127, 127)  # ceil(log2(amax/limit))
    e = torch.where(amax > 0, e, torch.full_like(e, -127))
    s = torch.ldexp(blocks, (-e).unsqueeze(-1).float()).clamp(-E4M3_MAX, E4M3_MAX)
    if rounding == "stochastic":
        a = s.abs()
        # the E4M3 spacing at |s|: 2^(floor(log2|s|) - 3) for normals (>= 2^-6), 2^-9 below
        ulp = torch.ldexp(torch.ones_like(a), (torch.frexp(a)[1] - 4).clamp(min=-9))
        lo = torch.floor(a / ulp) * ulp
        u = torch.rand(a.shape, generator=generator, device=a.device)
        s = torch.sign(s) * torch.where(u < (a - lo) / ulp, lo + ulp, lo).clamp(max=E4M3_MAX)
    return {"codes": s.to(torch.float8_e4m3fn).flatten(-2), "scales": (e + 127).to(torch.uint8)}


def _dequantize_fp8(d: dict, shape) -> torch.Tensor:
    blocks = d["codes"].float().reshape(*d["scales"].shape, FP8_BLOCK)
    x = torch.ldexp(blocks, (d["scales"].to(torch.int32) - 127).unsqueeze(-1).float())
    return unpad_and_restore(x.flatten(-2), tuple(shape), len(shape) - 1)


def pack(x: torch.Tensor, fmt: str, rounding: str = "nearest", generator=None,
         global_scale: torch.Tensor | None = None, block_scales: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The packed parts of FP32 ``x`` (blocks along the last dim) in ``fmt`` (:data:`PACKED_FORMATS`).

    Scales are chosen so that re-packing a stored master plus a step smaller than half an ulp of
    every element gives the stored codes back under round-to-nearest (the optimizer re-packs every
    step; a scale that moved on such a step re-rounded its whole block, and a doubled MXFP4 scale
    sends every ±0.5·scale element to zero):

    - ``fp8``: see :func:`_quantize_fp8`;
    - ``fp4``: under ``nearest`` MXFP4's ``adahop`` rule (amax/scale in [3.5, 7): a maximum in
      (6, 7) rounds to 6 anyway), under ``stochastic`` the ``rceil`` rule (amax/scale ≤ 6: nothing
      clips, so SR stays unbiased);
    - ``nvfp4``: ``global_scale`` (the stored one, shape [1]) is kept while the new tensor maximum
      fits under it (t_amax ≤ 448·6·global_scale under SR, ≤ 448·7·global_scale under RNE, where
      a block maximum up to 7 rounds to 6); else (and when None) it is t_amax/2688, as
      :func:`adahop.formats.quantize_nvfp4` picks it. Recomputing it from every write moved every
      block scale of the tensor on every step. With the tensor scale kept, each block keeps its stored
      E4M3 scale (``block_scales``) while its new maximum is within [3, 7) of it ([3, 6] under SR):
      re-rounding it from each write's block maximum re-rounded all 16 elements of a block whenever
      that maximum crossed an E4M3 rounding boundary, by a step below half of any element's ulp.
    """
    if fmt == "fp8":
        return _quantize_fp8(x, rounding, generator)
    if fmt == "fp4":
        rule = "rceil" if rounding == "stochastic" else "adahop"
        q = quantize_mxfp4(x, axis=-1, scale_rule=rule, rounding=rounding, generator=generator)
        return {"codes": q.codes, "scales": q.scales}
    if fmt == "nvfp4":
        if global_scale is not None:  # one host sync per packed tensor: this path is eager anyway
            top = 6.0 if rounding == "stochastic" else 7.0  # the largest block maximum / 448 that rounds to ≤ 6
            top *= 1 + KEPT_SCALE_MARGIN  # a stored maximum reads back an FP32 ulp above 6 steps (helper 66)
            fits = bool(x.detach().abs().amax().float() <= global_scale.float().reshape(()) * (448.0 * top))
            global_scale = global_scale.float().reshape(()) if fits else None
        if global_scale is None:
            block_scales = None  # a new tensor scale: every block scale is derived afresh
        q = quantize_nvfp4(x, axis=-1, rounding=rounding, generator=generator, global_scale=global_scale,
                           block_scales=block_scales)
        return {"codes": q.codes, "scales": q.scales, "global_scale": q.global_scale.reshape(1)}
    raise ValueError(f"fmt={fmt!r}: packed master formats are {PACKED_FORMATS}")


def unpack(d: dict[str, torch.Tensor], fmt: str, shape) -> torch.Tensor:
    """FP32 values of the packed parts ``d`` (inverse of :func:`pack` up to its rounding)."""
    shape = tuple(shape)
    if fmt == "fp8":
        return _dequantize_fp8(d, shape)
    if fmt == "fp4":
        return MXTensor(codes=d["codes"], scales=d["scales"], shape=shape, axis=len(shape) - 1).dequantize()
    return NVFP4Tensor(codes=d["codes"], scales=d["scales"], global_scale=d["global_scale"].reshape(()), shape=shape,
                       axis=len(shape) - 1).dequantize()


# ----------------------------------------------------------------------------- the tensor subclass
class _Dequantize(torch.autograd.Function):
    """BF16 values of a packed master; the gradient passes straight to the packed leaf."""

    @staticmethod
    def forward(ctx, p):
        return unpack(p.parts, p.fmt, p.shape).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, g):
        return g


def _rebuild_packed(parts: dict, fmt: str, shape, is_param: bool, requires_grad: bool) -> torch.Tensor:
    """A :class:`PackedMaster` (a Parameter when ``is_param``) from its parts: deepcopy and unpickling."""
    t = PackedMaster(parts, fmt, shape)
    return nn.Parameter(t, requires_grad=requires_grad) if is_param else t.requires_grad_(requires_grad)


class PackedMaster(torch.Tensor):
    """A master weight stored packed (``fmt`` in :data:`PACKED_FORMATS`) that reads as BF16.

    ``parts``: the packed tensors (``codes``, ``scales``[, ``global_scale``]); shape and dtype
    (bfloat16) are the logical weight's. Reading ops dequantize; ``copy_`` from a float tensor
    re-packs it (round to nearest), from another PackedMaster copies its parts exactly.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, parts: dict, fmt: str, shape):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=torch.bfloat16,
                                                   device=parts["codes"].device, requires_grad=False)

    def __init__(self, parts: dict, fmt: str, shape):
        self.parts, self.fmt = parts, fmt

    def __repr__(self) -> str:
        return f"PackedMaster(fmt={self.fmt}, shape={tuple(self.shape)}, bytes={self.packed_bytes})"

    @property
    def packed_bytes(self) -> int:
        """Bytes held by the packed parts."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def dequantize(self) -> torch.Tensor:
        """The FP32 values (no autograd)."""
        return unpack(self.parts, self.fmt, self.shape)

    def data_ptr(self) -> int:  # tied weights are found by storage (checkpoint.tied_keys)
        return self.parts["codes"].data_ptr()

    # copy.deepcopy and pickle (torch.save of a model): Tensor's own read the storage, which a wrapper
    # tensor does not have; the packed parts are the whole value
    def __deepcopy__(self, memo):
        if id(self) not in memo:
            parts = {k: copy.deepcopy(t, memo) for k, t in self.parts.items()}
            memo[id(self)] = _rebuild_packed(parts, self.fmt, tuple(self.shape), *self._param_state())
            if self.grad is not None:
                memo[id(self)].grad = copy.deepcopy(self.grad, memo)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return _rebuild_packed, (self.parts, self.fmt, tuple(self.shape), *self._param_state())

    def _param_state(self) -> tuple[bool, bool]:
        return bool(getattr(self, "_is_param", False)), self.requires_grad

    # nn.Module._apply (model.to(dtype), .float(), .half(), .to(device)) assigns `param.data = param.to(...)`:
    # a plain tensor there would leave a float32 "packed" weight whose reads still give BF16
    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        if isinstance(value, PackedMaster) and value.fmt == self.fmt and value.shape == self.shape:
            torch.Tensor.data.__set__(self, value)
            self.parts = value.parts
            return
        if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 and value.device == self.device \
                and value.shape == self.shape and not isinstance(value, PackedMaster):
            return  # model.to(bfloat16) or to its own device: the packed values already are these
        raise RuntimeError(
            f"cannot cast a packed ({self.fmt}) master weight of shape {tuple(self.shape)} to "
            f"{getattr(value, 'dtype', type(value).__name__)}: it stores {self.fmt} codes and computes in BF16. "
            "Cast or move the model before convert_master_weights, or run float32 compute under torch.autocast")

    def to(self, *args, **kwargs):
        # `.to(bfloat16)` of a BF16 tensor would return the packed tensor itself: give the values
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and torch.device(device) != self.device:
            raise RuntimeError("a packed master weight cannot move devices; convert master weights after model.to()")
        return _Dequantize.apply(self).to(dtype or torch.bfloat16)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            p = args[0]
            return PackedMaster(p.parts, p.fmt, p.shape)
        if func is aten.copy_.default and isinstance(args[0], PackedMaster):
            dst, src = args[0], args[1]
            new = dict(src.parts) if isinstance(src, PackedMaster) and src.fmt == dst.fmt else pack(
                src.dequantize() if isinstance(src, PackedMaster) else src.float(), dst.fmt)
            for k, t in new.items():
                dst.parts[k].copy_(t)
            return dst
        if func is aten._to_copy.default and isinstance(args[0], PackedMaster) and set(kwargs) <= {"device"}:
            p = args[0]  # a device move keeps the format (`.cpu()` of a checkpoint)
            return PackedMaster({k: t.to(kwargs.get("device", t.device)) for k, t in p.parts.items()}, p.fmt, p.shape)
        if func._schema.is_mutable and isinstance(args[0], PackedMaster):
            raise RuntimeError(f"{func} would modify a packed ({args[0].fmt}) "
                               "master weight in place; only adahop.optim writes it (write_master)")
        unwrap = lambda t: t.dequantize().to(torch.bfloat16) if isinstance(t, PackedMaster) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


# ----------------------------------------------------------------------------- model conversion
def master_format(p: torch.Tensor) -> str:
    """The storage format of master weight ``p``: ``fp32``, ``bf16`` or a packed format."""
    if isinstance(p, PackedMaster):
        return p.fmt
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(p.dtype, str(p.dtype))


def convert_master_weights(model: nn.Module, fmt: str) -> nn.Module:
    """Store ``model``'s parameters as ``fmt`` master weights, in place (tied parameters stay tied).

    Args:
        model: any module, already on its device.
        fmt: ``fp32`` (unchanged), ``bf16`` (every parameter), or ``fp8``/``fp4``/``nvfp4`` (matrices
            packed, round to nearest; vectors BF16).

    Returns:
        ``model``. Build the optimizer after this call.

    Raises:
        ValueError: unknown ``fmt``.
    """
    if fmt not in MASTER_FORMATS:
        raise ValueError(f"master weights {fmt!r}: use one of {MASTER_FORMATS}")
    if fmt == "fp32":
        return model
    done: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                if fmt != "bf16" and p.ndim == 2:
                    done[id(p)] = nn.Parameter(PackedMaster(pack(p.detach().float(), fmt), fmt, p.shape),
                                               requires_grad=p.requires_grad)
                    p._adahop_replaced = fmt  # an adahop optimizer built before this call refuses to step it
                    REPLACEMENTS[0] += 1
                else:
                    p.data = p.data.to(torch.bfloat16)
                    done[id(p)] = p
            mod._parameters[name] = done[id(p)]
    return model


def read_master(p: torch.Tensor) -> torch.Tensor:
    """The FP32 values of master weight ``p`` (a copy for packed and BF16 masters, ``p`` for FP32)."""
    if isinstance(p, PackedMaster):
        return p.dequantize()
    return p.detach().float()


@torch.no_grad()
def write_master(p: torch.Tensor, w: torch.Tensor, rounding: str = "nearest", generator=None) -> None:
    """Store FP32 values ``w`` into packed master ``p``, rounded once to its format (``rounding``
    ``nearest`` or ``stochastic``, bits from ``generator``); block scales follow the new values by
    :func:`pack`'s rules, and an NVFP4 tensor scale is kept while the values fit under it."""
    for k, t in pack(w, p.fmt, rounding, generator, global_scale=p.parts.get("global_scale"),
                     block_scales=p.parts.get("scales") if p.fmt == "nvfp4" else None).items():
        p.parts[k].copy_(t)


def weight_bytes(p: torch.Tensor) -> int:
    """Bytes the master weight ``p`` occupies."""
    return p.packed_bytes if isinstance(p, PackedMaster) else p.numel() * p.element_size()


# ----------------------------------------------------------------------------- checkpoints
def pack_state_dict(state: dict) -> dict:
    """A state dict safetensors can store: each PackedMaster ``k`` becomes its parts
    ``k::<fmt>.<part>`` in their own dtypes; other entries unchanged."""
    out = {}
    for k, v in state.items():
        if isinstance(v, PackedMaster):
            for part, t in v.parts.items():
                out[f"{k}{_SEP}{v.fmt}.{part}"] = t.detach().cpu().contiguous()
        else:
            out[k] = v
    return out


def unpack_state_dict(state: dict, model: nn.Module) -> dict:
    """Inverse of :func:`pack_state_dict` for ``model`` (whose parameters give the shapes): packed
    parts become PackedMaster values, which ``load_state_dict`` copies bit for bit."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    grouped: dict[str, dict] = {}
    out = {}
    for k, v in state.items():
        if _SEP in k:
            name, rest = k.split(_SEP, 1)
            fmt, part = rest.split(".", 1)
            grouped.setdefault((name, fmt), {})[part] = v
        else:
            out[k] = v
    for (name, fmt), parts in grouped.items():
        if name not in shapes:
            raise ValueError(f"checkpoint holds packed weight {name!r}, which the model does not have")
        out[name] = PackedMaster(parts, fmt, shapes[name])
    return out
