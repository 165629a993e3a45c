"""Two-sided incoherence processing (QuIP style): fixed random signs, then an orthogonal rotation
on each side of a weight.

`specs/related_methods.md` §2.1. For ``W`` (``[m, n]``, out × in) and ``H = E[x xᵀ]`` (``[n, n]``)::

    W̃ = Uᵀ (S_m W S_n) V        H̃ = Vᵀ (S_n H S_n) V        W = S_m U W̃ Vᵀ S_n  (exact)

with ``S`` diagonal ±1 and ``U`` (``[m, m]``), ``V`` (``[n, n]``) orthogonal. The RHT takes the
(block) Hadamard for ``U`` and ``V`` (:class:`RHTRotation`); HARP learns them
(:class:`~adahop.ptq.rotation.HARPRotation`). Both expose ``apply(x) = x·R``,
``apply_inverse(x) = x·Rᵀ`` and ``dense()``, which is all :class:`TwoSided` needs.
"""

from __future__ import annotations

import numbers

import torch

from ..hadamard import SUPPORTED_SIZES, block_hadamard, hadamard_matrix, random_signs

__all__ = ["RHTRotation", "TwoSided", "rht_block", "MIN_BLOCK"]

#: The smallest Hadamard block the RHT accepts: below it the incoherence gain is too small to be
#: worth calling it an RHT.
MIN_BLOCK = 8


def rht_block(d: int, *, min_block: int = MIN_BLOCK) -> int:
    """The RHT block for a dimension ``d``: ``d`` itself for a power of two, else the largest power
    of two dividing ``d`` (a block Hadamard ``I ⊗ H_b``: ``d = 1344 = 21·64`` takes 64).

    Raises:
        ValueError: ``d`` not a positive integer, or that block is below ``min_block``; the message names the
            dimension and the fix.
    """
    if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1:
        raise ValueError(f"the RHT needs a positive integer dimension, got {d!r}")
    d = int(d)
    b = d & -d  # the largest power of two dividing d
    b = min(b, SUPPORTED_SIZES[-1])
    if b < min_block:
        raise ValueError(f"dimension {d} has no power-of-two block >= {min_block} for the RHT (its largest "
                         f"power-of-two factor is {b}); use a harp-* method (HARP's mixed-radix rotation fits any "
                         f"dimension) or a model whose dims are multiples of {min_block}")
    return b


class RHTRotation:
    """The (block) Hadamard ``I ⊗ H_b`` of size ``d`` as a rotation (``b`` from :func:`rht_block`).

    Symmetric and its own inverse; no parameters. ``apply`` uses :func:`adahop.hadamard.block_hadamard`.
    """

    n_params = 0

    def __init__(self, d: int, *, min_block: int = MIN_BLOCK):
        self.d, self.block = d, rht_block(d, min_block=min_block)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x·(I ⊗ H_b)`` along the last axis."""
        return block_hadamard(x, block_size=self.block, axis=-1)

    apply_inverse = apply  # H_b is symmetric and orthogonal

    def dense(self) -> torch.Tensor:
        """``I ⊗ H_b`` as float32 ``[d, d]``."""
        return torch.block_diag(*[hadamard_matrix(self.block)] * (self.d // self.block))


class TwoSided:
    """``(s_m, U, s_n, V)`` of one linear layer: the exact transform of §2.1 and its inverse.

    Args:
        u: rotation of the output side (size ``m``); v: of the input side (size ``n``).
        signs_out, signs_in: float ±1 vectors ``[m]`` and ``[n]``.

    Raises:
        ValueError: signs of other shapes or values; later, a weight or Hessian of another shape than
            ``[m, n]`` / ``[n, n]`` or not floating point.
    """

    def __init__(self, u, v, signs_out: torch.Tensor, signs_in: torch.Tensor):
        if signs_out.shape != (u.d,) or signs_in.shape != (v.d,):
            raise ValueError(f"signs of shapes {tuple(signs_out.shape)}/{tuple(signs_in.shape)} for rotations of size "
                             f"{u.d}/{v.d}: pass 1-D vectors of those lengths")
        for s in (signs_out, signs_in):  # another scale here would make the transform inexact, silently
            if not s.is_floating_point() or not bool(((s == 1) | (s == -1)).all()):
                raise ValueError(f"the signs must be float vectors of ±1 (random_signs makes them); got {s.dtype} "
                                 f"values {sorted(set(s.flatten().tolist()))[:4]}")
        self.u, self.v, self.s_out, self.s_in = u, v, signs_out, signs_in

    def _check(self, x: torch.Tensor, shape: tuple[int, int], what: str) -> None:
        if tuple(x.shape) != shape:
            raise ValueError(f"TwoSided of sizes {self.u.d} (output) × {self.v.d} (input) given a {what} of shape "
                             f"{tuple(x.shape)}; it takes [{shape[0]}, {shape[1]}]")
        if not x.is_floating_point():
            raise ValueError(f"TwoSided given a {x.dtype} {what}; pass a floating-point one")

    @classmethod
    def random_signs(cls, u, v, *, generator: torch.Generator, device=None) -> "TwoSided":
        """With signs drawn from ``generator`` (on the CPU, then moved: reproducible on any device)."""
        return cls(u, v, random_signs(u.d, generator=generator).to(device), random_signs(v.d, generator=generator).to(device))

    def kernels(self) -> tuple[list | None, list | None]:
        """The rotations' stage kernels, computed once for several applications (HARP's fitting step
        rotates W and both sides of H with the same ones); None for a rotation without parameters."""
        return tuple(r.kernels() if hasattr(r, "kernels") else None for r in (self.u, self.v))

    @staticmethod
    def _apply(r, x: torch.Tensor, k) -> torch.Tensor:
        return r.apply(x) if k is None else r.apply(x, k)

    def weight(self, w: torch.Tensor, kernels: tuple | None = None) -> torch.Tensor:
        """``W̃ = Uᵀ (S_m W S_n) V`` for ``w`` ``[m, n]`` (float32 result); ``kernels``: from :meth:`kernels`."""
        self._check(w, (self.u.d, self.v.d), "weight")
        ku, kv = kernels or (None, None)
        a = self._apply(self.v, w.float() * self.s_in, kv)  # (S_m W S_n) V, signs commute with the row scaling
        return self._apply(self.u, (a * self.s_out[:, None]).T, ku).T  # Uᵀ A = (Aᵀ U)ᵀ

    def weight_inverse(self, wt: torch.Tensor) -> torch.Tensor:
        """``W = S_m U W̃ Vᵀ S_n`` (float32)."""
        self._check(wt, (self.u.d, self.v.d), "rotated weight")
        b = self.v.apply_inverse(wt.float())  # W̃ Vᵀ
        return self.u.apply_inverse(b.T).T * self.s_out[:, None] * self.s_in  # U B = (Bᵀ Uᵀ)ᵀ

    def hessian(self, h: torch.Tensor, kernels: tuple | None = None) -> torch.Tensor:
        """``H̃ = Vᵀ (S_n H S_n) V`` for ``h`` ``[n, n]`` (float32); ``kernels``: from :meth:`kernels`."""
        self._check(h, (self.v.d, self.v.d), "Hessian")
        kv = (kernels or (None, None))[1]
        a = self._apply(self.v, h.float() * self.s_in[:, None] * self.s_in, kv)
        return self._apply(self.v, a.T, kv).T
