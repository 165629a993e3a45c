"""FOID against the exact top-k: which rows/columns OE extracts, and what that does to the GEMM error.

Fast Outlier Index Detection (the paper's Figure 9; `specs/adahop.md` §2.2, issue 18) ranks the
rows of A (OE-Left) or the columns of B (OE-Right) by the norm of their first 64 elements along Kc
instead of all Kc of them, so the index selection reads 64/Kc of the operand. It is exact where an
outlier row or column is large along its whole length, as Row/Column patterns are; it can miss
one whose mass lies past the prefix. This module measures both effects on given operands, the
numbers behind the choice of the default (`GemmSpec.oe_select`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gemm import lowp_matmul, oe_indices
from .census import gemm_operands, rel_error

__all__ = ["FoidRow", "foid_compare", "foid_on_captures", "foid_synthetic", "foid_markdown"]


@dataclass(frozen=True)
class FoidRow:
    """One OE GEMM under both index selections.

    Attributes:
        name: what was multiplied (``layer/path`` or a synthetic case).
        strategy: ``"iht+oe_left"`` or ``"iht+oe_right"``.
        m, kc, n: the GEMM's shape. rank: the OE rank used.
        overlap: the share of FOID's indices that the exact top-k also picks, in [0, 1] (low when
            the rank exceeds the number of outliers: the remaining picks are near-ties).
        energy: the squared norm along Kc of FOID's rows/columns over that of the exact top-k's, in
            [0, 1]: how much of what OE is meant to extract FOID extracts.
        err_exact, err_foid: relative Frobenius error ``‖Ĉ − AB‖ / ‖AB‖`` of each.
    """

    name: str
    strategy: str
    m: int
    kc: int
    n: int
    rank: int
    overlap: float
    energy: float
    err_exact: float
    err_foid: float


def foid_compare(a: torch.Tensor, b: torch.Tensor, strategy: str, *, name: str = "", rank: int = 64,
                 prefix: int = 64, scale_rule: str = "adahop", max_scale_range: int | None = 8) -> FoidRow:
    """``a @ b`` under ``strategy`` with the exact and the FOID index selection.

    Args:
        a: ``[M, Kc]``; b: ``[Kc, N]``, float. strategy: ``"iht+oe_left"`` or ``"iht+oe_right"``.
        rank: OE rank; capped at the outer size. prefix: FOID's prefix (64).
        scale_rule, max_scale_range: the MXFP4 quantizer (the adahop presets' defaults).

    Returns:
        A :class:`FoidRow`.

    Raises:
        ValueError: a strategy without OE.
    """
    if strategy not in ("iht+oe_left", "iht+oe_right"):
        raise ValueError(f"FOID applies to the OE strategies iht+oe_left / iht+oe_right, got {strategy!r}")
    c = a.double() @ b.double()
    left = strategy == "iht+oe_left"
    outer = a.shape[0] if left else b.shape[1]
    k = min(rank, outer)
    t, axis = (a, 1) if left else (b, 0)
    exact = oe_indices(t, axis, k)
    foid = oe_indices(t, axis, k, prefix)
    sq = torch.linalg.vector_norm(t, dim=axis, dtype=torch.float64) ** 2
    energy = float(sq[foid].sum() / sq[exact].sum()) if sq[exact].sum() > 0 else 1.0
    errs = {sel: rel_error(lowp_matmul(a, b, strategy=strategy, oe_rank=k, oe_select=sel, scale_rule=scale_rule,
                                       max_scale_range=max_scale_range), c) for sel in ("exact", "foid")}
    return FoidRow(name=name, strategy=strategy, m=a.shape[0], kc=a.shape[1], n=b.shape[1], rank=k,
                   overlap=len(set(exact.tolist()) & set(foid.tolist())) / k, energy=energy, err_exact=errs["exact"], err_foid=errs["foid"])


def foid_on_captures(captures: dict[str, dict[str, torch.Tensor]], *, rank: int = 64, prefix: int = 64,
                     **quantizer) -> list[FoidRow]:
    """:func:`foid_compare` on every captured layer: OE-Left on dgrad (rows of ∇Y, the Row-wise
    gradient case) and OE-Right on wgrad (columns of X) and fprop (columns of Wᵀ).

    Args:
        captures: ``{layer: {"x": [T, K], "w": [N, K], "dy": [T, N]}}``, as
            `adahop.analysis.census.iht_gain` takes them. rank: OE rank, capped at a quarter of the
            outer size as there. prefix: FOID's prefix. quantizer: ``scale_rule``, ``max_scale_range``.

    Returns:
        Three :class:`FoidRow` per layer.
    """
    rows = []
    for layer, t in captures.items():
        ops = gemm_operands(t["x"], t["w"], t["dy"])
        for path, strategy in (("dgrad", "iht+oe_left"), ("wgrad", "iht+oe_right"), ("fprop", "iht+oe_right")):
            a, b = ops[path]
            outer = a.shape[0] if strategy == "iht+oe_left" else b.shape[1]
            rows.append(foid_compare(a, b, strategy, name=f"{layer}/{path}", rank=min(rank, max(1, outer // 4)),
                                     prefix=prefix, **quantizer))
    return rows


def foid_synthetic(size: int = 512, *, n_out: int = 16, scale: float = 10.0, seeds=(0, 1, 2),
                   rank: int = 64, prefix: int = 64) -> list[FoidRow]:
    """FOID on Gaussian operands with ``n_out`` outlier rows of A (OE-Left) or columns of B
    (OE-Right) scaled by ``scale`` (the toy setting of `specs/adahop.md` §8), in three shapes of
    outlier: along the whole row/column (``full``, a Row/Column pattern), only past the first
    ``prefix`` elements of Kc (``tail``, the case FOID cannot see), and none (``none``).

    Returns:
        One :class:`FoidRow` per (case, side, seed), ``size``³ GEMMs.
    """
    rows = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        for case in ("full", "tail", "none"):
            for strategy in ("iht+oe_left", "iht+oe_right"):
                a = torch.randn(size, size, generator=g)
                b = torch.randn(size, size, generator=g)
                idx = torch.randperm(size, generator=g)[:n_out]
                span = slice(0, size) if case == "full" else slice(prefix, size)
                if case != "none":
                    if strategy == "iht+oe_left":
                        a[idx, span] *= scale
                    else:
                        b[span, idx] *= scale
                rows.append(foid_compare(a, b, strategy, name=f"{case}/seed{seed}", rank=rank, prefix=prefix))
    return rows


def foid_markdown(rows: list[FoidRow]) -> str:
    """A table of the rows and a closing line with the means over them."""
    lines = ["| GEMM | strategy | M × Kc × N | rank | index overlap | energy kept | error exact | error FOID | FOID − exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.strategy} | {r.m} × {r.kc} × {r.n} | {r.rank} | {r.overlap:.2f} | {r.energy:.3f} | "
                     f"{r.err_exact:.4f} | {r.err_foid:.4f} | {r.err_foid - r.err_exact:+.4f} |")
    if rows:
        n = len(rows)
        lines.append(f"| mean of {n} | | | | {sum(r.overlap for r in rows) / n:.2f} | {sum(r.energy for r in rows) / n:.3f} | "
                     f"{sum(r.err_exact for r in rows) / n:.4f} | {sum(r.err_foid for r in rows) / n:.4f} | "
                     f"{sum(r.err_foid - r.err_exact for r in rows) / n:+.4f} |")
    return "\n".join(lines) + "\n"
