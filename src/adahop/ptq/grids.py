"""Weight quantizer grids for PTQ: symmetric int with group scales, and the MXFP4 / NVFP4 element
grids of :mod:`adahop.formats`.

A grid quantizes a weight ``[m, n]`` in groups of ``group_size`` consecutive input columns, each
row of a group sharing one scale. GPTQ walks the columns left to right and fixes a group's scales
when it enters the group (from the error-updated weights), so the interface is split in two:
:meth:`Grid.scales` (``[m, g]`` → one scale per row) and :meth:`Grid.round` (values → codes and
their dequantized values under given scales). :meth:`Grid.fake_quantize` is RTN of a whole tensor
and is, by construction, GPTQ with ``H = I`` (tested).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch

from ..formats import decode_e2m1, decode_e8m0, encode_e2m1, quantize_mxfp4, quantize_nvfp4
from ..formats.e2m1 import E2M1_MAX
from ..formats.nvfp4 import E4M3_MAX, NVFP4_BLOCK
from .names import QUANTIZERS

__all__ = ["Grid", "IntGrid", "MXFP4Grid", "NVFP4Grid", "make_grid", "QUANTIZERS"]


@functools.lru_cache(maxsize=16)
def _clip_ratios(clip: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The clipping ratios as a ``[C, 1, 1]`` float32 tensor on ``device``, made once: a copy from the host on
    every call would stall HARP's fit, which rounds W̃ every step."""
    return torch.tensor(clip, dtype=torch.float32, device=device).view(-1, 1, 1)


