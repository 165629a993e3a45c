"""HARP's learned structured rotation: a product of butterfly-ordered block-orthogonal stages.

`specs/related_methods.md` §2.2. A dimension ``d`` is factored greedily into radices
``d = b_1·b_2·…·b_T`` (:func:`radix_schedule`). Stage ``t`` mixes the coordinates that differ only
in mixed-radix digit ``t`` (stride = product of the earlier radices, as in an FFT): after that
permutation it is block-diagonal with ``d / b_t`` independent ``b_t×b_t`` blocks, each
``K = Cayley(½(Θ−Θᵀ))·M_b`` with its own unconstrained ``Θ``. ``M_b`` is a fixed orthogonal mixer:
the normalized Sylvester Hadamard for a power of two, else a seeded QR orthogonal (``had_or_qr``).

Row-vector convention throughout: the rotation is the orthogonal ``R`` (``[d, d]``) with
``apply(x) = x·R`` along the last axis and ``apply_inverse(x) = x·Rᵀ``; ``dense()`` is ``R``.
At ``Θ = 0`` with a power-of-two ``d`` and radix 8, ``R`` is the Sylvester Hadamard ``H_d``: the
stride product of Sylvester blocks is their Kronecker product (a permutation at most, which the
tests allow for), so HARP starts exactly at the randomized Hadamard transform.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import nn

from ..hadamard import hadamard_matrix
from .names import MIXERS, THETA_FORMATS

__all__ = ["HARPRotation", "radix_schedule", "mixer_matrix", "MIXERS", "cayley", "stage"]



def _int_at_least(name: str, v, low: int) -> int:
    """``v`` as a Python int >= ``low`` (numpy and torch integers too, not a bool), else a ValueError naming it."""
    try:
        if isinstance(v, bool):
            raise TypeError
        v = operator.index(v)
    except TypeError:
        raise ValueError(f"HARPRotation needs an integer {name} >= {low}, got {v!r} ({type(v).__name__})") from None
    if v < low:
        raise ValueError(f"HARPRotation needs {name} >= {low}, got {v}")
    return v


def _dim(d) -> int:
    return _int_at_least("dimension d", d, 2)


def radix_schedule(d: int, radix: int = 8, max_radix: int = 8) -> list[int]:
    """Greedy mixed-radix factorization of ``d`` (`specs/related_methods.md` §2.2).

    Factors of ``radix`` first, then repeatedly the largest remaining factor ``≤ max_radix``; a
    leftover with no such factor (a prime above ``max_radix``, or a product of them) is one stage.

    Examples: 2048 → [8, 8, 8, 4]; 5120 → [8, 8, 8, 5, 2]; 11008 → [8, 8, 4, 43]; 1344 → [8, 8, 7, 3].

    Raises:
        ValueError: ``d < 2``, a radix below 2, or any of them not an integer.
    """
    d = _dim(d)
    radix, max_radix = _int_at_least("radix", radix, 2), _int_at_least("max_radix", max_radix, 2)
    out, rest = [], d
    while rest % radix == 0 and rest > 1:
        out.append(radix)
        rest //= radix
    while rest > 1:
        f = next((b for b in range(min(max_radix, rest), 1, -1) if rest % b == 0), None)
        if f is None:  # no factor fits under max_radix: the leftover is one big stage
            out.append(rest)
            break
        out.append(f)
        rest //= f
    return out


def mixer_matrix(b: int, mixer: str = "had_or_qr", *, seed: int = 0) -> torch.Tensor:
    """The fixed orthogonal ``M_b`` (float64 ``[b, b]``) of a stage of radix ``b``.

    ``had_or_qr``: Sylvester Hadamard for a power of two, else the Q of a seeded Gaussian's QR
    (signs fixed by R's diagonal, so the matrix is a pure function of ``b`` and ``seed``);
    ``had_or_ident``: Hadamard or identity; ``qr``: always QR; ``identity``.

    Raises:
        ValueError: an unknown mixer (lists :data:`MIXERS`).
    """
    if mixer not in MIXERS:
        raise ValueError(f"mixer={mixer!r} is not known; use one of {MIXERS}")
    pow2 = b & (b - 1) == 0
    if mixer == "identity" or (mixer == "had_or_ident" and not pow2):
        return torch.eye(b, dtype=torch.float64)
    if pow2 and mixer != "qr":
        return hadamard_matrix(b, dtype=torch.float64)
    g = torch.Generator().manual_seed(1_000_003 * seed + b)
    q, r = torch.linalg.qr(torch.randn(b, b, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(b, dtype=torch.float64))


def cayley(theta: torch.Tensor) -> torch.Tensor:
    """``Cayley(S) = (I+S)^{-1}(I−S)`` with ``S = ½(Θ−Θᵀ)``, batched over leading dims.

    ``S`` is skew-symmetric, so ``I+S`` is always invertible and the result is orthogonal
    (`specs/related_methods.md` §2.2). ``theta``: ``[..., b, b]`` float; returns the same shape.
    """
    s = 0.5 * (theta - theta.transpose(-1, -2))
    eye = torch.eye(theta.shape[-1], dtype=theta.dtype, device=theta.device).expand_as(s)
    # solve_ex without its error check: I+S is never singular, and the check syncs a GPU once per call
    return torch.linalg.solve_ex(eye + s, eye - s, check_errors=False)[0]


def stage(x: torch.Tensor, k: torch.Tensor, b: int, stride: int, transpose: bool = False) -> torch.Tensor:
    """One stage of L rotations at once: ``x_l·K_l`` (or ``x_l·K_lᵀ``) for ``x`` ``[L, r, d]`` float and
    ``k`` ``[L, d/b, b, b]``, the stage's blocks (:meth:`HARPRotation.kernels`, stacked), radix ``b``
    and ``stride`` (the product of the earlier radices). Returns ``[L, r, d]``.
    `specs/related_methods.md` §2.2. A coordinate is ``i = hi·(b·stride) + digit·stride + lo``."""
    nl, r, d = x.shape
    xv = x.reshape(nl, r, d // (b * stride), b, stride)  # (layer, row, hi, digit, lo)
    kv = k.reshape(nl, d // (b * stride), stride, b, b)  # (layer, hi, lo, a, c)
    eq = "zrhal,zhlca->zrhcl" if transpose else "zrhal,zhlac->zrhcl"
    return torch.einsum(eq, xv, kv).reshape(nl, r, d)


class HARPRotation(nn.Module):
    """A learned orthogonal ``R`` of size ``d``: ``passes`` × the staged butterfly product.

    Args:
        d: the dimension (any ``d >= 2``; the schedule is :func:`radix_schedule`).
        radix, max_radix: the schedule's preferred radix and the largest other factor (8, 8).
        passes: how many times the whole staged product repeats with fresh parameters (1).
        mixer: the fixed block mixer ``M_b``, one of :data:`MIXERS` (``had_or_qr``).
        seed: seeds the QR mixers (the stored artifact records it).
        theta_format: how :meth:`packed_params` stores the parameters, one of :data:`THETA_FORMATS`: ``fp16``
            (the default), or ``int8`` codes with one FP16 scale (``amax/127``) per ``b×b`` block, except in
            stages of radix 2, whose one parameter a block stays FP16 (a scale would cost more than it saves).

    Raises:
        ValueError: ``d < 2``, a radix below 2, ``passes < 1``, a negative ``seed``, any of them not an integer,
            or an unknown mixer or ``theta_format``.

    Parameters: ``thetas[p·T + t]`` of shape ``[d / b_t, b_t, b_t]`` (float32, zero at init), one
    ``Θ`` per block of stage ``t`` of pass ``p``. Blocks are indexed ``(hi, lo)`` flattened, where a
    coordinate is ``i = hi·(b_t·stride) + digit·stride + lo``.

    Only the skew part of each ``Θ`` matters: :attr:`n_params` counts ``d·(b−1)/2`` per stage
    (the stored, strictly upper triangle of ``S``).
    """

    def __init__(self, d: int, radix: int = 8, max_radix: int = 8, passes: int = 1, mixer: str = "had_or_qr",
                 *, seed: int = 0, theta_format: str = "fp16"):
        super().__init__()
        passes = _int_at_least("passes", passes, 1)
        seed = _int_at_least("seed", seed, 0)
        if theta_format not in THETA_FORMATS:
            raise ValueError(f"theta_format={theta_format!r}: must be one of {', '.join(THETA_FORMATS)}")
        self.theta_format = theta_format
        d, radix, max_radix = _dim(d), _int_at_least("radix", radix, 2), _int_at_least("max_radix", max_radix, 2)
        self.d, self.radix, self.max_radix, self.passes, self.mixer, self.seed = d, radix, max_radix, passes, mixer, seed
        self.schedule = radix_schedule(d, radix, max_radix)
        strides = [math.prod(self.schedule[:t]) for t in range(len(self.schedule))]
        self.stages = [(b, s) for _ in range(passes) for b, s in zip(self.schedule, strides)]
        self.thetas = nn.ParameterList([nn.Parameter(torch.zeros(d // b, b, b)) for b, _ in self.stages])
        for b in sorted(set(self.schedule)):
            self.register_buffer(f"mixer_{b}", mixer_matrix(b, mixer, seed=seed).float(), persistent=False)

    @property
    def n_params(self) -> int:
        """Stored rotation parameters: ``Σ_stages d·(b−1)/2`` (the upper triangles of the ``S``)."""
        return sum(self.d * (b - 1) // 2 for b, _ in self.stages)

    def kernels(self) -> list[torch.Tensor]:
        """Each stage's blocks ``K = Cayley(½(Θ−Θᵀ))·M_b``: ``[d/b, b, b]`` float32, in order."""
        return [cayley(th) @ getattr(self, f"mixer_{b}") for th, (b, _) in zip(self.thetas, self.stages)]

    @staticmethod
    def _stage(x: torch.Tensor, k: torch.Tensor, b: int, stride: int, transpose: bool) -> torch.Tensor:
        return stage(x.reshape(1, -1, x.shape[-1]), k[None], b, stride, transpose).reshape(x.shape)

    def _check(self, x: torch.Tensor) -> None:
        if not x.is_floating_point():
            raise ValueError(f"HARPRotation(d={self.d}) applied to a {x.dtype} tensor; pass a floating-point one (an "
                             "integer result would be truncated)")
        if x.shape[-1] != self.d:
            raise ValueError(f"HARPRotation(d={self.d}) applied to a tensor whose last dim is {x.shape[-1]}")

    def apply(self, x: torch.Tensor, kernels: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``x·R`` along the last axis (``x``: ``[..., d]`` float; same shape and dtype back, computed in float32,
        the precision the kernels are built in, whatever ``x``'s dtype).

        ``kernels``: precomputed :meth:`kernels` (saves the solves when applying several times).
        """
        self._check(x)
        ks = self.kernels() if kernels is None else kernels
        y = x.float()
        for k, (b, s) in zip(ks, self.stages):
            y = self._stage(y, k, b, s, transpose=False)
        return y.to(x.dtype)

    def apply_inverse(self, x: torch.Tensor, kernels: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``x·Rᵀ`` along the last axis: the stages in reverse order, each block transposed."""
        self._check(x)
        ks = self.kernels() if kernels is None else kernels
        y = x.float()
        for k, (b, s) in zip(reversed(ks), reversed(self.stages)):
            y = self._stage(y, k, b, s, transpose=True)
        return y.to(x.dtype)

    def dense(self) -> torch.Tensor:
        """``R`` as a dense float32 ``[d, d]`` matrix (``apply`` of the identity)."""
        return self.apply(torch.eye(self.d, device=self.thetas[0].device))

    def _int8(self, b: int) -> bool:
        """Whether a stage of radix ``b`` stores int8 codes and scales."""
        return self.theta_format == "int8" and b > 2

    @torch.no_grad()
    def round_params(self) -> None:
        """Replace each ``Θ`` by the one rebuilt from :meth:`packed_params` (``A − Aᵀ``, ``A`` the stored
        strict upper triangle of its skew part): the rotation then equals the artifact's exactly."""
        self.load_packed_params(self.packed_params())

    def packed_params(self) -> dict[str, torch.Tensor]:
        """What the artifact stores, on the CPU: per stage ``i``, ``"{i}"`` the strict upper triangles of the
        skew parts ``[d/b, b(b−1)/2]`` (FP16, or int8 codes), and with int8 codes also ``"{i}.scale"``
        ``[d/b]`` FP16, each block's ``amax/127``."""
        out = {}
        for i, (th, (b, _)) in enumerate(zip(self.thetas, self.stages)):
            iu = torch.triu_indices(b, b, 1, device=th.device)
            tri = (0.5 * (th - th.transpose(-1, -2)))[:, iu[0], iu[1]].detach().float().cpu()
            if not self._int8(b):
                out[str(i)] = tri.half()
                continue
            scale = (tri.abs().amax(-1) / 127).half()  # the stored scale; codes are taken against it
            sf = scale.float()[:, None]
            codes = torch.where(sf > 0, torch.round(tri / torch.where(sf > 0, sf, 1.0)), 0.0).clamp(-127, 127)
            out[str(i)], out[f"{i}.scale"] = codes.to(torch.int8), scale
        return out

    @torch.no_grad()
    def load_packed_params(self, packed: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`packed_params` (``Θ = A − Aᵀ`` from the stored triangles).

        Raises:
            ValueError: a stage missing or extra (another schedule), or scales that do not match the format.
        """
        want = {str(i) for i in range(len(self.stages))} | {f"{i}.scale" for i, (b, _) in enumerate(self.stages) if self._int8(b)}
        if set(packed) != want:
            raise ValueError(f"stored rotation parameters {sorted(packed)} do not match a {self.theta_format} rotation of "
                             f"{len(self.stages)} stages (expected {sorted(want)})")
        for i, (th, (b, _)) in enumerate(zip(self.thetas, self.stages)):
            iu = torch.triu_indices(b, b, 1)
            tri = packed[str(i)].float()
            if self._int8(b):
                tri = tri * packed[f"{i}.scale"].float()[:, None]
            a = torch.zeros(th.shape, dtype=torch.float32)
            a[:, iu[0], iu[1]] = tri
            th.copy_((a - a.transpose(-1, -2)).to(th.device, th.dtype))

    def extra_repr(self) -> str:
        return (f"d={self.d}, schedule={self.schedule}, passes={self.passes}, mixer={self.mixer!r}, params={self.n_params}"
                + (f", theta_format={self.theta_format!r}" if self.theta_format != "fp16" else ""))
