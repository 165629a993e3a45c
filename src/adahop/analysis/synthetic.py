"""Synthetic Figure 3: GEMM error of each AdaHOP strategy on each outlier-pattern pair.

The protocol is `specs/adahop.md` §10.3 (the paper's own generator is unknown): ``A [M, K]`` and
``B [K, N]`` with i.i.d. N(0, 1) entries; for a Row pattern ``n_out`` random rows are multiplied
by ``scale``, for a Column pattern ``n_out`` random columns. The inner-dimension outliers of A
(its columns) and of B (its rows) use *disjoint* K indices. Each strategy runs through
:func:`adahop.lowp_matmul`; the error is ``‖Ĉ − AB‖_F / ‖AB‖_F`` against an FP64 product,
averaged over seeds. BF16 is the exact GEMM (error 0).

"Best" is the lowest error among the low-precision strategies (none, iht, iht+oe_left,
iht+oe_right); a table's choice is "within tol" when its error is at most ``(1 + tol)·best``,
which an exact BF16 choice always is.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass

import torch

from ..gemm import lowp_matmul
from ..patterns import STRATEGY_TABLES

__all__ = ["PAIRS", "LOWP_STRATEGIES", "STRATEGIES", "Fig3Row", "make_operands", "relative_error",
           "figure3_table", "to_markdown", "to_csv"]

#: Pattern pairs (A, B) in the order of the toy table of `specs/adahop.md` §10.3.
PAIRS = ("RR", "RC", "RN", "CR", "CC", "CN", "NR", "NC", "NN")
#: The strategies that quantize; the best of these is the yardstick.
LOWP_STRATEGIES = ("none", "iht", "iht+oe_left", "iht+oe_right")
STRATEGIES = LOWP_STRATEGIES + ("bf16",)
_LABELS = {"none": "none", "iht": "IHT", "iht+oe_left": "OE-L+IHT", "iht+oe_right": "OE-R+IHT", "bf16": "BF16"}


@dataclass(frozen=True, slots=True)
class Fig3Row:
    """The measured errors of one pattern pair.

    Attributes:
        pair: ``"RR"`` … ``"NN"``: A's pattern then B's, as the GEMM consumes them.
        errors: strategy → relative Frobenius error, mean over seeds.
        per_seed: strategy → the error of each seed, in seed order.
    """

    pair: str
    errors: dict[str, float]
    per_seed: dict[str, tuple[float, ...]]

    @property
    def best(self) -> str:
        """The low-precision strategy with the lowest mean error."""
        return min((s for s in LOWP_STRATEGIES if s in self.errors), key=self.errors.__getitem__)

    def assigned(self, table: str = "lv2") -> str:
        """The strategy ``table`` (``"lv2"`` or ``"lv1"``) assigns to this pair."""
        return STRATEGY_TABLES[table][self.pair]

    def error(self, strategy: str) -> float:
        """The mean error of ``strategy``; BF16 is exact (0) even when it was not run."""
        return 0.0 if strategy == "bf16" else self.errors[strategy]

    def ratio(self, strategy: str) -> float:
        """``error(strategy) / error(best)``; 0 for BF16."""
        return self.error(strategy) / self.errors[self.best]

    def within(self, strategy: str, tol: float = 0.10) -> bool:
        """Whether ``strategy``'s error is at most ``(1 + tol)`` times the best's."""
        return self.error(strategy) <= (1 + tol) * self.errors[self.best]


def make_operands(pair: str, *, m: int, k: int, n: int, n_out: int, scale: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands ``A [m, k]``, ``B [k, n]`` (float32) with the patterns of ``pair``.

    Row pattern: ``n_out`` random rows ×``scale``; Column pattern: ``n_out`` random columns.
    A's outlier columns and B's outlier rows (both along K) never share an index.

    Raises:
        ValueError: unknown pair, or ``2·n_out`` larger than ``k`` or ``n_out`` larger than m or n.
    """
    if pair not in PAIRS:
        raise ValueError(f"pair={pair!r}; use one of {PAIRS}")
    if 2 * n_out > k or n_out > m or n_out > n:
        raise ValueError(f"n_out={n_out} does not fit m={m}, k={k} (needs 2·n_out), n={n}")
    a = torch.randn(m, k, generator=generator)
    b = torch.randn(k, n, generator=generator)
    perm_k = torch.randperm(k, generator=generator)
    idx_a_k, idx_b_k = perm_k[:n_out], perm_k[n_out: 2 * n_out]  # disjoint K indices
    idx_m = torch.randperm(m, generator=generator)[:n_out]
    idx_n = torch.randperm(n, generator=generator)[:n_out]
    if pair[0] == "R":
        a[idx_m] *= scale
    elif pair[0] == "C":
        a[:, idx_a_k] *= scale
    if pair[1] == "R":
        b[idx_b_k] *= scale
    elif pair[1] == "C":
        b[:, idx_n] *= scale
    return a, b


