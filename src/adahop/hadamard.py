"""Orthonormal Hadamard matrices and block Hadamard transforms (IHT / RHT building block).

``block_hadamard`` applies ``I ⊗ (D_s · H_b)`` along one axis: each contiguous chunk of ``b``
elements is multiplied by the normalized Sylvester Hadamard ``H_b`` (symmetric, ``H_b·H_b = I``),
after optional ±1 signs ``D_s``. Applied to both operands of a GEMM along the contracted dimension
it cancels inside the product: ``(A·D·H)(H·D·B) = A·B`` (`specs/adahop.md` §3,
`specs/baselines.md` §0).
"""

from __future__ import annotations

import math

import torch

from .device_constants import on_device, tf32_may_round
from .formats.common import check_float_input

__all__ = ["SUPPORTED_SIZES", "hadamard_matrix", "block_hadamard", "kron_factors", "random_signs", "hashed_signs",
           "check_block_size"]

#: Hadamard sizes supported: the powers of two from 1 to 2^15 (Sylvester construction). Sizes
#: above 256 are applied as a Kronecker product of two dense factors (``H_n = H_a ⊗ H_b``): two
#: GEMMs instead of one with an n × n matrix or log2(n) butterfly passes (the butterfly still runs
#: where dynamo traces the code).
SUPPORTED_SIZES = tuple(2**k for k in range(16))
_DENSE_MAX = 256


