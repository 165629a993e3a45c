"""Number formats as pure tensor functions: E2M1 elements, E8M0/E4M3 scales, MXFP4, NVFP4.

No autograd and no modules here (`DESIGN.md` §2, layer 1).
"""

from __future__ import annotations

import torch

from .e2m1 import E2M1_MAX, E2M1_VALUES, decode_e2m1, decode_e8m0, encode_e2m1, pack_e2m1, unpack_e2m1
from .mxfp4 import SCALE_RULES, MXTensor, quantize_mxfp4
from .nvfp4 import NVFP4Tensor, quantize_nvfp4

__all__ = [
    "E2M1_VALUES",
    "E2M1_MAX",
    "SCALE_RULES",
    "FORMATS",
    "MXTensor",
    "NVFP4Tensor",
    "decode_e2m1",
    "decode_e8m0",
    "encode_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize",
    "fake_quantize",
]

#: Formats understood by :func:`quantize` / :func:`fake_quantize`.
FORMATS = ("mxfp4", "nvfp4")


def quantize(x: torch.Tensor, fmt: str, **kw) -> MXTensor | NVFP4Tensor:
    """Quantize ``x`` to ``fmt`` (``"mxfp4"`` or ``"nvfp4"``); keyword arguments go to
    :func:`quantize_mxfp4` or :func:`quantize_nvfp4`.

    Raises:
        ValueError: unknown ``fmt`` (the message lists :data:`FORMATS`).
    """
    if fmt == "mxfp4":
        return quantize_mxfp4(x, **kw)
    if fmt == "nvfp4":
        return quantize_nvfp4(x, **kw)
    raise ValueError(f"fmt={fmt!r} is not a known format; use one of {FORMATS}")


def fake_quantize(x: torch.Tensor, fmt: str, **kw) -> torch.Tensor:
    """Quantize then dequantize: the values ``x`` takes in ``fmt``, in ``x``'s dtype and shape."""
    return quantize(x, fmt, **kw).dequantize(x.dtype)
