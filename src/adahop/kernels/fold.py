"""Fold an MXFP4 tensor into FP8 E4M3 with one FP32 scale per row.

The fold is the Hopper fast path of `DESIGN.md` §3: every E2M1 value ``q`` times ``2^d`` is exact in
E4M3 for ``d = 0 … −8``. A row whose finite block exponents ``e`` all lie within 8 of the row's
largest ``E`` (quantize with ``max_scale_range=8``) is therefore exactly ``fp8 · 2^E`` with
``fp8 = q · 2^(e − E)``, and an MXFP4 GEMM becomes an FP8 GEMM with row-wise scales.
"""

from __future__ import annotations

import torch

from ..device_constants import on_device, skip_host_checks
from ..formats.e2m1 import decode_e2m1, decode_e8m0, unpack_e2m1
from ..formats.mxfp4 import FOLD_RANGE, MXTensor, folds_exactly
from .backend import resolve_backend

__all__ = ["fold_to_fp8", "fold_to_fp8_reference", "fold_to_fp8_triton"]


def _make_fold_table() -> torch.Tensor:
    """uint8 [(FOLD_RANGE + 1) * 16]: the E4M3 bits of ``decode_e2m1(code) · 2^-shift`` at
    ``shift * 16 + code`` (-0, code 8, as +0); the last entry is the E4M3 NaN (0x7F)."""
    codes = torch.arange(16, dtype=torch.uint8)
    shifts = torch.arange(FOLD_RANGE + 1, dtype=torch.float32)
    vals = decode_e2m1(codes)[None, :] * torch.exp2(-shifts)[:, None]
    vals = torch.where(vals == 0, 0.0, vals)  # code 8 (-0) folds to +0: a GEMM operand, where a zero's sign is no number
    bits = vals.to(torch.float8_e4m3fn).view(torch.uint8).flatten()
    return torch.cat((bits, torch.tensor([float("nan")]).to(torch.float8_e4m3fn).view(torch.uint8)))


with torch.device("cpu"):  # built once, on the CPU, at import (even inside a `with torch.device("meta")` build)
    _TABLE = _make_fold_table()


def _fold_table(device) -> torch.Tensor:
    """:data:`_TABLE` on ``device``, cached per device (:func:`adahop.device_constants.on_device`)."""
    return on_device(("fold_table",), lambda: _TABLE, device)


