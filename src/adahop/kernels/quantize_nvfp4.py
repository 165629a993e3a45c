"""Block Hadamard (optional) + NVFP4 quantization of one GEMM operand: reference and Triton twins.

``iht_quantize_nvfp4`` is what the NVFP4 GEMMs (recipes ``nvfp4``, ``averis``) call for every
operand. The reference is :func:`adahop.formats.quantize_nvfp4` after the MXFP4 quantizer's
Hadamard (:func:`~adahop.kernels.quantize_mxfp4.hadamard_butterfly` up to 256, the Kronecker form
above); the Triton path
(``_triton_quantize_nvfp4.py``) does transform, quantize and pack in two launches (tensor amax,
then blocks) and, for an operand the GEMM consumes at once, writes the GEMM's BF16 operand
``q · s_block`` itself (exact, `adahop.kernels.nvfp4_matmul`), so the GEMM skips its build from
the codes. Round to nearest: codes, block scales and tensor scale equal the reference bit for bit.
Stochastic rounding: the same block scales (rounded up, `specs/baselines.md` §1.7), codes drawn
from Triton's Philox stream: statistically, not bitwise, equal.
"""

from __future__ import annotations

import torch

from ..formats.nvfp4 import NVFP4Tensor, quantize_nvfp4
from ..hadamard import check_block_size
from .backend import resolve_backend
from .quantize_mxfp4 import TRITON_HADAMARD_SIZES, _check_operand, _check_zero_rows, _iht_transform

__all__ = ["iht_quantize_nvfp4", "iht_quantize_nvfp4_reference", "iht_quantize_nvfp4_triton", "NV_OUTPUTS"]

#: What the Triton quantizer writes besides the block and tensor scales: ``"all"`` (codes and the
#: BF16 GEMM operand), ``"codes"`` (an operand saved for backward), ``"values"`` (the BF16 operand
#: only: one the GEMM consumes at once; ``codes`` is then ``[rows, 0]``).
NV_OUTPUTS = ("all", "codes", "values")


def _check_args(x, axis, hadamard_block, signs, rounding, tile_2d, global_scale, outputs, zero_rows) -> int:
    _check_operand(x, axis, "iht_quantize_nvfp4")
    if x.numel() == 0:
        raise ValueError(f"iht_quantize_nvfp4: x of shape {tuple(x.shape)} has no elements; nothing to quantize")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding={rounding!r} is not supported; use 'nearest' or 'stochastic'")
    axis = axis % 2
    if hadamard_block is not None:
        check_block_size(hadamard_block, "hadamard_block")
        if x.shape[axis] % hadamard_block:
            raise ValueError(f"iht_quantize_nvfp4: dimension {axis} has length {x.shape[axis]}, which hadamard_block="
                             f"{hadamard_block} does not divide; pad it to a multiple of {hadamard_block} or use None")
    if signs is not None and (hadamard_block is None or signs.ndim != 1 or signs.numel() != hadamard_block):
        raise ValueError(f"signs must be a 1-D ±1 vector of length hadamard_block={hadamard_block}, got shape "
                         f"{tuple(signs.shape)}" + ("" if hadamard_block else " (signs need a Hadamard block)"))
    if global_scale is not None and (not isinstance(global_scale, torch.Tensor) or global_scale.numel() != 1):
        raise ValueError(f"global_scale must be a one-element tensor, got {global_scale!r}; pass None to derive it")
    if outputs not in NV_OUTPUTS:
        raise ValueError(f"outputs={outputs!r} is not one of {NV_OUTPUTS}")
    _check_zero_rows(zero_rows)
    return axis


