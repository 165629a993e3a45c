"""Input checks and layout helpers shared by the block formats."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_float_input(x: torch.Tensor, axis: int, fn: str) -> None:
    """Raise a TypeError/ValueError naming what was passed and what is accepted."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{fn} got dtype {x.dtype}; accepted: float32, float16, bfloat16, float64 "
            "(cast integer data to float first)"
        )
    if x.ndim == 0:
        raise ValueError(f"{fn} needs a tensor with at least one dimension, got a scalar")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{fn}: axis={axis} is out of range for a tensor of shape {tuple(x.shape)}")
    if x.shape[axis] == 0:
        raise ValueError(f"{fn}: axis {axis} of shape {tuple(x.shape)} is empty; nothing to quantize")
    if x.numel() == 0:  # an empty batch: the block reshapes and the tensor amax have nothing to work on
        raise ValueError(f"{fn}: x of shape {tuple(x.shape)} has no elements; nothing to quantize "
                         "(skip the call for an empty batch)")


def move_and_pad(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """Move ``axis`` last and zero-pad it per row to a multiple of ``block``."""
    xm = x.movedim(axis, -1)
    pad = (-xm.shape[-1]) % block
    return F.pad(xm, (0, pad)) if pad else xm.contiguous()


def unpad_and_restore(xm: torch.Tensor, shape: tuple[int, ...], axis: int) -> torch.Tensor:
    """Inverse of :func:`move_and_pad`: drop the padding and move the last axis back."""
    return xm[..., : shape[axis]].movedim(-1, axis).reshape(shape)
