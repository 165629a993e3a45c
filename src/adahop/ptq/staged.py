"""A rotation at decode time: a short list of block stages, each one kernel launch (issue 22's inference path).

HARP's rotation (:class:`~adahop.ptq.rotation.HARPRotation`) is already a product of stages: stage ``t`` mixes
the coordinates that differ only in one mixed-radix digit, in independent ``b×b`` blocks
(`specs/related_methods.md` §2.2; the coordinate ``i = hi·(b·stride) + digit·stride + lo``). The RHT's block
Hadamard ``I ⊗ H_B`` is one too: Sylvester's ``H_B`` is the Kronecker product of smaller ones, each a stage.
At decode time a stage costs a launch more than its arithmetic, so :func:`merge_stages` fuses consecutive stages
into fewer, wider ones (radix up to 64: a 4096-wide rotation in two launches, not four), and
:func:`fold_signs` folds the layer's ±1 signs into the first and last stage. :func:`apply_stages` applies them:
:func:`~adahop.ptq._triton_decode.stage_kernel` on CUDA (or under ``TRITON_INTERPRET=1``),
:func:`apply_stages_reference` elsewhere, same signature.

A stage is ``(K, b, stride)``: ``K`` float32 ``[d/b, b, b]``, block ``hi·stride + lo``, ``y_c = Σ_a x_a K[a, c]``.
"""

from __future__ import annotations

import math

import torch

from ..hadamard import hadamard_matrix
from ..kernels.backend import triton_runs_on
from .incoherence import RHTRotation
from .rotation import HARPRotation, stage

__all__ = ["rotation_stages", "merge_stages", "fold_signs", "check_stages", "apply_stages", "apply_stages_reference",
           "MAX_RADIX"]

Stage = tuple[torch.Tensor, int, int]

MAX_RADIX = 64
"""The widest merged stage: a 64×64 block reads 64 floats of ``K`` per coordinate (1 MB at d = 4096)."""


def _pow2_factors(n: int, most: int) -> list[int]:
    out = []
    while n > 1:
        out.append(min(n, most))
        n //= out[-1]
    return out


