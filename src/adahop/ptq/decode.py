"""Decoding with a packed `adahop ptq` artifact: each quantized linear computed from its codes, with the
incoherence rotations applied to the activations instead of to the weight (`specs/related_methods.md` §2.6).

``W = S_m U Q Vᵀ S_n`` (:class:`~adahop.ptq.incoherence.TwoSided`), so for a row ``x``:
``y = x Wᵀ = ((((x ⊙ s_n)·V)·Qᵀ)·Uᵀ) ⊙ s_m``: two signed rotations of vectors of size ``n`` and ``m`` (a few
butterfly stages each) around a matvec with the low-bit ``Q``, which reads ``bits/16`` of the bytes of a BF16
weight. :func:`int_matvec` is that matvec on the int grid's packed codes: a Triton kernel on CUDA (bits 2, 3, 4),
:func:`int_matvec_reference` elsewhere, with the same signature. :class:`PackedLinear` is the layer and
:func:`load_packed_model` puts it into a transformers model saved by `adahop ptq`.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import torch
from torch import nn

from ..formats.e2m1 import decode_e2m1, decode_e8m0
from ..kernels.backend import triton_runs_on
from .export import PACKED_FILE, load_packed, unfinished
from .grids import IntGrid, MXFP4Grid
from .quantize import unpack_bits
from .rotation import HARPRotation
from .staged import apply_stages, fold_signs, merge_stages, rotation_stages

__all__ = ["int_matvec", "int_matvec_reference", "PackedLinear", "load_packed_model", "ELEMENTS"]

KERNEL_BITS = (2, 3, 4)
"""Code widths the Triton kernel reads (in units of whole bytes holding whole codes); others take the reference."""

MAX_KERNEL_ROWS = 65535
"""Rows of ``x`` the matvec kernel takes in one launch (its grid's third axis, CUDA's limit); more take the
reference (a GEMM on the decoded weight, the right algorithm for that many rows anyway)."""

MATVEC_ROWS = 8
"""Above this many rows (a prompt, not a decode step) :class:`PackedLinear` decodes its weight for the call and
runs one GEMM: the matvec kernel reads the codes once per row."""


ELEMENTS = ("int", "e2m1")
"""What a code means: ``int`` the int grid's level ``code − 2^(bits−1) + ½`` times an FP16 scale
(:class:`~adahop.ptq.grids.IntGrid`), ``e2m1`` an MXFP4 element times an E8M0 scale (:class:`~adahop.ptq.grids.MXFP4Grid`)."""


def _check(x, codes, scales, m, n, bits, group_size, element="int") -> None:
    for name, v in (("m", m), ("n", n), ("bits", bits), ("group_size", group_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"int_matvec: {name}={v!r} must be an int >= 1")
    if bits > 8:  # unpack_bits gives uint8 codes
        raise ValueError(f"int_matvec: bits={bits}: codes of at most 8 bits are read (adahop ptq writes 2 to 4)")
    if not x.is_floating_point():
        raise ValueError(f"int_matvec: x must be floating point, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != n:
        raise ValueError(f"int_matvec: x must be [rows, {n}], got {tuple(x.shape)}")
    if codes.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() != -(-m * n * bits // 8):
        raise ValueError(f"int_matvec: codes must be the 1-D uint8 stream of {m}×{n} {bits}-bit codes "
                         f"({-(-m * n * bits // 8)} bytes), got {tuple(codes.shape)} {codes.dtype}")
    if element not in ELEMENTS:
        raise ValueError(f"int_matvec: element={element!r}; use one of {ELEMENTS}")
    if element == "e2m1" and bits != 4:
        raise ValueError(f"int_matvec: E2M1 codes are 4 bits, got bits={bits}")
    kind, ok = ("uint8 E8M0", scales.dtype == torch.uint8) if element == "e2m1" else ("float", scales.is_floating_point())
    if tuple(scales.shape) != (m, -(-n // group_size)) or not ok:
        raise ValueError(f"int_matvec: scales must be {kind} [{m}, {-(-n // group_size)}] (one per row of each group "
                         f"of {group_size}), got {scales.dtype} {tuple(scales.shape)}")


def int_matvec_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, m: int, n: int, bits: int,
                         group_size: int, *, element: str = "int") -> torch.Tensor:
    """``x·Wᵀ`` for ``W`` ``[m, n]`` stored as the int grid stores it (:class:`~adahop.ptq.grids.IntGrid`), or
    with ``element="e2m1"`` as MXFP4 weights (:class:`~adahop.ptq.grids.MXFP4Grid`; :data:`ELEMENTS`).

    Args:
        x: ``[rows, n]``, any float dtype. codes: uint8, the packed ``bits``-bit codes of ``W`` row after row
            (:func:`~adahop.ptq.quantize.pack_bits`). scales: ``[m, ceil(n / group_size)]``, FP16 (int) or uint8
            E8M0 codes (e2m1).
        m, n, bits, group_size: ``W``'s shape, code width and group size.

    Returns:
        ``[rows, m]`` float32.

    Raises:
        ValueError: shapes, dtypes or sizes that do not fit together.
    """
    _check(x, codes, scales, m, n, bits, group_size, element)
    c = unpack_bits(codes.to(x.device), bits, m * n).reshape(m, n)
    if element == "e2m1":
        level, s = decode_e2m1(c), decode_e8m0(scales)
    else:
        level, s = c.float() - (2 ** (bits - 1) - 0.5), scales.float()
    return x.float() @ (level * s.repeat_interleave(group_size, 1)[:, :n]).T


TILE_CODES = 256
"""Codes of a row of ``W`` per tile of the matvec kernel (16 words at 2 bits, 32 at 4, 24 at 3)."""


def _unit(bits: int) -> tuple[int, int]:
    """(words, codes) of the smallest run of whole 32-bit words holding whole ``bits``-bit codes: (1, 16) at
    2 bits, (3, 32) at 3, (1, 8) at 4."""
    g = math.gcd(bits, 32)
    return bits // g, 32 // g


def _kernel_runs(bits: int, n: int, group_size: int, device: torch.device) -> bool:
    """Whether ``backend="auto"`` reads the codes with the Triton kernel: bits it reads, rows of ``W`` of whole units
    of whole 32-bit words of whole codes (:func:`_unit`), groups of whole units, on a device Triton runs on
    (:func:`~adahop.kernels.backend.triton_runs_on`). :func:`_why_not` says which fails."""
    return (bits in KERNEL_BITS and n % _unit(bits)[1] == 0 and group_size % _unit(bits)[1] == 0
            and triton_runs_on(device))


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _why_not(bits: int, n: int, group_size: int, device: torch.device) -> str:
    """Which of :func:`_kernel_runs`' conditions fail, in words."""
    why = []
    if bits not in KERNEL_BITS:
        why.append(f"bits={bits} (it reads {KERNEL_BITS})")
    elif n % _unit(bits)[1]:
        why.append(f"n={n}: rows of {bits}-bit codes that are not whole 32-bit words of whole codes (n must be a "
                   f"multiple of {_unit(bits)[1]})")
    elif group_size % _unit(bits)[1]:
        why.append(f"group_size={group_size}: groups of {bits}-bit codes that are not whole 32-bit words of whole "
                   f"codes (a multiple of {_unit(bits)[1]})")
    if not triton_runs_on(device):
        why.append(f"x on {device} (CUDA tensors, or the CPU under TRITON_INTERPRET=1)")
    return "; ".join(why)


