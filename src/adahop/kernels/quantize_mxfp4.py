"""Block Hadamard + MXFP4 quantization of one GEMM operand: reference and fused Triton twins.

``iht_quantize_mxfp4`` is what the layers call for every operand of every MXFP4 GEMM. The
reference is plain PyTorch; the Triton path does transform, quantize, pack and the FP8 fold in
one kernel (two for a transposing or very long contracted dim) and matches the reference bit for
bit under round-to-nearest (codes, scales and FP8 fold). See `DESIGN.md` §3 and
`docs/kernels_notes.md`.
"""

from __future__ import annotations

import math

import torch

from ..formats.mxfp4 import MXTensor, check_mx_options, folds_exactly, quantize_mxfp4
from ..hadamard import block_hadamard, check_block_size
from .backend import resolve_backend

__all__ = [
    "iht_quantize_mxfp4",
    "iht_quantize_mxfp4_reference",
    "iht_quantize_mxfp4_triton",
    "hadamard_butterfly",
    "TRITON_HADAMARD_SIZES",
    "OUTPUTS",
]

#: What the fused quantizer writes: ``"all"`` (codes, scales and, when ``max_scale_range`` <= 8, the
#: FP8 fold), ``"codes"`` (codes and scales: an operand saved for backward), ``"fp8"`` (the FP8 fold
#: and scales: an operand the GEMM consumes at once; needs ``max_scale_range`` 0…8).
OUTPUTS = ("all", "codes", "fp8")

#: Hadamard block sizes the fused kernel supports (others run the reference under ``"auto"``).
TRITON_HADAMARD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)


def _check_divides(n: int, axis: int, block: int) -> None:
    if n % block:
        raise ValueError(
            f"iht_quantize_mxfp4: dimension {axis} has length {n}, which hadamard_block={block} does not "
            f"divide; pad it to a multiple of {block} or use hadamard_block=None"
        )