@dataclass
class Grid:
    """Base of the grids. ``bits``: code bits per element; ``group_size``: columns per scale."""

    bits: int
    group_size: int

    name = "grid"
    #: a scale over the whole tensor (NVFP4's): rows are not rounded independently of each other, and
    #: fake_quantize reads that scale to the host (HARP's fit then neither stacks layers' rows nor uses a CUDA graph)
    tensor_scale = False

    def prepare(self, w: torch.Tensor) -> None:
        """Tensor-wide state taken from the whole weight before quantization (NVFP4's global scale)."""

    def scales(self, wg: torch.Tensor) -> torch.Tensor:
        """One scale per row of the group ``wg`` (``[m, k]``, ``k ≤ group_size``): float32 ``[m, 1]``."""
        raise NotImplementedError

    def round(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nearest grid point of ``x`` (``[m, k]``) under ``scale`` (``[m, 1]``): (uint8 codes, float32 values)."""
        raise NotImplementedError

    def stored_scales(self, scales: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the artifact stores for the ``[m, n_groups]`` scales (the tensors, in their stored dtypes)."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """Values of ``codes`` (uint8 ``[m, n]``) under the artifact's scales (:meth:`stored_scales`): float32."""
        s = self.scale_values(stored).repeat_interleave(self.group_size, 1)[:, : codes.shape[1]]
        return self.code_values(codes) * s

    def fake_quantize(self, w: torch.Tensor) -> torch.Tensor:
        """RTN of ``w`` ``[m, n]``: every group rounded under its own scales (float32)."""
        return self.quantize(w)[2]

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RTN with everything the artifact needs: (codes uint8 ``[m, n]``, scales ``[m, n_groups]``, values)."""
        self.prepare(w)
        m, n = w.shape
        g = self.group_size
        full = n // g * g
        parts = []
        if full:  # the whole groups at once: one row per (row, group)
            wg = w[:, :full].reshape(m * (n // g), g)
            s = self.scales(wg)
            c, v = self.round(wg, s)
            parts.append((c.reshape(m, full), s.reshape(m, n // g), v.reshape(m, full)))
        if full < n:  # the shorter last group on its own (2752 = 21·128 + 64): padding would change its scale
            s = self.scales(w[:, full:])
            c, v = self.round(w[:, full:], s)
            parts.append((c, s, v))
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(t, 1) for t in zip(*parts))

    def bits_per_weight(self, m: int, n: int) -> float:
        """Bits stored per weight of an ``[m, n]`` layer by codes and scales (rotations not included)."""
        nbytes = sum(t.numel() * t.element_size() for t in self.stored_scales(torch.ones(m, math.ceil(n / self.group_size))).values())
        return self.bits + 8 * nbytes / (m * n)


#: The smallest positive FP16 value (a subnormal), the floor of an int grid's scale: a group whose
#: values are all 0 (or below it) is stored as ±½ of it, 3e-8, not as NaN.
FP16_MIN_SCALE = 2.0**-24
#: The largest finite FP16 value, the ceiling of an int grid's scale: a group max above ``FP16_MAX·(2^(b−1) − ½)``
#: cannot be stored (quantize_layer names it).
FP16_MAX = 65504.0


@dataclass
class IntGrid(Grid):
    """Symmetric uniform grid of ``2^bits`` levels ``(k + ½)·s``, ``k ∈ [−2^(b−1), 2^(b−1))``
    ("mid-rise": all codes used, no zero level), one FP16 scale per row of each group, at least
    :data:`FP16_MIN_SCALE` (rows of a group whose amax is below ~1e-7 lose their precision: FP16's floor).

    ``clip``: candidate clipping ratios; the scale of each row of a group is the one whose
    rounding error (sum of squares) is smallest, ``s = r·amax / (2^(b−1) − ½)`` (ratio 1: no
    clipping). At 2 bits, clipping matters: a Gaussian group's optimal 4-level grid sits well
    inside its amax.
    """

    clip: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
    name = "int"

    def _half(self) -> float:
        return 2 ** (self.bits - 1) - 0.5

    def scales(self, wg: torch.Tensor) -> torch.Tensor:
        amax = wg.float().abs().amax(1, keepdim=True)
        ratios = _clip_ratios(tuple(self.clip), wg.device)
        # [C, m, 1]: the stored FP16 scale is the one used; at least FP16's smallest step (2⁻²⁴), or an
        # all-zero group (a pruned head, GPTQ's dead inputs) would get scale 0 and decode 0/0 = NaN
        s = (ratios * amax / self._half()).half().float().clamp(min=FP16_MIN_SCALE)
        # every candidate at once (a few kernels, not a dozen per candidate: HARP's fit rounds W̃ every step);
        # argmin keeps the first of equal errors, the order of `clip`
        err = (self.round(wg, s)[1] - wg).pow(2).sum(-1, keepdim=True)
        return s.gather(0, err.argmin(0, keepdim=True))[0]

    def round(self, x, scale):
        lo = 2 ** (self.bits - 1)
        k = torch.clamp(torch.floor(x.float() / scale), -lo, lo - 1)  # the cell holding x: level (k + ½)·s
        return (k + lo).to(torch.uint8), (k + 0.5) * scale

    def stored_scales(self, scales):
        return {"scales": scales.half()}

    def scale_values(self, stored):
        return stored["scales"].float()

    def code_values(self, codes):
        return codes.float() - 2 ** (self.bits - 1) + 0.5


@dataclass
class MXFP4Grid(Grid):
    """MXFP4 weights (OCP MX v1.0): E2M1 elements, one E8M0 scale per 32 input columns, the scale
    rule of :func:`adahop.formats.quantize_mxfp4` (``scale_rule``, OCP ``floor`` by default)."""

    scale_rule: str = "floor"
    name = "mxfp4"

    def scales(self, wg):
        q = quantize_mxfp4(wg.float(), axis=1, block_size=self.group_size, scale_rule=self.scale_rule)
        return decode_e8m0(q.scales[:, :1]).float()

    def round(self, x, scale):
        codes = encode_e2m1(x.float() / scale)  # division by a power of two: exact, as quantize_mxfp4's ldexp
        return codes, decode_e2m1(codes) * scale

    def stored_scales(self, scales):
        return {"scales": (torch.log2(scales).round() + 127).to(torch.uint8)}  # E8M0 codes

    def scale_values(self, stored):
        return decode_e8m0(stored["scales"]).float()

    def code_values(self, codes):
        return decode_e2m1(codes)

    def fake_quantize(self, w):
        return quantize_mxfp4(w.float(), axis=1, block_size=self.group_size, scale_rule=self.scale_rule).dequantize()


@dataclass
class NVFP4Grid(Grid):
    """NVFP4 weights: E2M1 elements, an E4M3 scale per 16 input columns and one FP32 tensor scale
    (:func:`adahop.formats.quantize_nvfp4`'s rule ``s_block = E4M3(amax / 6 / s_global)``, with
    ``s_global = amax_tensor / (448·6)`` taken from the weight before GPTQ updates it)."""

    name = "nvfp4"
    tensor_scale = True
    global_scale: float | None = None

    def prepare(self, w):
        self.global_scale = float(quantize_nvfp4(w.float(), axis=1).global_scale)

    def scales(self, wg):
        if self.global_scale is None:
            raise ValueError("NVFP4Grid.scales before prepare(w): the tensor scale comes from the whole weight")
        amax = wg.float().abs().amax(1, keepdim=True)
        s_block = (amax / E2M1_MAX / self.global_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
        return s_block * self.global_scale

    def round(self, x, scale):
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = encode_e2m1(torch.where(scale > 0, x.float() / safe, torch.zeros_like(x, dtype=torch.float32)))
        return codes, decode_e2m1(codes) * scale

    def stored_scales(self, scales):
        g = self.global_scale or 1.0
        return {"scales": (scales / g).to(torch.float8_e4m3fn).view(torch.uint8),
                "global_scale": torch.tensor([g], dtype=torch.float32)}

    def scale_values(self, stored):
        return stored["scales"].view(torch.float8_e4m3fn).float() * stored["global_scale"].float()

    def code_values(self, codes):
        return decode_e2m1(codes)

    def fake_quantize(self, w):
        q = quantize_nvfp4(w.float(), axis=1)
        self.global_scale = float(q.global_scale)
        return q.dequantize()


def _integer(flag: str, v) -> int:
    """``v`` as a Python int (numpy and torch integers too; not a bool, a float or a string)."""
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{flag} {v!r}: must be an integer, not {type(v).__name__}") from None


def make_grid(quantizer: str, bits: int, group_size: int | None = None) -> Grid:
    """The grid of ``--quantizer`` at ``--bits`` with ``--group-size``.

    ``int``: 2–8 bits, group size default 128. ``mxfp4``/``nvfp4``: 4 bits only, their block size
    (32 / 16) as the group.

    Raises:
        ValueError: an unknown quantizer, bits or a group size that are not integers, bits outside what
            it supports, or a group size the format fixes otherwise; each message names the option and the fix.
    """
    if quantizer not in QUANTIZERS:
        raise ValueError(f"--quantizer {quantizer!r} is not known; use one of {', '.join(QUANTIZERS)}")
    bits = _integer("--bits", bits)
    group_size = None if group_size is None else _integer("--group-size", group_size)
    if quantizer == "int":
        if not 2 <= bits <= 8:
            raise ValueError(f"--bits {bits}: the int quantizer takes 2 to 8 bits")
        g = 128 if group_size is None else group_size
        if g < 1:
            raise ValueError(f"--group-size {g} must be >= 1")
        return IntGrid(bits, g)
    block = 32 if quantizer == "mxfp4" else NVFP4_BLOCK
    if bits != 4:
        raise ValueError(f"--quantizer {quantizer} stores 4-bit E2M1 elements, --bits {bits} cannot be; pass --bits 4, "
                         f"or --quantizer int for {bits} bits")
    if group_size not in (None, block):
        raise ValueError(f"--quantizer {quantizer} has one scale per {block} elements; drop --group-size {group_size} "
                         f"(or pass {block})")
    return MXFP4Grid(4, block) if quantizer == "mxfp4" else NVFP4Grid(4, block)
