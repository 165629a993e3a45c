"""GPTQ / LDLQ: quantize a weight column by column, feeding each column's rounding error forward
through the inverse Hessian so the layer's output error ``tr((Ŵ−W) H (Ŵ−W)ᵀ)`` stays small.

Frantar et al., GPTQ (arXiv 2210.17323) Alg. 1; LDLQ (QuIP, arXiv 2307.13304 §3) is the same
update written with the LDL factor of ``H``. We use the upper Cholesky factor ``U`` of ``H⁻¹``
(``H⁻¹ = Uᵀ U``): after rounding column ``j`` with error ``e = (w_j − q_j) / U_jj``, the columns
to its right move by ``−e·U_{j, j+1:}``. Columns go in lazy batches of ``block`` (the result is
the same, the updates are matrix products). A group's scales are set when GPTQ enters it, from
the updated weights (as the reference implementation's ``static_groups=False``).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..utils import first_nonfinite
from .grids import Grid

__all__ = ["gptq", "proxy_error", "require_finite", "require_hessian"]


def require_hessian(where: str, h: torch.Tensor) -> None:
    """Raise a ValueError naming ``where`` unless ``h`` can be ``E[x xᵀ]``: symmetric (to float rounding) with
    a non-negative diagonal. (Positive semi-definiteness in full costs an eigendecomposition; these two catch a
    transposed or negated matrix, whose failure would otherwise read as "raise --damp" or "lower --harp-lr".)"""
    d = torch.diagonal(h)
    neg = d < -1e-6 * d.abs().max()  # below rounding: a rotated H's zero entries may come out as -1e-12
    if bool(neg.any()):
        raise ValueError(f"{where}: the Hessian has {int(neg.sum())} negative diagonal entries; E[x xᵀ] has none "
                         "(a sign flipped, or not a second moment of the inputs)")
    # vᵀHu = uᵀHv for every u, v iff H is symmetric: two matvecs with random vectors instead of H − Hᵀ, a second
    # copy of H (0.8 GB at n = 14336)
    g = torch.Generator().manual_seed(0)
    u, v = (torch.randn(h.shape[0], generator=g, dtype=torch.float64).to(h.device, h.dtype) for _ in range(2))
    hu, hv = h @ u, h @ v
    gap, size = float((v @ hu - u @ hv).abs()), float(hu.norm() * v.norm() + hv.norm() * u.norm())
    if gap > 1e-4 * max(size, 1e-30):
        raise ValueError(f"{where}: the Hessian is not symmetric (|vᵀHu − uᵀHv| = {gap:.3g} for random u, v); pass "
                         "E[x xᵀ] of the layer's inputs")


def require_finite(where: str, **tensors: torch.Tensor) -> None:
    """Raise a ValueError naming ``where`` and the first of ``tensors`` that holds NaN or inf: such a
    weight or Hessian comes from a broken model or calibration run, and would otherwise surface later
    as a failed Cholesky ("raise --damp") or a diverged fit ("lower --harp-lr"), pointing at the wrong fix."""
    hit = first_nonfinite(tensors)
    if hit is not None:
        raise ValueError(f"{where}: the {hit[0]} holds {hit[1]} NaN or inf values of {hit[2]}: the model or its calibration "
                         "data is broken, no setting of the quantizer fixes it; check the checkpoint and the calibration tokens")


def proxy_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """The layer-output error GPTQ minimizes: ``tr((Q−W) H (Q−W)ᵀ) / m`` (float64 accumulate)."""
    d = (q - w).double()
    return float(torch.einsum("ij,jk,ik->", d, h.double(), d) / w.shape[0])


def gptq(w: torch.Tensor, h: torch.Tensor, grid: Grid, *, damp: float = 0.01, block: int = 128) -> dict:
    """GPTQ of ``w`` (``[m, n]``) on ``h = E[x xᵀ]`` (``[n, n]``) with ``grid``.

    Args:
        w: the weight, float, any device; not modified.
        h: the proxy Hessian, symmetric positive semi-definite, on ``w``'s device.
        grid: the quantizer (:mod:`adahop.ptq.grids`).
        damp: ``λ = damp · mean(diag H)`` is added to the diagonal (GPTQ's ``percdamp``) so the
            Cholesky factorization exists.
        block: columns per lazy batch.

    Returns:
        ``{"q": float32 [m, n] dequantized, "codes": uint8 [m, n], "scales": float32 [m, n_groups]}``.
        With ``h = I`` this is exactly :meth:`Grid.quantize` (RTN): no error reaches other columns.

    Raises:
        ValueError: shapes that do not match, NaN or inf in ``w`` or ``h``, an ``h`` that is not symmetric or
            has a negative diagonal, ``block < 1``, ``damp`` not finite and > 0, or an ``h + damp`` that is still
            not positive definite.
    """
    if w.dim() != 2:
        raise ValueError(f"gptq: the weight must be 2-D [out, in]; it has shape {tuple(w.shape)}")
    m, n = w.shape
    if h.shape != (n, n):
        raise ValueError(f"gptq: H is {tuple(h.shape)}, the weight has {n} input columns; H must be [{n}, {n}]")
    if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
        raise ValueError(f"gptq: block={block!r} must be an integer >= 1 (columns per lazy batch)")
    if isinstance(damp, bool) or not (isinstance(damp, numbers.Real) and math.isfinite(damp) and damp > 0):
        raise ValueError(f"gptq: damp={damp!r} must be a finite number > 0 (--damp)")
    require_finite("gptq", weight=w, Hessian=h)
    require_hessian("gptq", h)
    w = w.float().clone()
    h = h.float().clone()
    grid.prepare(w)
    dead = torch.diagonal(h) == 0  # inputs that never fire: their columns do not matter, zero them
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diagonal(h).mean() * torch.eye(n, device=h.device)
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch._C._LinAlgError:  # noqa: SLF001 (torch exposes the error class only there)
        raise ValueError(f"gptq: H + {damp}·mean(diag H)·I is not positive definite; raise --damp") from None
    q = torch.zeros_like(w)
    codes = torch.zeros(m, n, dtype=torch.uint8, device=w.device)
    g = grid.group_size
    scales = torch.zeros(m, -(-n // g), device=w.device)
    scale = None
    for a in range(0, n, block):
        b = min(a + block, n)
        wb = w[:, a:b].clone()
        err = torch.zeros_like(wb)
        hb = hinv[a:b, a:b]
        for j in range(b - a):
            col = a + j
            if col % g == 0:  # entering a group: its scales from the updated weights
                end = min(col + g, n)
                cur = wb[:, j:end - a]
                if end > b:  # the group runs past this batch: add the batch's pending updates there
                    cur = torch.cat([cur, w[:, b:end] - err[:, :j] @ hinv[a:a + j, b:end]], 1)
                scale = grid.scales(cur)
                scales[:, col // g] = scale[:, 0]
            c, v = grid.round(wb[:, j:j + 1], scale)
            codes[:, col], q[:, col] = c[:, 0], v[:, 0]
            e = (wb[:, j] - v[:, 0]) / hb[j, j]
            wb[:, j:] -= e[:, None] * hb[j, j:][None, :]
            err[:, j] = e
        w[:, b:] -= err @ hinv[a:b, b:]
    return {"q": q, "codes": codes, "scales": scales}
