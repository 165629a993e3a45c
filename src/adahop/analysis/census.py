"""Pair-level analysis of recorded patterns: the vote, the census (the paper's Table 1), pattern
stability, and the IHT/OE error reduction on real GEMM operands (Figure 3, right).

Everything here works on plain data, so it can be tested without a model:

- a *history* ``{layer: {"x"|"w"|"dy": [pattern per recorded step, in step order]}}`` with
  patterns ``"R"``, ``"C"``, ``"N"`` (tensors in their storage layout: X ``[T, K]``, W ``[N, K]``,
  ∇Y ``[T, N]``);
- *voted* patterns ``{layer: {"x": "R"|"C"|"N", "w": ..., "dy": ...}}``.

The vote is the calibration vote of :class:`adahop.patterns.Calibrator` (majority, ties to the
pattern seen first, `specs/adahop.md` §2.4); `adahop analyze` gives it the history of optimizer
steps 1 … ``--calib-steps``, every one recorded, as training's calibration votes. Pairs
use the orientation flips of :func:`adahop.patterns.gemm_pairs` (`specs/adahop.md` §1):
fprop ``(x, flip w)``, dgrad ``(dy, w)``, wgrad ``(flip dy, x)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..gemm import lowp_matmul
from ..patterns import Calibrator, Pattern, detect_pattern, gemm_pairs, strategy_for

__all__ = ["PAIRS", "PATHS", "TENSORS", "TENSOR_LABELS", "GAIN_STRATEGIES", "block_index", "vote", "Census",
           "census", "stability", "mean_stability", "gemm_operands", "rel_error", "GainRow", "iht_gain", "gain_by_pair"]

#: The nine (A, B) pattern pairs, in the row order of the census (the paper's Table 1).
PAIRS = ("RR", "RC", "RN", "CR", "CC", "CN", "NR", "NC", "NN")
#: The three GEMMs of a linear layer (`specs/adahop.md` §1).
PATHS = ("fprop", "dgrad", "wgrad")
#: The recorded tensors of a layer, in storage layout: X [T, K], W [N, K], ∇Y [T, N].
TENSORS = ("x", "w", "dy")
TENSOR_LABELS = {"x": "X", "w": "W", "dy": "∇Y"}
#: Strategies measured on real operands; "none" (plain MXFP4) is the yardstick.
GAIN_STRATEGIES = ("none", "iht", "iht+oe_left", "iht+oe_right")

_BLOCK_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def block_index(name: str) -> int | None:
    """The transformer block of a layer name (``model.layers.3.mlp.down_proj`` → 3), or None."""
    m = _BLOCK_RE.search(name)
    return int(m.group(1)) if m else None


def vote(history: dict[str, dict[str, list[str]]], calib_steps: int = 30) -> dict[str, dict[str, str]]:
    """Majority pattern per (layer, tensor) over the first ``calib_steps`` entries of ``history``
    (`adahop analyze` passes only the steps of its vote window).

    Same rule as training's calibration (:meth:`Calibrator.vote`): ties go to the pattern seen
    first, a tensor never recorded counts as "N".

    Raises:
        ValueError: ``calib_steps`` < 1.
    """
    if calib_steps < 1:
        raise ValueError(f"--calib-steps must be >= 1, got {calib_steps}")
    cal = Calibrator(steps=calib_steps)
    cal.history = {layer: {t: list(p[:calib_steps]) for t, p in ts.items()} for layer, ts in history.items()}
    return cal.vote()


@dataclass(frozen=True, slots=True)
class Census:
    """Counts of each pattern pair per GEMM path, and over all paths.

    Attributes:
        counts: ``{"fprop"|"dgrad"|"wgrad"|"total": {pair: count}}`` for every pair of :data:`PAIRS`.
        layers: number of layers counted (each contributes one pair per path).
    """

    counts: dict[str, dict[str, int]]
    layers: int

    def share(self, column: str, pair: str) -> float:
        """The share of ``pair`` in ``column`` (a path or "total"), in [0, 1]."""
        n = sum(self.counts[column].values())
        return self.counts[column][pair] / n if n else 0.0

    @property
    def never(self) -> tuple[str, ...]:
        """The pairs that occur on no path."""
        return tuple(p for p in PAIRS if self.counts["total"][p] == 0)


def census(voted: dict[str, dict[str, str]]) -> Census:
    """Count the (A, B) pair of each GEMM of each layer (`specs/adahop.md` §1 flips)."""
    counts = {c: dict.fromkeys(PAIRS, 0) for c in (*PATHS, "total")}
    for pats in voted.values():
        pairs = gemm_pairs(*(Pattern.parse(pats.get(t, "N")) for t in TENSORS))
        for path in PATHS:
            counts[path][pairs[path]] += 1
            counts["total"][pairs[path]] += 1
    return Census(counts=counts, layers=len(voted))


def stability(history: dict[str, dict[str, list[str]]], voted: dict[str, dict[str, str]]) -> dict[str, dict[str, float]]:
    """Per (layer, tensor): the share of the steps in ``history`` whose pattern equals the vote
    (`adahop analyze` passes the steps of its patterns-over-steps figure)."""
    out: dict[str, dict[str, float]] = {}
    for layer, ts in history.items():
        out[layer] = {}
        for t in TENSORS:
            seq = ts.get(t, [])
            out[layer][t] = sum(p == voted[layer][t] for p in seq) / len(seq) if seq else float("nan")
    return out


def mean_stability(stab: dict[str, dict[str, float]]) -> dict[str, float]:
    """Mean stability of X, W and ∇Y over layers (NaN entries skipped)."""
    out = {}
    for t in TENSORS:
        v = [s[t] for s in stab.values() if s[t] == s[t]]
        out[t] = sum(v) / len(v) if v else float("nan")
    return out


# ---- IHT / OE error reduction on real operands ----------------------------------------------


def gemm_operands(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The (A, B) operands of the three GEMMs, in float32.

    Args:
        x: ``[..., K]`` layer input. w: ``[N, K]`` weight. dy: ``[..., N]`` output gradient with
            the same leading dims as ``x``.

    Returns:
        ``{"fprop": (X [T, K], Wᵀ [K, N]), "dgrad": (∇Y [T, N], W [N, K]), "wgrad": (∇Yᵀ [N, T], X [T, K])}``.
    """
    n, k = w.shape
    x2, dy2, w = x.reshape(-1, k).float(), dy.reshape(-1, n).float(), w.float()
    if x2.shape[0] != dy2.shape[0]:
        raise ValueError(f"x has {x2.shape[0]} tokens but dy has {dy2.shape[0]}; capture the same rows of both")
    return {"fprop": (x2, w.t()), "dgrad": (dy2, w), "wgrad": (dy2.t(), x2)}