def rotation_stages(r, *, inverse: bool = False, kernels: list[torch.Tensor] | None = None,
                    device: torch.device | str | None = None) -> list[Stage]:
    """``r`` (``x·R``, or ``x·Rᵀ`` with ``inverse``) as stages, on ``device`` (default: HARP's parameters'
    device, the CPU for the RHT).

    Args:
        r: a :class:`~adahop.ptq.rotation.HARPRotation` (its own stages) or an
            :class:`~adahop.ptq.incoherence.RHTRotation` (``I ⊗ H_B`` as the stages of ``H_B``'s Kronecker factors,
            each at most :data:`MAX_RADIX`).
        kernels: ``r.kernels()`` where already computed (HARP's Cayley solves).

    Raises:
        TypeError: any other rotation.
    """
    if isinstance(r, HARPRotation):
        ks = r.kernels() if kernels is None else kernels
        st = [(k.detach().float(), b, s) for k, (b, s) in zip(ks, r.stages)]
    elif isinstance(r, RHTRotation):
        st, s = [], 1
        for b in _pow2_factors(r.block, MAX_RADIX):
            st.append((hadamard_matrix(b).expand(r.d // b, b, b).contiguous(), b, s))
            s *= b
    else:
        raise TypeError(f"rotation_stages: {type(r).__name__} is neither a HARPRotation nor an RHTRotation")
    if inverse:  # x·Rᵀ: the stages in reverse order, each block transposed
        st = [(k.transpose(1, 2).contiguous(), b, s) for k, b, s in reversed(st)]
    return st if device is None else [(k.to(device), b, s) for k, b, s in st]


def _chains(span: tuple[int, int], st: Stage, most: int) -> bool:
    """Whether stage ``st`` acts on the digit next to those a group spanning ``span`` = (radix, lowest stride) acts
    on (above them, or below them for an inverse's reversed stages), and together they fit in ``most``."""
    (b, s), (_, r, t) = span, st
    return b * r <= most and (t == s * b or s == t * r)


def check_stages(stages: list[Stage], d: int, what: str = "stages") -> None:
    """Raise ValueError unless every stage is a float32 ``K`` ``[d/b, b, b]`` with ``b·stride`` dividing ``d``:
    a kernel reading a stage trusts its shape."""
    for i, (k, b, s) in enumerate(stages):
        if isinstance(b, bool) or not isinstance(b, int) or isinstance(s, bool) or not isinstance(s, int) or b < 1 \
                or s < 1 or d % (b * s):
            raise ValueError(f"{what}: stage {i} has radix {b!r} and stride {s!r}; their product must divide d = {d}")
        if k.dtype != torch.float32 or tuple(k.shape) != (d // b, b, b):
            raise ValueError(f"{what}: stage {i} (radix {b}) must hold a float32 K of shape [{d // b}, {b}, {b}], "
                             f"got {k.dtype} {tuple(k.shape)}")


def merge_stages(stages: list[Stage], d: int, max_radix: int = MAX_RADIX) -> list[Stage]:
    """Consecutive stages on adjacent digits fused into one stage of their radices' product, while it is at most
    ``max_radix``. The merged blocks are found by applying the stages to one indicator vector per digit value
    (blocks never mix, so one probe fills row ``a`` of every block). Same product, to float32 rounding.

    Raises:
        ValueError: ``max_radix`` not an int >= 2; stages that do not fit ``d`` (:func:`check_stages`).
    """
    if isinstance(max_radix, bool) or not isinstance(max_radix, int) or max_radix < 2:
        raise ValueError(f"merge_stages: max_radix={max_radix!r} must be an int >= 2")
    check_stages(stages, d, "merge_stages")
    out: list[list[Stage]] = []
    for s in stages:
        if out and _chains(_span(out[-1]), s, max_radix):
            out[-1].append(s)
        else:
            out.append([s])
    return [g[0] if len(g) == 1 else _merged(g, d) for g in out]


def _span(group: list[Stage]) -> tuple[int, int]:
    """A group's radix (the product of its stages') and lowest stride."""
    return math.prod(r for _, r, _ in group), min(s for _, _, s in group)


def _merged(group: list[Stage], d: int) -> Stage:
    b, s0 = _span(group)
    dev = group[0][0].device
    digit = (torch.arange(d, device=dev) // s0) % b
    probes = (digit[None, :] == torch.arange(b, device=dev)[:, None]).float()  # [b, d]: one per digit value
    y = probes[None]
    for k, r, s in group:
        y = stage(y, k[None], r, s)
    # y[a, hi·(b·s0) + c·s0 + lo] = K[hi·s0 + lo][a, c]
    k = y[0].reshape(b, d // (b * s0), b, s0).permute(1, 3, 0, 2).reshape(d // b, b, b)
    return k.contiguous(), b, s0


def _per_block(signs: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """``[d]`` → ``[d/b, b]``: each block's coordinates in digit order."""
    d = signs.numel()
    return signs.reshape(d // (b * s), b, s).permute(0, 2, 1).reshape(d // b, b)


def fold_signs(stages: list[Stage], s_in: torch.Tensor | None = None, s_out: torch.Tensor | None = None) -> list[Stage]:
    """``x ⊙ s_in`` before the first stage and ``⊙ s_out`` after the last, folded into their blocks' rows and
    columns (exact: ±1 flips a sign).

    Raises:
        ValueError: no stages, or signs that are not ``[d]`` of ±1.
    """
    if not stages:
        raise ValueError("fold_signs: no stages to fold the signs into")
    d = stages[0][0].shape[0] * stages[0][1]
    for name, v in (("s_in", s_in), ("s_out", s_out)):
        if v is not None and (tuple(v.shape) != (d,) or not bool(((v == 1) | (v == -1)).all())):
            raise ValueError(f"fold_signs: {name} must be [{d}] of ±1, got {v.dtype} {tuple(v.shape)}")
    st = list(stages)
    if s_in is not None:
        k, b, s = st[0]
        st[0] = (k * _per_block(s_in.to(k), b, s)[:, :, None], b, s)
    if s_out is not None:
        k, b, s = st[-1]
        st[-1] = (k * _per_block(s_out.to(k), b, s)[:, None, :], b, s)
    return st


def apply_stages_reference(x: torch.Tensor, stages: list[Stage], out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The stages applied in order to ``x`` ``[rows, d]``, or to the sum of ``[parts, rows, d]`` partial sums (any
    float dtype; computed in float32), returned in ``out_dtype`` (default float32)."""
    y = (x.float().sum(0) if x.dim() == 3 else x.float())[None]
    for k, b, s in stages:
        y = stage(y, k[None], b, s)
    return y[0].to(out_dtype or torch.float32)


def apply_stages(x: torch.Tensor, stages: list[Stage], out_dtype: torch.dtype | None = None, *,
                 backend: str = "auto") -> torch.Tensor:
    """:func:`apply_stages_reference`, one Triton launch per stage on CUDA (``backend``: ``auto``, ``triton`` or
    ``reference``; ``auto`` takes Triton on CUDA or under ``TRITON_INTERPRET=1``). The first stage reads ``x``
    in its dtype, summing it first where it is ``[parts, rows, d]`` partial sums, and the last writes
    ``out_dtype``: no separate casts or sums. Sums in another order than the reference: equal to float32 rounding.

    Raises:
        ValueError: stages that do not fit their ``d`` (:func:`check_stages`); ``x`` not ``[rows, d]`` floating
            point; an unknown backend; ``triton`` where it cannot run.
    """
    d = stages[0][0].shape[0] * stages[0][1] if stages else x.shape[-1]
    check_stages(stages, d, "apply_stages")
    if x.dim() not in (2, 3) or x.shape[-1] != d or not x.is_floating_point():
        raise ValueError(f"apply_stages: x must be a float [rows, {d}] (or [parts, rows, {d}] of partial sums), got "
                         f"{x.dtype} {tuple(x.shape)}")
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"apply_stages: backend {backend!r}; use auto, triton or reference")
    if backend == "triton" and not triton_runs_on(x.device):
        raise ValueError(f"apply_stages: backend='triton' runs on CUDA tensors or under TRITON_INTERPRET=1 (x is on "
                         f"{x.device}); use backend='auto' or 'reference'")
    if not stages or backend == "reference" or not triton_runs_on(x.device):
        return apply_stages_reference(x, stages, out_dtype)
    import triton

    from ._triton_decode import stage_kernel

    rows, y = x.shape[-2], x.contiguous()
    parts = x.shape[0] if x.dim() == 3 else 1
    for i, (k, b, s) in enumerate(stages):
        out = torch.empty(rows, d, device=x.device,
                          dtype=(out_dtype or torch.float32) if i == len(stages) - 1 else torch.float32)
        meta = stage_meta(b)
        stage_kernel[(triton.cdiv(d // b, meta["BLOCKS"]), triton.cdiv(b, meta["BLOCK_C"]), rows)](
            y, k.contiguous(), out, d, d // b, b, s, rows, parts if i == 0 else 1, **meta)
        y = out
    return y


def stage_meta(b: int) -> dict[str, int]:
    """The stage kernel's tile sizes for radix ``b``: the radix padded to a power of two (``BP``), outputs of a
    block per program (``BLOCK_C``, at most 16), and blocks per program for about 2048 products each."""
    bp = 1 << (b - 1).bit_length()
    bc = min(bp, 16)
    return {"BLOCKS": max(1, 2048 // (bp * bc)), "BP": bp, "BLOCK_C": bc}