def relative_error(c_hat: torch.Tensor, c: torch.Tensor) -> float:
    """``‖ĉ − c‖_F / ‖c‖_F`` computed in FP64."""
    c = c.double()
    return float((c_hat.double() - c).norm() / c.norm())


def figure3_table(
    *,
    m: int = 512,
    k: int = 512,
    n: int = 512,
    n_out: int = 16,
    scale: float = 10.0,
    seeds: tuple[int, ...] = (0, 1, 2),
    oe_rank: int = 64,
    scale_rule: str = "adahop",
    max_scale_range: int | None = 8,
    pairs: tuple[str, ...] = PAIRS,
    strategies: tuple[str, ...] = STRATEGIES,
) -> list[Fig3Row]:
    """Measure every strategy on every pattern pair (`specs/adahop.md` §10.3).

    Args:
        m, k, n: GEMM shape ``[m, k] · [k, n]``.
        n_out: outlier rows/columns per patterned operand. scale: their multiplier (10 or 50).
        seeds: one operand draw per seed (``torch.Generator().manual_seed(seed)``); errors are
            averaged over them.
        oe_rank: rows/columns OE routes through the exact path (64 in AdaHOP).
        scale_rule, max_scale_range: MXFP4 quantizer settings of both operands; the defaults
            are those of the ``adahop-lv1``/``adahop-lv2`` presets.
        pairs, strategies: subsets to run.

    Returns:
        One :class:`Fig3Row` per pair, in the order of ``pairs``.

    Raises:
        ValueError: no seed; ``n_out`` not in [1, min(m, k, n)]; ``scale`` not a finite number > 0; ``oe_rank``
            not in [1, min(m, n) / 4] (OE would route most of the operand exact, and its error read as 0).
    """
    if not seeds:
        raise ValueError("no seed to average over; pass --synthetic-seeds 0,1,2 (or any others)")
    if not 1 <= n_out <= min(m, k, n):
        raise ValueError(f"--synthetic-n-out {n_out}: must be between 1 and the matrix size {min(m, k, n)}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"--synthetic-scale {scale}: must be a finite number > 0 (10 or 50 in the paper)")
    if not 1 <= oe_rank <= min(m, n) // 4:
        raise ValueError(f"--oe-rank {oe_rank} with {m}×{k}·{k}×{n} operands: OE would send more than a quarter of an "
                         f"operand through the exact path, and its error would read as the exact GEMM's; pass --oe-rank "
                         f"{max(1, min(m, n) // 4)} or less, or a --synthetic-size of at least {4 * oe_rank}")
    rows = []
    for pair in pairs:
        per_seed: dict[str, list[float]] = {s: [] for s in strategies}
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            a, b = make_operands(pair, m=m, k=k, n=n, n_out=n_out, scale=scale, generator=g)
            c = a.double() @ b.double()
            for s in strategies:
                if s == "bf16":
                    per_seed[s].append(0.0)  # the exact GEMM, by definition
                    continue
                c_hat = lowp_matmul(a, b, strategy=s, oe_rank=oe_rank, scale_rule=scale_rule,
                                    max_scale_range=max_scale_range)
                per_seed[s].append(relative_error(c_hat, c))
        rows.append(Fig3Row(pair=pair, errors={s: sum(v) / len(v) for s, v in per_seed.items()},
                            per_seed={s: tuple(v) for s, v in per_seed.items()}))
    return rows


def _fmt(v: float) -> str:
    return "0" if v == 0 else f"{v:.4f}"


def to_markdown(rows: list[Fig3Row], *, tol: float = 0.10) -> str:
    """A markdown table: errors per strategy (best in bold), the best strategy, and for the Lv2
    and Lv1 tables the assigned strategy, its error over the best, and whether it is within tol."""
    strategies = [s for s in STRATEGIES if s in rows[0].errors]
    head = ["pair", *(_LABELS[s] for s in strategies), "best", "Lv2", "Lv2/best", f"Lv2 ≤{1 + tol:g}×",
            "Lv1", "Lv1/best", f"Lv1 ≤{1 + tol:g}×"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.pair]
        for s in strategies:
            v = _fmt(r.errors[s])
            cells.append(f"**{v}**" if s == r.best else v)
        cells.append(_LABELS[r.best])
        for table in ("lv2", "lv1"):
            s = r.assigned(table)
            cells += [_LABELS[s], "exact" if s == "bf16" else f"{r.ratio(s):.3f}", "yes" if r.within(s, tol) else "**no**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: list[Fig3Row], *, tol: float = 0.10) -> str:
    """The same content as :func:`to_markdown`, as CSV with full precision."""
    strategies = [s for s in STRATEGIES if s in rows[0].errors]
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["pair", *strategies, "best", "lv2", "lv2_ratio", "lv2_within", "lv1", "lv1_ratio", "lv1_within"])
    for r in rows:
        row = [r.pair, *(f"{r.errors[s]:.6g}" for s in strategies), r.best]
        for table in ("lv2", "lv1"):
            s = r.assigned(table)
            row += [s, f"{r.ratio(s):.4f}", int(r.within(s, tol))]
        w.writerow(row)
    return out.getvalue()