def check_block_size(n: int, what: str = "Hadamard size") -> None:
    """Raise ValueError unless ``n`` is a supported Hadamard size."""
    if not isinstance(n, int) or n not in SUPPORTED_SIZES:
        raise ValueError(f"{what} {n!r} is not supported; supported sizes are powers of two 1, 2, 4, ..., 32768")


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def hadamard_matrix(n: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix ``H_n`` ([n, n]): orthonormal and symmetric.

    Args:
        n: a power of two from 1 to 32768 (:data:`SUPPORTED_SIZES`).
        dtype, device: of the result.

    Raises:
        ValueError: ``n`` is not supported; the message lists the supported sizes.
    """
    check_block_size(n)
    dev = torch.device("cpu") if device is None else device
    # the clone: never hand out the cached tensor itself (an in-place edit would corrupt the cache)
    return _cached_hadamard(n, dtype, dev).clone()


def _cached_hadamard(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``H_n`` cached per (n, dtype, device), built outside any fake mode (adahop.device_constants).
    Shared: read it, never edit it in place."""
    return on_device(("hadamard", n, dtype), lambda: _sylvester(n).to(dtype), device)


def _warm_hadamard(block_size: int, device) -> None:
    """Cache on ``device`` the float32 matrices :func:`block_hadamard` reads for ``block_size`` (0: a
    whole dimension of any size, so every dense size and factor up to 256), before a CUDA-graph
    capture needs them (``LowPrecisionLinear._warm_constants``)."""
    if block_size == 0 or block_size > _DENSE_MAX:
        sizes = [n for n in SUPPORTED_SIZES if n <= _DENSE_MAX] if block_size == 0 else kron_factors(block_size)
    else:
        sizes = [block_size]
    for n in sizes:
        _cached_hadamard(n, torch.float32, device)


def kron_factors(n: int) -> tuple[int, int]:
    """The factor sizes ``(a, b)`` with ``H_n = H_a ⊗ H_b`` that :func:`block_hadamard` uses for ``n > 256``:
    ``a = 2^⌊k/2⌋``, ``b = 2^⌈k/2⌉`` for ``n = 2^k`` (the fewest multiply-adds per element, ``a + b``;
    at most 128 × 256 for n = 32768)."""
    k = n.bit_length() - 1
    return 1 << (k // 2), 1 << (k - k // 2)


def random_signs(n: int, *, generator: torch.Generator | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """A float32 vector of ``n`` independent ±1 (Rademacher) signs drawn from ``generator``."""
    if n <= 0:
        raise ValueError(f"random_signs needs n >= 1, got {n}")
    bits = torch.randint(0, 2, (n,), generator=generator, device=device)
    return bits.float() * 2 - 1


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xor-shift-multiply; every product stays below 2^63)."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def hashed_signs(seed: torch.Tensor, n: int, *, salt: int = 0) -> torch.Tensor:
    """``n`` ±1 signs that are a pure function of ``seed`` (a 0-d int64 tensor) and ``salt``.

    The compiled path's random signs: no random-number op is traced, so a graph that computes
    them twice (the backward recomputing a forward value) gets the same vector both times
    (issue 24 §0). Each sign is a bit of a 32-bit integer hash of (seed, salt, index); over
    seeds the bits are balanced and uncorrelated across indices, which is what the RHT's
    unbiasedness argument needs (`specs/baselines.md` §2, Tseng et al.).

    Args:
        seed: 0-d (or 1-element) integer tensor; only its low 32 bits matter. Its device is the
            result's. n: length (>= 1). salt: a small int separating streams drawn from one seed.

    Returns:
        float32 tensor ``[n]`` of ±1.

    Raises:
        ValueError: ``n < 1`` or a non-integer ``seed``.
    """
    if n <= 0:
        raise ValueError(f"hashed_signs needs n >= 1, got {n}")
    if seed.dtype.is_floating_point or seed.dtype.is_complex or seed.numel() != 1:
        raise ValueError(f"hashed_signs needs a one-element integer seed tensor, got {seed.dtype} of shape {tuple(seed.shape)}")
    s = _mix32((seed.reshape(()).to(torch.int64) & _M32) ^ ((salt * 0x27D4EB2F) & _M32))
    i = torch.arange(n, device=seed.device, dtype=torch.int64)
    bits = _mix32(((s * 0x61C88647) + i * 0x165667B1) & _M32) >> 15 & 1
    return 1.0 - 2.0 * bits.to(torch.float32)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh–Hadamard transform over the last dim (a power of two).

    Sizes above 256 under dynamo tracing (:func:`block_hadamard`), and the tests' second reference
    for the Kronecker form."""
    n = x.shape[-1]
    h = 1
    y = x
    while h < n:
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(x.shape)


def block_hadamard(
    x: torch.Tensor,
    *,
    block_size: int = 32,
    axis: int = -1,
    signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply ``I ⊗ (D_s·H_b)`` along ``axis``: each ``block_size`` chunk ``v`` becomes ``(v ⊙ s)·H_b``.

    Args:
        x: floating tensor of any rank; computed in float32 (float64 stays float64), returned in
            ``x``'s dtype.
        block_size: ``b``, a supported Hadamard size; must divide ``x.shape[axis]``.
        axis: the axis transformed (a GEMM's contracted dimension for IHT/RHT).
        signs: optional ±1 vector of length ``b`` (shared by every block) or of the axis length.
            Its values are not checked (that would be a host sync per call): anything but ±1
            scales the output.
            Without signs the transform is its own inverse.

    Returns:
        Tensor of ``x``'s shape and dtype.

    Raises:
        TypeError: non-floating ``x``.
        ValueError: unsupported ``block_size``, an axis length it does not divide (the message
            names the dimension), or ``signs`` of the wrong length.
    """
    check_float_input(x, axis, "block_hadamard")
    check_block_size(block_size, "block_size")
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % block_size:
        raise ValueError(
            f"block_hadamard: dimension {axis} has length {n}, which block_size={block_size} does not "
            f"divide; pad it to a multiple of {block_size} or pick a block size that divides it: {[b for b in SUPPORTED_SIZES if n % b == 0]}"
        )
    if signs is not None and (signs.ndim != 1 or signs.numel() not in (block_size, n)):
        raise ValueError(f"signs must be a 1-D vector of length {block_size} (per block) or {n} (axis), got shape {tuple(signs.shape)}")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    if block_size > _DENSE_MAX and not torch.compiler.is_dynamo_compiling():
        return _kron_block_hadamard(x.to(work).contiguous(), block_size, axis, signs).to(x.dtype)
    xm = x.movedim(axis, -1).to(work).contiguous()  # a strided batched matmul is many times slower
    if signs is not None:
        s = signs.to(device=x.device, dtype=work)
        xm = (xm.reshape(*xm.shape[:-1], -1, block_size) * s.reshape(-1, block_size)).reshape(xm.shape)
    blocks = xm.reshape(*xm.shape[:-1], n // block_size, block_size)
    if block_size <= _DENSE_MAX:
        if work == torch.float32 and tf32_may_round(blocks):
            # as _kron_block_hadamard: a TF32 GEMM would keep 10 mantissa bits of the transform
            out = (blocks.double() @ _cached_hadamard(block_size, torch.float64, x.device)).float()
        else:
            out = blocks @ _cached_hadamard(block_size, work, x.device)
    else:
        # traced by dynamo: the butterfly, whose passes Inductor fuses. The Kronecker factors need the
        # size as a constant, and a whole-dimension block is a tensor size (HALO-2's tokens): under
        # dynamic shapes its specialization inside an autograd.Function's speculation breaks dynamo
        # ("Expected subgraph_vt to be a tensor", torch 2.13); the butterfly only guards on it
        out = _fwht(blocks) / math.sqrt(block_size)
    return out.reshape(xm.shape).movedim(-1, axis).to(x.dtype)


def _kron_block_hadamard(x: torch.Tensor, b: int, axis: int, signs: torch.Tensor | None) -> torch.Tensor:
    """:func:`block_hadamard` for ``b > 256`` on a contiguous float32/float64 ``x``, in ``x``'s layout.

    ``H_b = H_p ⊗ H_q`` (Sylvester: entry ``(i, k)`` is ``(-1)^popcount(i & k) / √b``, and with
    ``i = i_p·q + i_q`` the popcount splits over the two halves of the index bits). A block ``v`` viewed
    as ``V [p, q]`` (``v[i_p·q + i_q] = V[i_p, i_q]``) becomes ``H_p · V · H_q``: two dense GEMMs, no
    1/√b scale to apply (both factors are normalized). The axis is not moved: for the last axis the
    fast factor is a right-multiply of all rows at once and the slow one a batched left-multiply;
    for an inner axis (HALO-2's tokens, axis 0) both are left-multiplies of ``[…, rows, rest]`` views."""
    if x.dtype == torch.float32 and tf32_may_round(x):
        # TF32 GEMMs would keep 10 mantissa bits of the transform; float64 keeps it at least as exact as FP32
        return _kron_block_hadamard(x.double(), b, axis, signs).float()
    shape = x.shape
    pre, n, post = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    nb = n // b
    if signs is not None:  # checked by block_hadamard
        s = signs.to(device=x.device, dtype=x.dtype)
        x = x.reshape(pre, nb, b, post) * s.reshape(-1, b, 1)
    p, q = kron_factors(b)
    hp, hq = _cached_hadamard(p, x.dtype, x.device), _cached_hadamard(q, x.dtype, x.device)
    r = pre * nb  # blocks
    if post == 1:
        y = x.reshape(r * p, q) @ hq  # H_q along the fast index of every block: one GEMM
        z = torch.bmm(hp.expand(r, p, p), y.reshape(r, p, q))  # H_p along the slow index (H symmetric)
    else:
        y = torch.bmm(hp.expand(r, p, p), x.reshape(r, p, q * post))
        z = torch.bmm(hq.expand(r * p, q, q), y.reshape(r * p, q, post))
    return z.reshape(shape)