def hadamard_butterfly(x: torch.Tensor, *, block_size: int = 32, axis: int = -1,
                       signs: torch.Tensor | None = None) -> torch.Tensor:
    """``adahop.hadamard.block_hadamard`` computed as the fused kernel computes it, in float32.

    Each ``block_size`` chunk ``v`` along ``axis`` becomes ``((v ⊙ s) · H_b)`` through log2(b)
    constant-geometry (Pease) stages ``y[i] = x[2i] + x[2i+1], y[i + b/2] = x[2i] − x[2i+1]``
    and one final multiply by ``fp32(1/√b)``. Same matrix as the dense product, different
    rounding (≤ a few ulp); the Triton kernel does this exact sequence, so the twins agree bit
    for bit. An exact zero result is +0 (as from a matmul with ``H_b``, the official transform):
    the encoder keeps the sign of -0 (code 8), and the sign of a zero sum would otherwise depend
    on how a backend adds signed zeros.

    Returns:
        float32 tensor of ``x``'s shape.

    Raises:
        ValueError: unsupported ``block_size``, an axis length it does not divide, or ``signs``
            that are not a ±1 vector of length ``block_size``.
    """
    check_block_size(block_size, "hadamard_block")
    axis = axis % x.ndim
    n = x.shape[axis]
    _check_divides(n, axis, block_size)
    v = x.movedim(axis, -1).float().reshape(*x.shape[:axis], *x.shape[axis + 1:], n // block_size, block_size)
    if signs is not None:
        if signs.ndim != 1 or signs.numel() != block_size:
            raise ValueError(f"signs must be a 1-D ±1 vector of length hadamard_block={block_size}, got shape {tuple(signs.shape)}")
        v = v * signs.to(device=x.device, dtype=torch.float32)
    for _ in range(int(math.log2(block_size))):
        pairs = v.reshape(*v.shape[:-1], block_size // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        v = torch.cat((a + b, a - b), dim=-1)
    # a Python float, not a new device tensor: this runs inside CUDA-graph capture (the opaque layer ops
    # of adahop.nn.opaque), where a host-to-device copy is an error; float32 math either way
    v = v * (1.0 / math.sqrt(block_size))
    v = torch.where(v == 0, 0.0, v)  # -0 -> +0 (see above)
    return v.reshape(*v.shape[:-2], n).movedim(-1, axis)


def _iht_transform(x: torch.Tensor, block: int, axis: int, signs: torch.Tensor | None) -> torch.Tensor:
    """The Hadamard both twins of the quantizer apply, in float32: :func:`hadamard_butterfly` for the
    blocks the fused kernel has (its exact operation order), and for larger ones (HALO's
    whole-dimension transform, e.g. 512 features) ``block_hadamard``'s Kronecker form, two GEMMs
    instead of log2(b) memory passes (6.0× faster at 16384 × 512 on the H200, round 12), with -0 made
    +0 as the butterfly does."""
    if block <= TRITON_HADAMARD_SIZES[-1]:
        return hadamard_butterfly(x, block_size=block, axis=axis, signs=signs)
    _check_divides(x.shape[axis], axis, block)
    if signs is not None and (signs.ndim != 1 or signs.numel() != block):
        raise ValueError(f"signs must be a 1-D ±1 vector of length hadamard_block={block}, got shape {tuple(signs.shape)}")
    v = block_hadamard(x.float(), block_size=block, axis=axis, signs=signs)
    return torch.where(v == 0, 0.0, v)


def _check_operand(x, axis, fn: str) -> None:
    """The checks every operand quantizer (``fn``) makes of ``x`` and ``axis``: a floating 2-D tensor, axis 0 or 1."""
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"{fn} expects a 2-D tensor [R, C], got {getattr(x, 'shape', type(x))}")
    if not x.is_floating_point():
        raise TypeError(f"{fn} got dtype {x.dtype}; accepted: float32, float16, bfloat16, float64")
    if axis not in (0, 1, -1, -2):
        raise ValueError(f"axis={axis} must be 0 or 1 (the GEMM's contracted dim of a 2-D operand)")


def _check_zero_rows(zero_rows) -> None:
    if zero_rows is not None and (not isinstance(zero_rows, torch.Tensor) or zero_rows.ndim != 1
                                  or zero_rows.dtype not in (torch.int64, torch.int32)):
        raise ValueError("zero_rows must be a 1-D int64/int32 tensor of row indices (the dim not quantized along), "
                         f"got {getattr(zero_rows, 'shape', type(zero_rows))}")


def _check_args(x, axis, hadamard_block, rounding, scale_rule, max_scale_range, outputs="all", zero_rows=None) -> int:
    _check_operand(x, axis, "iht_quantize_mxfp4")
    if hadamard_block is not None:
        check_block_size(hadamard_block, "hadamard_block")
    check_mx_options(scale_rule, rounding, max_scale_range)
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs={outputs!r} is not one of {OUTPUTS}")
    if outputs == "fp8" and not folds_exactly(max_scale_range):
        raise ValueError(f"outputs='fp8' needs max_scale_range 0…8 (an exact FP8 fold), got {max_scale_range}; "
                         "use outputs='all'")
    _check_zero_rows(zero_rows)
    return axis % 2


def iht_quantize_mxfp4_reference(
    x: torch.Tensor, *, axis: int, hadamard_block: int | None = 32, signs: torch.Tensor | None = None,
    rounding: str = "nearest", scale_rule: str = "floor", max_scale_range: int | None = 8,
    generator: torch.Generator | None = None, backend: str = "reference", outputs: str = "all",
    zero_rows: torch.Tensor | None = None,
) -> MXTensor:
    """Reference: ``quantize_mxfp4(H(x) if hadamard_block else x, ...)``, ``H`` the butterfly for blocks up
    to 256 and the Kronecker form above (:func:`_iht_transform`).

    Arguments and result as :func:`iht_quantize_mxfp4` (``backend`` is ignored; the result has
    codes and scales whatever ``outputs`` asks, and ``fp8=None``).
    """
    axis = _check_args(x, axis, hadamard_block, rounding, scale_rule, max_scale_range, outputs, zero_rows)
    if zero_rows is not None:
        x = x.index_fill(1 - axis, zero_rows, 0)
    if hadamard_block is not None:
        x = _iht_transform(x, hadamard_block, axis, signs)
    return quantize_mxfp4(x, axis=axis, block_size=32, scale_rule=scale_rule, rounding=rounding,
                          generator=generator, max_scale_range=max_scale_range)


# ----------------------------------------------------------------------------- fused (Triton) path


def _triton():
    from . import _triton_quantize  # lazy: Triton is needed only here

    return _triton_quantize


def _triton_supports(hadamard_block, signs) -> str | None:
    """Why the fused kernel cannot take these options, or None."""
    if hadamard_block is not None and hadamard_block != 1 and hadamard_block not in TRITON_HADAMARD_SIZES:
        return f"hadamard_block={hadamard_block} (the kernel takes {TRITON_HADAMARD_SIZES})"
    if hadamard_block in (None, 1) and signs is not None:
        return "signs without a Hadamard block"
    if hadamard_block == 1:
        return "hadamard_block=1"
    return None


def iht_quantize_mxfp4_triton(
    x: torch.Tensor, *, axis: int, hadamard_block: int | None = 32, signs: torch.Tensor | None = None,
    rounding: str = "nearest", scale_rule: str = "floor", max_scale_range: int | None = 8,
    generator: torch.Generator | None = None, backend: str = "triton", outputs: str = "all",
    zero_rows: torch.Tensor | None = None,
) -> MXTensor:
    """Fused Triton path of :func:`iht_quantize_mxfp4` (same arguments; ``backend`` is ignored).

    Also sets ``fp8`` on the result when ``max_scale_range`` is 0…8 (unless ``outputs="codes"``);
    with ``outputs="fp8"`` its ``codes`` are ``[rows, 0]``. Stochastic rounding draws one seed from
    ``generator`` for Triton's Philox stream: statistically, not bitwise, equal to the reference.
    """
    axis = _check_args(x, axis, hadamard_block, rounding, scale_rule, max_scale_range, outputs, zero_rows)
    why = _triton_supports(hadamard_block, signs)
    if why is not None:
        raise ValueError(f"iht_quantize_mxfp4: the Triton kernel does not support {why}; use backend='reference' or 'auto'")
    if hadamard_block is not None:
        _check_divides(x.shape[axis], axis, hadamard_block)
    if signs is not None:
        if signs.ndim != 1 or signs.numel() != hadamard_block:
            raise ValueError(f"signs must be a 1-D ±1 vector of length hadamard_block={hadamard_block}, got shape {tuple(signs.shape)}")
        signs = signs.to(device=x.device, dtype=torch.float32).contiguous()
    seed = None
    if rounding == "stochastic":
        gdev = generator.device if generator is not None else x.device
        seed = torch.randint(0, 2**62, (1,), generator=generator, device=gdev, dtype=torch.int64).to(x.device)
    msr = -1 if max_scale_range is None else max_scale_range
    keep = None
    if zero_rows is not None:  # a byte per output row, 0 where OE extracted it
        keep = torch.ones(x.shape[1 - axis], dtype=torch.uint8, device=x.device).index_fill_(0, zero_rows.to(x.device), 0)
    # traced by dynamo: the triton_op (its launches per _triton_launch.TRACED_LAUNCHES); else its body, without the op's dispatch
    tq = _triton()
    op = tq.quantize_op if torch.compiler.is_dynamo_compiling() else tq.mx_quantize
    want_fp8 = outputs != "codes"
    codes, scales, fp8, rscale = op(x, axis, hadamard_block or 0, signs, rounding == "stochastic",
                                    scale_rule, msr, seed, outputs != "fp8", want_fp8, keep)
    return MXTensor(codes=codes, scales=scales, shape=tuple(x.shape), axis=axis, block_size=32,
                    elem_scale=4.0 / 3.0 if scale_rule == "tseng" else 1.0,
                    fp8=(fp8, rscale) if want_fp8 and folds_exactly(msr) else None, scale_range=max_scale_range)


def iht_quantize_mxfp4(
    x: torch.Tensor, *, axis: int, hadamard_block: int | None = 32, signs: torch.Tensor | None = None,
    rounding: str = "nearest", scale_rule: str = "floor", max_scale_range: int | None = 8,
    generator: torch.Generator | None = None, backend: str = "auto", outputs: str = "all",
    zero_rows: torch.Tensor | None = None,
) -> MXTensor:
    """Block-Hadamard-transform (optional) and quantize a GEMM operand to MXFP4 along ``axis``.

    Args:
        x: 2-D ``[R, C]`` float tensor (bf16 or fp32 in training; any strides).
        axis: the GEMM's contracted dim (1 for A = X/∇Y, 0 for the wgrad operands and Wᵀ).
        hadamard_block: Sylvester block ``b`` applied along ``axis`` before quantizing (16/32/64
            in practice), or None for plain MXFP4. Must divide ``x.shape[axis]``.
        signs: optional ±1 float vector of length ``hadamard_block`` (random Hadamard).
        rounding: ``"nearest"`` (round-half-to-even) or ``"stochastic"``.
        scale_rule: ``"floor"``, ``"rceil"``, ``"adahop"`` or ``"tseng"`` (`formats.mxfp4`).
        max_scale_range: block exponents are raised to ≥ (row max − this); 8 makes the result
            fold exactly into FP8 (`DESIGN.md` §3). None: no limit (no ``fp8`` cache).
        generator: stochastic-rounding randomness (reproducible under a seed).
        backend: ``"auto"`` (Triton on CUDA, else reference), ``"triton"`` or ``"reference"``;
            it never changes round-to-nearest results. Hadamard blocks above 256 (which the
            kernel lacks) are applied first in their Kronecker form (two GEMMs), then quantized by
            the kernel; signs without a block run the reference under either of the first two.
        outputs: what the Triton path writes (:data:`OUTPUTS`): ``"all"``; ``"codes"`` for an
            operand saved for backward (no FP8 fold); ``"fp8"`` for one the GEMM consumes at once
            (no codes: ``codes`` is ``[rows, 0]``, :meth:`MXTensor.dequantize` reads the fold). The
            reference always returns codes and scales. Values never depend on it.
        zero_rows: 1-D integer indices of rows (along the dim *not* quantized: ``1 - axis``) to
            quantize as zeros, as ``x.index_fill(1 - axis, zero_rows, 0)`` would (OE's extracted
            rows or columns, without a copy of ``x``).

    Returns:
        :class:`MXTensor` of logical shape ``x.shape``, blocks of 32 along ``axis`` (codes
        ``[rows, padded/2]`` with ``rows`` the other dim), and, from the Triton path with
        ``max_scale_range <= 8``, ``fp8 = (float8_e4m3fn [rows, padded], float32 [rows])``.

    Raises:
        ValueError: not 2-D, bad axis, unsupported Hadamard size or one that does not divide
            the dim, bad ``signs``, unknown rule or rounding, stochastic rounding with a clipping
            rule (use ``rceil``), negative ``max_scale_range``, unknown ``outputs`` or ``"fp8"``
            without ``max_scale_range`` 0…8, ``zero_rows`` not a 1-D integer tensor.
        RuntimeError: backend ``"triton"`` without Triton or CUDA.

    Notes:
        The Hadamard is computed the same way on both backends: by :func:`hadamard_butterfly` for
        blocks up to 256, by ``block_hadamard``'s Kronecker form above; the two differ from a dense
        product only by last-bit rounding.
    """
    be = resolve_backend(backend, x.device)
    if be == "triton" and hadamard_block is not None and hadamard_block > TRITON_HADAMARD_SIZES[-1]:
        # a block the kernel lacks (HALO's whole-dimension Hadamard, e.g. 512 features): the reference's
        # own transform, then the kernel without one, so both backends quantize the same FP32 values (zeroing
        # whole rows commutes with a transform along them)
        axis = _check_args(x, axis, hadamard_block, rounding, scale_rule, max_scale_range, outputs, zero_rows)
        x = _iht_transform(x, hadamard_block, axis, signs)
        hadamard_block, signs = None, None
    if be == "triton" and _triton_supports(hadamard_block, signs) is None:
        fn = iht_quantize_mxfp4_triton
    else:
        fn = iht_quantize_mxfp4_reference
    return fn(x, axis=axis, hadamard_block=hadamard_block, signs=signs, rounding=rounding, scale_rule=scale_rule,
              max_scale_range=max_scale_range, generator=generator, outputs=outputs, zero_rows=zero_rows)
