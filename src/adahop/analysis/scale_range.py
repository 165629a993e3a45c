"""How often real operands hit MXFP4's row exponent-range limit, the condition of the FP8 fold.

The Hopper fast path folds MXFP4 into FP8 E4M3 with one FP32 scale per row. That needs every block
exponent within ``max_scale_range = 8`` of its row's largest (`DESIGN.md` §3). A block further
below is quantized at the raised exponent and loses its small values. Issue 19 (item 5) asks how
often this happens on real operands; this module counts it, per operand, in the orientation the
quantizer sees it: blocks of 32 along Kc after the IHT-32 the AdaHOP strategies apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.common import move_and_pad
from ..formats.mxfp4 import E8M0_MIN_EXP, block_exponents
from ..hadamard import block_hadamard
from .census import gemm_operands

__all__ = ["RangeHits", "range_hits", "range_hits_on_captures", "range_markdown"]


@dataclass(frozen=True)
class RangeHits:
    """Blocks raised by the exponent-range limit in one operand.

    Attributes:
        name: ``layer/path/A`` or ``.../B``. rows: rows along Kc (A's rows, B's columns).
        rows_hit: rows with at least one raised block. blocks, blocks_hit: all blocks, raised blocks.
        max_gap: the largest (row max − block) exponent difference seen, in powers of two.
    """

    name: str
    rows: int
    rows_hit: int
    blocks: int
    blocks_hit: int
    max_gap: int


def range_hits(t: torch.Tensor, kc_axis: int, *, name: str = "", block_size: int = 32, scale_rule: str = "adahop",
               max_scale_range: int = 8, iht: bool = True) -> RangeHits:
    """Count the blocks of ``t`` (blocks of ``block_size`` along ``kc_axis``) whose exponent the
    limit raises: those more than ``max_scale_range`` below their row's largest finite exponent.

    Args:
        t: a 2-D float operand. kc_axis: its contracted axis (1 for A ``[M, Kc]``, 0 for B ``[Kc, N]``).
        block_size, scale_rule, max_scale_range: the quantizer's (adahop presets: 32, adahop, 8).
        iht: apply the unsigned block Hadamard of size ``block_size`` along Kc first, as the IHT
            strategies do (random signs do not change block amax statistics much; unsigned is
            deterministic).

    Returns:
        A :class:`RangeHits`. All-zero blocks (exponent at the E8M0 minimum) are not counted as hits.

    Raises:
        ValueError: ``t`` not 2-D.
    """
    if t.ndim != 2:
        raise ValueError(f"range_hits needs a 2-D operand, got shape {tuple(t.shape)}")
    x = move_and_pad(t.float(), kc_axis, block_size)  # [rows, Kc padded]
    if iht:
        x = block_hadamard(x, block_size=block_size, axis=-1)
    blocks = x.reshape(x.shape[0], -1, block_size)
    amax = blocks.abs().amax(dim=-1)
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    e = block_exponents(amax, scale_rule)
    live = amax > 0
    row_max = torch.where(live, e, torch.full_like(e, E8M0_MIN_EXP)).amax(dim=-1, keepdim=True)
    gap = torch.where(live, row_max - e, torch.zeros_like(e))
    hit = gap > max_scale_range
    return RangeHits(name=name, rows=blocks.shape[0], rows_hit=int(hit.any(dim=-1).sum()), blocks=int(live.sum()),
                     blocks_hit=int(hit.sum()), max_gap=int(gap.max()) if gap.numel() else 0)


def range_hits_on_captures(captures: dict[str, dict[str, torch.Tensor]], **kw) -> list[RangeHits]:
    """:func:`range_hits` on both operands of the three GEMMs of every captured layer.

    Args:
        captures: ``{layer: {"x": [T, K], "w": [N, K], "dy": [T, N]}}`` (`adahop.analysis.census.iht_gain`).
        kw: passed to :func:`range_hits`.
    """
    rows = []
    for layer, t in captures.items():
        for path, (a, b) in gemm_operands(t["x"], t["w"], t["dy"]).items():
            rows.append(range_hits(a, 1, name=f"{layer}/{path}/A", **kw))
            rows.append(range_hits(b, 0, name=f"{layer}/{path}/B", **kw))
    return rows


def range_markdown(rows: list[RangeHits], limit: int = 8) -> str:
    """Per operand: rows hit and blocks raised (only operands with a hit, then the totals)."""
    hit = [r for r in rows if r.rows_hit]
    lines = [f"Operands: {len(rows)}; with a block more than {limit} powers of two below its row's largest: {len(hit)}.",
             "", "| operand | rows hit | blocks raised | largest gap |", "|---|---|---|---|"]
    for r in hit:
        lines.append(f"| {r.name} | {r.rows_hit} / {r.rows} ({100 * r.rows_hit / r.rows:.2f}%) | "
                     f"{r.blocks_hit} / {r.blocks} ({100 * r.blocks_hit / max(r.blocks, 1):.3f}%) | {r.max_gap} |")
    rows_all, hit_rows = sum(r.rows for r in rows), sum(r.rows_hit for r in rows)
    b_all, b_hit = sum(r.blocks for r in rows), sum(r.blocks_hit for r in rows)
    lines.append(f"| all | {hit_rows} / {rows_all} ({100 * hit_rows / max(rows_all, 1):.3f}%) | "
                 f"{b_hit} / {b_all} ({100 * b_hit / max(b_all, 1):.4f}%) | {max((r.max_gap for r in rows), default=0)} |")
    return "\n".join(lines) + "\n"