def iht_quantize_nvfp4_reference(
    x: torch.Tensor, *, axis: int, hadamard_block: int | None = None, signs: torch.Tensor | None = None,
    rounding: str = "nearest", tile_2d: bool = False, global_scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None, backend: str = "reference", outputs: str = "all",
    zero_rows: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Reference: ``quantize_nvfp4(H(x) if hadamard_block else x, ...)``, ``H`` the butterfly for blocks
    up to 256 and the Kronecker form above (as ``iht_quantize_mxfp4``'s).

    Arguments and result as :func:`iht_quantize_nvfp4` (``backend`` is ignored; the result has
    codes whatever ``outputs`` asks, and ``values=None``).
    """
    axis = _check_args(x, axis, hadamard_block, signs, rounding, tile_2d, global_scale, outputs, zero_rows)
    if zero_rows is not None:
        x = x.index_fill(1 - axis, zero_rows, 0)
    if hadamard_block is not None:
        x = _iht_transform(x, hadamard_block, axis, signs)
    return quantize_nvfp4(x, axis=axis, rounding=rounding, generator=generator, tile_2d=tile_2d,
                          global_scale=global_scale)


# ----------------------------------------------------------------------------- Triton path


def _triton():
    from . import _triton_quantize_nvfp4  # lazy: Triton is needed only here

    return _triton_quantize_nvfp4


def iht_quantize_nvfp4_triton(
    x: torch.Tensor, *, axis: int, hadamard_block: int | None = None, signs: torch.Tensor | None = None,
    rounding: str = "nearest", tile_2d: bool = False, global_scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None, backend: str = "triton", outputs: str = "all",
    zero_rows: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Triton path of :func:`iht_quantize_nvfp4` (same arguments; ``backend`` is ignored).

    Sets ``values`` on the result unless ``outputs="codes"``; with ``outputs="values"`` its
    ``codes`` are ``[rows, 0]``. Stochastic rounding draws one seed from ``generator``.

    Raises:
        ValueError: as the reference, and a Hadamard block the kernel lacks (above 256).
    """
    axis = _check_args(x, axis, hadamard_block, signs, rounding, tile_2d, global_scale, outputs, zero_rows)
    if hadamard_block is not None and hadamard_block not in TRITON_HADAMARD_SIZES:
        raise ValueError(f"iht_quantize_nvfp4: the Triton kernel takes hadamard_block in {TRITON_HADAMARD_SIZES}, got "
                         f"{hadamard_block}; use backend='reference' or 'auto'")
    if global_scale is not None:
        global_scale = _checked_global_scale(global_scale, x.device)
    if signs is not None:
        signs = signs.to(device=x.device, dtype=torch.float32).contiguous()
    seed = None
    if rounding == "stochastic":
        gdev = generator.device if generator is not None else x.device
        seed = torch.randint(0, 2**62, (1,), generator=generator, device=gdev, dtype=torch.int64).to(x.device)
    keep = None
    if zero_rows is not None:  # a byte per output row, 0 where OE extracted it
        keep = torch.ones(x.shape[1 - axis], dtype=torch.uint8, device=x.device).index_fill_(0, zero_rows.to(x.device), 0)
    tq = _triton()
    # traced by dynamo: the triton_op (its launches per _triton_launch.TRACED_LAUNCHES); else its body, without the op's dispatch
    op = tq.quantize_op if torch.compiler.is_dynamo_compiling() else tq.nv_quantize
    codes, scales, gs, values = op(x, axis, hadamard_block or 0, signs, rounding == "stochastic", tile_2d, seed,
                                   global_scale, outputs != "values", outputs != "codes", keep)
    return NVFP4Tensor(codes=codes, scales=scales, global_scale=gs, shape=tuple(x.shape), axis=axis, tile_2d=tile_2d,
                       values=values if outputs != "codes" else None)


def _checked_global_scale(gs: torch.Tensor, device) -> torch.Tensor:
    """A given tensor scale as float32 ``[1]`` on ``device``; refused (a host sync, as the reference's
    check) unless it is positive."""
    from ..device_constants import skip_host_checks

    gs = gs.to(device=device, dtype=torch.float32).reshape(1)
    if not skip_host_checks() and not bool(gs[0] > 0):
        raise ValueError(f"global_scale must be one positive number, got {gs!r}; pass None to derive it")
    return gs


def iht_quantize_nvfp4(
    x: torch.Tensor, *, axis: int, hadamard_block: int | None = None, signs: torch.Tensor | None = None,
    rounding: str = "nearest", tile_2d: bool = False, global_scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None, backend: str = "auto", outputs: str = "all",
    zero_rows: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Block-Hadamard-transform (optional) and quantize a GEMM operand to NVFP4 along ``axis``.

    Args:
        x: 2-D ``[R, C]`` float tensor (bf16 or fp32 in training; any strides).
        axis: the GEMM's contracted dim (1 for A = X/∇Y, 0 for the wgrad operands and Wᵀ); blocks
            of 16 along it, zero-padded per row.
        hadamard_block: Sylvester block ``b`` applied along ``axis`` first (16 in the ``nvfp4``
            recipe's wgrad), or None. Must divide ``x.shape[axis]``.
        signs: optional ±1 float vector of length ``hadamard_block`` (the RHT's signs).
        rounding: ``"nearest"`` (half-to-even) or ``"stochastic"`` (block scale rounded up).
        tile_2d: one scale per 16×16 tile (weights).
        global_scale: the FP32 tensor scale to use (one positive number) instead of t_amax/2688.
        generator: stochastic-rounding randomness (reproducible under a seed).
        backend: ``"auto"`` (Triton on CUDA, else the reference), ``"triton"`` or ``"reference"``;
            it never changes round-to-nearest results. A Hadamard block above 256 is applied
            first (its Kronecker form, as the reference does), then quantized by the kernel;
            ``hadamard_block=1`` runs the reference.
        outputs: what the Triton path writes (:data:`NV_OUTPUTS`); the reference always returns
            codes and no ``values``. Values never depend on it.
        zero_rows: 1-D integer indices of rows (along the dim *not* quantized: ``1 - axis``) to
            quantize as zeros, as ``x.index_fill(1 - axis, zero_rows, 0)`` would.

    Returns:
        :class:`~adahop.formats.NVFP4Tensor` of logical shape ``x.shape`` blocked along ``axis``
        (codes ``[rows, Kp/2]``, scales ``[rows, Kp/16]``, ``rows`` the other dim), and from the
        Triton path, unless ``outputs="codes"``, ``values`` = BF16 ``q · s_block`` ``[rows, Kp]``.

    Raises:
        ValueError: not 2-D or empty, bad axis, unsupported Hadamard size or one that does not
            divide the dim, bad ``signs``, unknown rounding or ``outputs``, a ``global_scale`` that
            is not one positive number, ``zero_rows`` not a 1-D integer tensor.
        TypeError: non-floating ``x``.
        RuntimeError: backend ``"triton"`` without Triton or CUDA.
    """
    be = resolve_backend(backend, x.device)
    if be == "triton" and hadamard_block is not None and hadamard_block > TRITON_HADAMARD_SIZES[-1]:
        # a block the kernel lacks: the reference's transform, then the kernel without one (zeroing whole
        # rows commutes with a transform along them)
        axis = _check_args(x, axis, hadamard_block, signs, rounding, tile_2d, global_scale, outputs, zero_rows)
        x = _iht_transform(x, hadamard_block, axis, signs)
        hadamard_block, signs = None, None
    # a 1-point "transform" is the reference's (it only turns -0 into +0)
    fn = iht_quantize_nvfp4_triton if be == "triton" and hadamard_block != 1 else iht_quantize_nvfp4_reference
    return fn(x, axis=axis, hadamard_block=hadamard_block, signs=signs, rounding=rounding, tile_2d=tile_2d,
              global_scale=global_scale, generator=generator, outputs=outputs, zero_rows=zero_rows)