def _row_blocks(q: MXTensor):
    """``q`` as rows of blocks: codes ``[rows, nb, bs]`` (uint8), finite-block mask, block
    exponents ``e`` ``[rows, nb]`` (int32) and each row's largest finite exponent ``[rows]``
    (−127 for a row with none)."""
    codes = unpack_e2m1(q.codes)  # [*outer, kp]
    kp, bs = codes.shape[-1], q.block_size
    rows = codes.numel() // kp if kp else 0
    codes = codes.reshape(rows, kp // bs, bs)
    sc = q.scales.reshape(rows, kp // bs)
    finite = sc != 255
    e = sc.to(torch.int32) - 127
    row_e = torch.where(finite, e, torch.full_like(e, -127)).amax(dim=1) if kp else e.new_full((rows,), -127)
    return codes, finite, e, row_e


def _check_range(q: MXTensor, blocks=None) -> None:
    """Raise unless every row of ``q`` folds exactly (its finite, nonzero blocks lie within
    :data:`FOLD_RANGE` of the row's largest). Syncs with the device; skipped when the quantizer
    already enforced ``max_scale_range <= 8`` (``q.scale_range``) and where a host sync must not
    happen (:func:`adahop.device_constants.skip_host_checks`: torch.compile, fake modes, CUDA-graph capture). ``blocks``: :func:`_row_blocks` of ``q``, if at hand."""
    if folds_exactly(q.scale_range) or skip_host_checks():
        return
    codes, finite, e, row_e = blocks if blocks is not None else _row_blocks(q)
    nonzero = (codes & 7).amax(dim=-1) > 0 if codes.numel() else torch.zeros_like(finite)
    too_far = finite & (row_e[:, None] - e > FOLD_RANGE) & nonzero
    if bool(too_far.any()):
        r = int(too_far.any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"fold_to_fp8: row {r} has block exponents {int(e[r][finite[r]].min())}..{int(row_e[r])}, a range "
            f"over {FOLD_RANGE}, which FP8 E4M3 cannot hold exactly; quantize with max_scale_range={FOLD_RANGE}"
        )


def fold_to_fp8_reference(q: MXTensor, *, backend: str = "reference") -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`fold_to_fp8` (same arguments and result; ``backend`` is ignored)."""
    blocks = _row_blocks(q)
    _check_range(q, blocks)
    codes, finite, e, row_e = blocks
    rows, kp = codes.shape[0], codes.shape[1] * codes.shape[2]
    # One byte gather per element: the FP8 bits of every (shift, code) pair come from a 9×16 table
    # (exact: q·2^-shift is an E4M3 value for shift in 0..8; blocks further down hold only zeros).
    shift = torch.where(finite, (row_e[:, None] - e).clamp(max=FOLD_RANGE), torch.zeros_like(e))
    idx = shift.unsqueeze(-1) * 16 + codes.to(torch.int32)  # int32 indices: half the bytes of int64
    table = _fold_table(codes.device)
    bits = torch.where(finite.unsqueeze(-1), table[idx], table[-1])
    fp8 = bits.reshape(rows, kp).view(torch.float8_e4m3fn)
    row_scale = decode_e8m0((row_e + 127).to(torch.uint8))
    if q.elem_scale != 1.0:
        row_scale = row_scale * _f32(q.elem_scale)  # a Python float: no host-to-device copy under CUDA-graph capture
    return fp8, row_scale


#: float32 values of the element scales the quantizers write (1, and 4/3 for the tseng rule), as
#: Python floats: computing them inside a compiled region would be a graph break.
_F32_ELEM = {1.0: 1.0, 4.0 / 3.0: float(torch.tensor(4.0 / 3.0, dtype=torch.float32, device="cpu"))}  # cpu: importable under torch.device("meta")


def _f32(v: float) -> float:
    """``v`` rounded to float32, as a Python float."""
    got = _F32_ELEM.get(v)
    return float(torch.tensor(v, dtype=torch.float32, device="cpu")) if got is None else got


def _triton():
    from . import _triton_fold  # lazy: Triton is needed only here

    return _triton_fold


def fold_to_fp8_triton(q: MXTensor, *, backend: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of :func:`fold_to_fp8`: one kernel, one read of the packed tensor, one FP8 write."""
    _check_range(q)
    kp = q.codes.shape[-1] * 2
    rows = q.codes.numel() * 2 // kp if kp else 0
    codes, scales = q.codes.reshape(rows, kp // 2).contiguous(), q.scales.reshape(rows, -1).contiguous()
    elem = _f32(q.elem_scale)  # the float32 the reference multiplies by: a constant for torch.compile
    tf = _triton()  # traced by dynamo: the triton_op (its launch per _triton_launch.TRACED_LAUNCHES); else its body
    op = tf.fold_op if torch.compiler.is_dynamo_compiling() else tf.fold
    return op(codes, scales, elem)


def fold_to_fp8(q: MXTensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Fold ``q`` into FP8 E4M3 values and one FP32 scale per row, exactly.

    Args:
        q: an :class:`MXTensor` with 32-element blocks whose finite block exponents lie, in every
            row, within :data:`FOLD_RANGE` (8) of the row's largest
            (``quantize_mxfp4(..., max_scale_range=8)``). Blocks further below that hold only
            zeros are accepted too.
        backend: ``"auto"`` (the Triton kernel on CUDA, else the PyTorch reference),
            ``"triton"`` or ``"reference"``; the result is the same byte for byte.

    Returns:
        ``(fp8, row_scale)``: ``float8_e4m3fn [rows, padded_len]`` with the blocked axis last
        (``rows`` = the product of the other dims, as in ``q.codes``) and ``float32 [rows]``,
        such that ``fp8.float() * row_scale[:, None]`` equals ``q.dequantize()`` (moved, padded)
        bit for bit. NaN blocks (scale code 255) fold to NaN. For ``elem_scale != 1`` (the
        ``tseng`` rule) the row scale carries it.

    Raises:
        ValueError: a row's exponent range exceeds 8; quantize with ``max_scale_range=8``.
        RuntimeError: ``backend="triton"`` without Triton or CUDA.

    Notes:
        ``q.fp8``, when the fused quantizer set it, holds this same result (`DESIGN.md` §3).
        The range check syncs with the device once, unless ``q.scale_range <= 8`` (the
        quantizer guaranteed it) or under torch.compile. An FP8-only ``q`` (``q.codes_dropped``)
        returns its ``q.fp8``.
    """
    if q.codes_dropped:
        if q.fp8 is None:
            raise ValueError("fold_to_fp8: the MXTensor holds neither codes nor its FP8 fold; quantize with outputs='all'")
        return q.fp8
    be = resolve_backend(backend, q.codes.device)
    fn = fold_to_fp8_triton if be == "triton" and q.block_size == 32 else fold_to_fp8_reference
    return fn(q)