@dataclass(frozen=True, slots=True)
class GainRow:
    """The errors of one real GEMM under each strategy.

    Attributes:
        layer, path: which GEMM. pair: its (A, B) pattern pair at the captured step.
        m, kc, n: GEMM shape ``[m, kc] · [kc, n]``.
        errors: strategy → ``‖Ĉ − AB‖_F / ‖AB‖_F`` (exact product in FP64).
        oe_left_rank, oe_right_rank: rows of A / columns of B that OE routed to the exact path.
    """

    layer: str
    path: str
    pair: str
    m: int
    kc: int
    n: int
    errors: dict[str, float]
    oe_left_rank: int
    oe_right_rank: int

    def reduction(self, strategy: str) -> float:
        """Relative error reduction against plain MXFP4: ``1 − err(strategy) / err(none)``."""
        base = self.errors["none"]
        return 1.0 - self.errors[strategy] / base if base > 0 else 0.0


def rel_error(c_hat: torch.Tensor, c: torch.Tensor) -> float:
    """``‖ĉ − c‖_F / ‖c‖_F`` in float64 (0 when ``c`` is zero): the GEMM error of the census and
    FOID tables (`specs/adahop.md` §8, the metric ALTO's parity test uses)."""
    den = c.norm()
    return float((c_hat.double() - c).norm() / den) if den > 0 else 0.0