def _splits(m: int, tiles: int, sms: int, block_m: int, per_sm: int) -> int:
    """How many slices of the input dimension (split-K) give ``sms`` SMs about ``per_sm`` programs each: a decode
    matvec has few outputs, and each program's loads are few, so latency is hidden by many programs at once."""
    want = -(-per_sm * sms // -(-m // block_m))
    per = -(-tiles // max(1, min(want, tiles)))  # tiles per split
    return -(-tiles // per)


def int_matvec(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, m: int, n: int, bits: int,
               group_size: int, *, backend: str = "auto", block_m: int | None = None, per_sm: int | None = None,
               sum_splits: bool = True, element: str = "int") -> torch.Tensor:
    """:func:`int_matvec_reference` with the codes read in place by a Triton kernel.

    ``backend``: ``auto`` (the kernel where it reads the codes, :func:`_kernel_runs`: bits 2, 3 and 4 with ``n`` and
    the group size multiples of 16, 32 and 8 respectively, on CUDA or under ``TRITON_INTERPRET=1``; else the
    reference; also the reference for more than :data:`MAX_KERNEL_ROWS` rows), ``triton`` or ``reference``. Same
    arguments, result and errors as the reference (FP32 sums in another order, split over the input dimension in a
    fixed way: equal to float rounding, the same every call), for ``|x| < 2^106`` (int codes; ``2^114`` for E2M1):
    the kernel scales ``x`` by up to ``2^22`` (int) or ``2^14`` (E2M1) before it multiplies, and overflows beyond.

    ``block_m`` (outputs a program computes, a power of two) and ``per_sm`` (programs per SM the split-K aims
    at) tune the kernel's speed only (``scripts/bench_decode.py --sweep``); they change the order of the sums.
    None takes :func:`matvec_tuning`'s choice for the shape.
    ``element``: what a code means (:data:`ELEMENTS`): the int grid's levels, or ``e2m1`` for MXFP4 weights
    (bits 4, uint8 E8M0 scales, groups of 32 in `adahop ptq`'s artifact).
    ``sum_splits=False`` returns the split-K partial sums ``[splits, rows, m]`` unsummed (``[1, rows, m]`` from the
    reference), for a consumer that adds them as it reads (:func:`~adahop.ptq.staged.apply_stages`).

    Raises:
        ValueError: as the reference; ``backend="triton"`` where the kernel does not read the codes; ``block_m``
            not an int power of two from 16 to 256, or ``per_sm`` not an int >= 1.
    """
    _check(x, codes, scales, m, n, bits, group_size, element)
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"int_matvec: backend {backend!r}; use auto, triton or reference")
    runs = _kernel_runs(bits, n, group_size, x.device) and x.shape[0] <= MAX_KERNEL_ROWS
    if backend == "triton" and not runs:
        why = _why_not(bits, n, group_size, x.device) or (f"{x.shape[0]} rows (the kernel takes at most "
                                                          f"{MAX_KERNEL_ROWS}: a launch grid's limit)")
        raise ValueError(f"int_matvec: backend='triton' cannot read these codes: {why}; use backend='auto' or 'reference'")
    auto_m, auto_sm = matvec_tuning(bits, m, n)
    block_m = auto_m if block_m is None else block_m
    per_sm = auto_sm if per_sm is None else per_sm
    if type(block_m) is not int or block_m not in (16, 32, 64, 128, 256):  # 16.0 or a tensor would pass `in`
        raise ValueError(f"int_matvec: block_m={block_m!r} must be a power of two from 16 to 256 (an int)")
    if type(per_sm) is not int or per_sm < 1:
        raise ValueError(f"int_matvec: per_sm={per_sm!r} must be an int >= 1")
    if backend == "reference" or (backend == "auto" and not runs):
        y = int_matvec_reference(x, codes, scales, m, n, bits, group_size, element=element)
        return y if sum_splits else y[None]
    import triton

    from ._triton_decode import int_matvec_kernel

    x = x.contiguous()
    codes, scales = codes.to(x.device).contiguous(), scales.to(x.device)  # where x is, as the reference does
    if codes.data_ptr() % 4:  # read as 32-bit words: a view needs them aligned
        codes = codes.clone()
    rows = x.shape[0]
    meta, splits, tiles_per_split = matvec_launch(m, n, bits, group_size, element, block_m, per_sm, _sms(x.device))
    y = torch.empty(splits, rows, m, dtype=torch.float32, device=x.device)
    int_matvec_kernel[(triton.cdiv(m, block_m), splits, rows)](
        x, codes.view(torch.int32), scales.contiguous(), y, m, n, scales.shape[1], rows, tiles_per_split,
        n * bits // 32, **meta)
    return y if not sum_splits else y[0] if splits == 1 else y.sum(0)


def matvec_tuning(bits: int, m: int, n: int) -> tuple[int, int]:
    """``(block_m, per_sm)`` for an ``m × n`` weight of ``bits``-bit codes, from ``bench_decode --sweep`` on an H100
    (docs/ptq.md, round 26): 128 outputs a program and 16 programs an SM for weights of 4M codes and more at 2 and 4
    bits (4096 × 4096 W2: 10.8 µs against 12.4 at 64 × 8), else 32 and 8 (3 bits: three words a unit; and small
    layers, where more programs hide more latency)."""
    return (128, 16) if bits != 3 and m * n >= 1 << 22 else (32, 8)


def matvec_launch(m: int, n: int, bits: int, group_size: int, element: str, block_m: int, per_sm: int,
                  sms: int) -> tuple[dict, int, int]:
    """The matvec kernel's compile-time arguments (:func:`matvec_meta`), its split-K count (:func:`_splits`) and
    tiles per split, for ``sms`` SMs. Ints in, no checks: for arguments :func:`int_matvec` has validated and
    :func:`_kernel_runs` accepts."""
    meta = matvec_meta(bits, group_size, element, block_m)
    tiles = -(-(n // meta["UNIT_CODES"]) // meta["BLOCK_U"])
    splits = _splits(m, tiles, sms, block_m, per_sm)
    return meta, splits, -(-tiles // splits)


def matvec_meta(bits: int, group_size: int, element: str, block_m: int) -> dict:
    """The matvec kernel's compile-time arguments for codes the kernel reads (:func:`_kernel_runs`)."""
    unit_words, unit_codes = _unit(bits)
    return {"BITS": bits, "GROUP": group_size, "BLOCK_M": block_m, "BLOCK_U": TILE_CODES // unit_codes,
            "UNIT_WORDS": unit_words, "UNIT_CODES": unit_codes, "E2M1": element == "e2m1"}


_BITS_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PackedLinear(nn.Module):
    """A linear layer computed from `adahop ptq`'s packed artifact, the weight never rebuilt: ``y = x Wᵀ``
    with ``W = S_m U Q Vᵀ S_n`` (module docstring).

    Args:
        grid: the layer's quantizer grid. stored: its tensors from the artifact (``codes``, scales).
        transform: its signs and rotations, or None (no incoherence processing).
        shape: ``(m, n)``, out × in. bias: ``[m]`` or None.

    Where :func:`int_matvec`'s Triton kernel runs (int codes of 2, 3 or 4 bits, or MXFP4, on CUDA) it reads the
    codes at every call (for more than :data:`MATVEC_ROWS` rows it decodes the weight for that call instead);
    otherwise (the CPU, NVFP4, which no kernel of ours reads yet) the weight is decoded once per device, on first
    use (FP32). Input ``[..., n]`` of any float dtype; output ``[..., m]`` in the input's dtype.
    ``.to(dtype)`` leaves the stored codes and scales as they are (only a bias is cast). The ``state_dict``
    holds the codes, the scales and, as extra state, the grid's configuration, the signs and the rotations'
    parameters (HARP's Θ), so a ``load_state_dict`` from another layer of the same shape, grid and rotation kinds
    gives that layer's outputs; one of another grid or rotations is refused before anything is copied.

    Raises:
        ValueError: ``stored`` without the grid's tensors; an input whose last dim is not ``n`` or that is not
            floating point; ``load_state_dict`` of a layer of another grid (name, bits, group size or scale dtypes),
            with other rotations (kind, size or configuration), or with signs that are not ±1.
    """

    def __init__(self, grid, stored: dict[str, torch.Tensor], transform, shape: tuple[int, int], bias=None):
        super().__init__()
        need = {"codes", *grid.stored_scales(torch.ones(1, 1))}  # what the grid's artifact entry holds
        if not need <= set(stored):
            raise ValueError(f"PackedLinear: stored lacks {sorted(need - set(stored))} (a {grid.name} layer stores "
                             f"{sorted(need)}); pass the layer's tensors from load_packed")
        self.grid, self.transform, (self.m, self.n) = grid, transform, shape
        self.register_buffer("codes", stored["codes"])
        # the grid's scales (and NVFP4's tensor scale) as buffers that move with the module, but held as integer
        # views of their stored bits: `model.to(torch.bfloat16)` casts float buffers, and would round the FP16 scales
        self._scale_dtypes = {k: v.dtype for k, v in stored.items()
                              if k != "codes" and not k.startswith(("signs_", "theta_"))}
        for k in self._scale_dtypes:
            v = stored[k]
            self.register_buffer(f"q_{k}", v.view(_BITS_OF[v.element_size()]) if v.is_floating_point() else v)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._cache: dict = {}  # per device: the rotations' stage kernels, the signs, a weight decoded once

    def scales(self) -> dict[str, torch.Tensor]:
        """The stored scales in their stored dtypes (the artifact's tensors)."""
        return {k: getattr(self, f"q_{k}").view(d) for k, d in self._scale_dtypes.items()}

    def _apply(self, fn, recurse=True):
        self._cache.clear()  # what was derived for a device may be stale after a move or a cast
        return super()._apply(fn, recurse)

    def _grid_config(self) -> dict:
        """What decides how the codes and scales decode: the grid's name, bits and group size."""
        return {"name": self.grid.name, "bits": self.grid.bits, "group_size": self.grid.group_size}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checked before any buffer is copied: a refused state then leaves this layer as it was
        for k, have in self._buffers.items():
            new = state_dict.get(prefix + k)
            if have is not None and isinstance(new, torch.Tensor) and new.dtype != have.dtype:
                # copy_ would convert the values: E8M0 codes read as FP16 bits (or the reverse) decode to garbage
                raise ValueError(f"PackedLinear({self.m}×{self.n}): the state's {k} is {new.dtype}, this "
                                 f"{self.grid.name} layer's {have.dtype}: a layer of another grid; load its folder "
                                 f"with load_packed_model instead")
        if prefix + "_extra_state" in state_dict:
            self._check_extra_state(state_dict[prefix + "_extra_state"])
        self._cache.clear()  # new codes or rotations: a weight decoded once, or stages built, would be stale
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def get_extra_state(self) -> dict:
        """The grid's configuration and the signs and rotations (HARP's Θ) in the ``state_dict``, beside the codes
        and scales: without them a ``load_state_dict`` from another folder's layer would keep this layer's
        rotations, or read another grid's scales as this one's. Not cast by ``.to``."""
        state = {"grid": self._grid_config()}
        t = self.transform
        if t is not None:
            state.update(signs_out=t.s_out.detach().cpu().clone(), signs_in=t.s_in.detach().cpu().clone(),
                         u=_rotation_state(t.u), v=_rotation_state(t.v))
        return state

    def _check_extra_state(self, state) -> None:
        """Raise ValueError unless :meth:`get_extra_state`'s ``state`` fits this layer (:meth:`set_extra_state`)."""
        fix = "load its folder with load_packed_model instead"
        if not isinstance(state, dict) or "grid" not in state:
            raise ValueError(f"PackedLinear({self.m}×{self.n}): the state's extra state {type(state).__name__} is "
                             f"not a PackedLinear's (a dict with its grid); {fix}")
        if state["grid"] != self._grid_config():
            raise ValueError(f"PackedLinear({self.m}×{self.n}): the state's grid {state['grid']} is not this layer's "
                             f"{self._grid_config()}; {fix}")
        t = self.transform
        if ("u" in state) != (t is not None):
            raise ValueError(f"PackedLinear({self.m}×{self.n}): the state is of a layer {'with' if t is None else 'without'}"
                             f" rotations, this one is {'without' if t is None else 'with'}; {fix}")
        if t is None:
            return
        for side, r in (("u", t.u), ("v", t.v)):
            kind, config = _rotation_config(r)
            if (state[side]["kind"], state[side]["config"]) != (kind, config):
                raise ValueError(f"PackedLinear({self.m}×{self.n}): the state's {side} rotation {state[side]['config']} "
                                 f"({state[side]['kind']}) is not this layer's {config} ({kind}); {fix}")
        for have, new in ((t.s_out, state["signs_out"]), (t.s_in, state["signs_in"])):
            if new.shape != have.shape or not bool(((new == 1) | (new == -1)).all()):
                raise ValueError(f"PackedLinear({self.m}×{self.n}): the state's signs must be ±1 vectors of "
                                 f"{have.shape[0]}")

    def set_extra_state(self, state) -> None:
        """Copy :meth:`get_extra_state`'s signs and Θ into this layer's rotations (in place) and drop its caches.

        Raises:
            ValueError: a state of another grid (name, bits or group size), with rotations for a layer without (or
                the reverse), rotations of another kind, size or configuration, or signs that are not ±1 vectors of
                this layer's sizes."""
        self._check_extra_state(state)
        t = self.transform
        if t is not None:
            with torch.no_grad():
                t.s_out.copy_(state["signs_out"])
                t.s_in.copy_(state["signs_in"])
                for side, r in (("u", t.u), ("v", t.v)):
                    for p, v in zip(r.thetas if isinstance(r, HARPRotation) else (), state[side].get("thetas", ())):
                        p.copy_(v)
        self._cache.clear()

    def _weight(self) -> torch.Tensor:
        """``Q``, the quantized weight decoded from the codes (float32 ``[m, n]``, on the codes' device)."""
        codes = unpack_bits(self.codes, self.grid.bits, self.m * self.n).reshape(self.m, self.n)
        return self.grid.decode(codes, self.scales())

    def _element(self) -> str | None:
        """What :func:`int_matvec` reads this layer's codes as, or None for a grid it does not read (NVFP4)."""
        return "int" if isinstance(self.grid, IntGrid) else "e2m1" if isinstance(self.grid, MXFP4Grid) else None

    def _reads_codes(self, device) -> bool:
        return self._element() is not None and _kernel_runs(self.grid.bits, self.n, self.grid.group_size, device)

    def _consts(self, device):
        if device not in self._cache:
            c = {}
            t = self.transform
            if t is not None:  # the rotations as a few merged stages, the signs folded in (adahop.ptq.staged)
                with torch.no_grad():
                    # the signs go as they are: fold_signs checks them, then moves them to the stages' device
                    c["v"] = fold_signs(merge_stages(rotation_stages(t.v, device=device), self.n), s_in=t.s_in)
                    c["u"] = fold_signs(merge_stages(rotation_stages(t.u, inverse=True, device=device), self.m),
                                        s_out=t.s_out)
            if not self._reads_codes(device):
                c["w"] = self._weight().to(device)
            self._cache[device] = c
        return self._cache[device]

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.n or not x.is_floating_point():
            raise ValueError(f"PackedLinear({self.m}×{self.n}) takes a float tensor [..., {self.n}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        c = self._consts(x.device)
        h = x.reshape(-1, self.n)
        if "v" in c:
            h = apply_stages(h, c["v"])  # (x ⊙ s_n)·V, read in x's dtype, float32 out
        if "w" in c:
            y = h.float() @ c["w"].T
        elif h.shape[0] > MATVEC_ROWS:  # a prompt: the weight decoded once for all rows, not read once per row
            y = h.float() @ self._weight().T
        else:  # with a rotation after it, the split-K partial sums go to its first stage unsummed
            y = int_matvec(h, self.codes, self.scales()["scales"], self.m, self.n, self.grid.bits, self.grid.group_size,
                           sum_splits="u" not in c, element=self._element())
        if "u" in c:  # ·Uᵀ ⊙ s_m, written in x's dtype unless a bias is still to be added in float32
            y = apply_stages(y, c["u"], x.dtype if self.bias is None else torch.float32)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.m)

    def extra_repr(self) -> str:
        rot = "none" if self.transform is None else type(self.transform.u).__name__
        return f"{self.m}×{self.n}, {self.grid.name} {self.grid.bits}-bit, rotation {rot}"


def _rotation_config(r) -> tuple[str, dict]:
    """A rotation's kind and the configuration that, with its Θ, determines it."""
    if isinstance(r, HARPRotation):
        return "harp", {k: getattr(r, k) for k in ("d", "radix", "max_radix", "passes", "mixer", "seed")}
    return type(r).__name__, {"d": r.d, "block": getattr(r, "block", None)}


def _rotation_state(r) -> dict:
    """A rotation's kind, configuration and (HARP) Θ, for :meth:`PackedLinear.get_extra_state`."""
    kind, config = _rotation_config(r)
    thetas = {"thetas": [th.detach().cpu().clone() for th in r.thetas]} if isinstance(r, HARPRotation) else {}
    return {"kind": kind, "config": config, **thetas}


def load_packed_model(folder: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
    """The transformers model `adahop ptq` saved in ``folder``, each quantized linear replaced by a
    :class:`PackedLinear` read from ``folder/ptq_packed.safetensors`` (the BF16 weights of those layers dropped).

    A folder without ``ptq.json`` (its run stopped after the export, e.g. while scoring ``--eval-tasks``) loads
    with a warning. The model's ``save_pretrained`` is refused: the folder already is the saved model (its BF16
    export for any tool, the packed artifact for this function).

    Raises:
        ValueError: ``folder`` does not exist or holds no packed artifact (not an `adahop ptq` output), a layer of
            the artifact that the model does not hold as an ``nn.Linear`` of its shape, or a CUDA ``device`` where
            torch has no GPU.
    """
    import transformers

    folder = Path(folder)
    if not folder.exists():
        raise ValueError(f"{folder} does not exist; pass a folder written by `adahop ptq`")
    if folder.is_file() and folder.name == PACKED_FILE:
        raise ValueError(f"{folder} is the packed artifact itself; pass its folder, {folder.parent}")
    if not (folder / PACKED_FILE).is_file():
        raise ValueError(f"{folder}: no {PACKED_FILE}; pass a folder written by `adahop ptq`")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"load_packed_model: device {device} but torch sees no CUDA GPU; pass device='cpu'")
    if why := unfinished(folder):
        warnings.warn(f"adahop: {why}", stacklevel=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    for name, (grid, stored, transform, shape) in load_packed(folder / PACKED_FILE).items():
        parent, _, leaf = name.rpartition(".")
        mod = model.get_submodule(parent) if parent else model
        old = getattr(mod, leaf, None)
        if not isinstance(old, nn.Linear) or tuple(old.weight.shape) != tuple(shape):
            raise ValueError(f"{folder}: the artifact's layer {name} {tuple(shape)} is not an nn.Linear of that shape in the model")
        setattr(mod, leaf, PackedLinear(grid, stored, transform, shape, old.bias))
    model.save_pretrained = _refuse_save(folder)  # transformers would write neither the codes nor the rotations
    return model.to(device).eval()


def _refuse_save(folder: Path):
    def save_pretrained(*args, **kwargs):
        raise NotImplementedError(f"a model of load_packed_model is saved already: copy its folder {folder} "
                                  f"(AutoModelForCausalLM.from_pretrained reads its BF16 export, load_packed_model "
                                  f"its packed codes), or torch.save(model.state_dict(), ...)")
    return save_pretrained