def iht_gain(
    captures: dict[str, dict[str, torch.Tensor]],
    *,
    patterns: dict[str, dict[str, str]] | None = None,
    oe_rank: int = 64,
    scale_rule: str = "adahop",
    max_scale_range: int | None = 8,
    threshold: float = 2.0,
    rule: str = "ratio",
) -> list[GainRow]:
    """Measure none / IHT / IHT+OE-Left / IHT+OE-Right on each captured layer's three GEMMs.

    Args:
        captures: ``{layer: {"x": [T, K], "w": [N, K], "dy": [T, N]}}`` (same T rows in x and dy).
        patterns: the patterns of these tensors at the captured step; detected here when None.
        oe_rank: OE rank (64 in AdaHOP). On small layers it is capped at a quarter of the outer
            dimension (M for OE-Left, N for OE-Right), so OE never covers most of the output.
        scale_rule, max_scale_range: MXFP4 quantizer settings (the adahop presets' defaults).
        threshold, rule: the detector (:func:`adahop.patterns.classify`) when ``patterns`` is None.

    Returns:
        One :class:`GainRow` per (layer, path), in capture order.
    """
    rows = []
    for layer, t in captures.items():
        if patterns is not None and layer in patterns:
            pats = {k: Pattern.parse(patterns[layer][k]) for k in TENSORS}
        else:
            pats = {k: detect_pattern(t[k], threshold=threshold, rule=rule) for k in TENSORS}
        pairs = gemm_pairs(pats["x"], pats["w"], pats["dy"])
        for path, (a, b) in gemm_operands(t["x"], t["w"], t["dy"]).items():
            c = a.double() @ b.double()
            m, n = a.shape[0], b.shape[1]
            k_left, k_right = min(oe_rank, max(1, m // 4)), min(oe_rank, max(1, n // 4))
            errors = {}
            for s in GAIN_STRATEGIES:
                rank = k_left if s == "iht+oe_left" else k_right
                c_hat = lowp_matmul(a, b, strategy=s, oe_rank=rank, scale_rule=scale_rule, max_scale_range=max_scale_range)
                errors[s] = rel_error(c_hat, c)
            rows.append(GainRow(layer=layer, path=path, pair=pairs[path], m=m, kc=a.shape[1], n=n, errors=errors,
                                oe_left_rank=k_left, oe_right_rank=k_right))
    return rows


def gain_by_pair(rows: list[GainRow], table: str = "lv2") -> dict[str, dict]:
    """Per pair present: GEMM count, mean error of each strategy, mean reduction of each
    non-"none" strategy, and the mean reduction of the strategy ``table`` assigns per path.

    Returns:
        ``{pair: {"n": int, "error": {s: float}, "reduction": {s: float}, "assigned": float}}``
        in :data:`PAIRS` order; BF16 assignments count as a reduction of 1 (exact GEMM).
    """
    out = {}
    for pair in PAIRS:
        sel = [r for r in rows if r.pair == pair]
        if not sel:
            continue
        assigned = []
        for r in sel:
            s = strategy_for(r.path, pair, table)
            assigned.append(1.0 if s == "bf16" else r.reduction(s) if s in r.errors else 0.0)
        out[pair] = {
            "n": len(sel),
            "error": {s: sum(r.errors[s] for r in sel) / len(sel) for s in GAIN_STRATEGIES},
            "reduction": {s: sum(r.reduction(s) for r in sel) / len(sel) for s in GAIN_STRATEGIES[1:]},
            "assigned": sum(assigned) / len(assigned),
        }
    return out
