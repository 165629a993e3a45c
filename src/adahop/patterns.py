"""Outlier patterns, their detection, the calibration vote and the pair → strategy tables.

`specs/adahop.md` §1 (pairs and orientation flips), §2 (patterns, detector, calibration) and §5
(strategy tables).
"""

from __future__ import annotations

import enum
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .recipes.spec import GEMMS, STRATEGIES

__all__ = [
    "Pattern",
    "detect_pattern",
    "pattern_stats",
    "gemm_pairs",
    "STRATEGY_TABLES",
    "strategy_for",
    "Plan",
    "Calibrator",
]


class Pattern(enum.Enum):
    """Outlier pattern of a 2-D tensor in its storage layout."""

    ROW = "R"
    COLUMN = "C"
    NONE = "N"

    def __str__(self) -> str:
        return self.value

    def flipped(self) -> "Pattern":
        """The pattern of the transposed tensor: R ↔ C, N stays N (`specs/adahop.md` §1)."""
        return {Pattern.ROW: Pattern.COLUMN, Pattern.COLUMN: Pattern.ROW}.get(self, Pattern.NONE)

    @classmethod
    def parse(cls, s: "str | Pattern") -> "Pattern":
        """``"R"``/``"row"``, ``"C"``/``"col"``/``"column"``, ``"N"``/``"none"`` (any case) or a Pattern → Pattern; ValueError otherwise."""
        if isinstance(s, Pattern):
            return s
        key = {"r": "R", "row": "R", "c": "C", "col": "C", "column": "C", "n": "N", "none": "N"}.get(str(s).lower())
        if key is None:
            raise ValueError(f"unknown pattern {s!r}; use R, C or N")
        return cls(key)


def pattern_stats(t: torch.Tensor) -> tuple[float, float]:
    """Shape-normalized coefficients of variation of the row and column variances.

    ``cv_row = std(row_var) / mean(row_var) / sqrt(2 / (C − 1))`` and likewise for columns
    (`specs/adahop.md` §2.2). ``sqrt(2/(n−1))`` is the CV of the sample variance of n i.i.d.
    Gaussians, so both statistics are about 1 for a tensor without structure.

    Args:
        t: a tensor of at least 2 dims (leading dims are flattened into rows), any float dtype.

    Returns:
        ``(cv_row, cv_col)`` as Python floats.
    """
    if t.ndim < 2:
        raise ValueError(f"pattern detection needs a tensor of at least 2 dims, got shape {tuple(t.shape)}")
    t2 = t.detach().float().reshape(-1, t.shape[-1])
    rows, cols = t2.shape
    if rows < 2 or cols < 2:
        return 0.0, 0.0
    row_var, col_var = t2.var(dim=1), t2.var(dim=0)
    cv_row = row_var.std() / (row_var.mean() + 1e-30) / math.sqrt(2 / (cols - 1))
    cv_col = col_var.std() / (col_var.mean() + 1e-30) / math.sqrt(2 / (rows - 1))
    return float(cv_row), float(cv_col)


def detect_pattern(t: torch.Tensor, *, threshold: float = 2.0) -> Pattern:
    """Classify ``t`` (storage layout, e.g. X [T,K], W [N,K], ∇Y [T,N]) as ROW, COLUMN or NONE.

    Decision rule (our reconstruction of the unpublished rule, `specs/adahop.md` §2.2 and §12.1):
    ROW if ``cv_row ≥ τ`` and ``cv_row ≥ cv_col``; COLUMN if ``cv_col ≥ τ`` and ``cv_col > cv_row``;
    otherwise NONE. Taking the larger statistic matters: a few ×10 rows also inflate the column
    statistic (heavy tails in every column), but far less than the row statistic.

    Args:
        t: tensor with ≥ 2 dims. threshold: τ (2.0 in the paper's code).
    """
    cv_row, cv_col = pattern_stats(t)
    if cv_row >= threshold and cv_row >= cv_col:
        return Pattern.ROW
    if cv_col >= threshold and cv_col > cv_row:
        return Pattern.COLUMN
    return Pattern.NONE


def gemm_pairs(x: Pattern, w: Pattern, dy: Pattern) -> dict[str, str]:
    """The (A, B) pattern pair of each GEMM, with the orientation flips of `specs/adahop.md` §1.

    fprop ``X·Wᵀ``: (x, flip w); dgrad ``∇Y·W``: (dy, w); wgrad ``∇Yᵀ·X``: (flip dy, x).
    """
    return {
        "fprop": f"{x}{w.flipped()}",
        "dgrad": f"{dy}{w}",
        "wgrad": f"{dy.flipped()}{x}",
    }


_LV2 = {
    "RR": "iht", "RN": "iht+oe_left", "RC": "iht+oe_right",
    "CR": "iht", "CN": "iht", "CC": "bf16",
    "NR": "iht", "NN": "iht", "NC": "iht+oe_right",
}  # fmt: skip
#: Pair → strategy (`specs/adahop.md` §5). Lv1 differs from Lv2 only at CC (IHT + OE-Right).
STRATEGY_TABLES: dict[str, dict[str, str]] = {"lv2": dict(_LV2), "lv1": {**_LV2, "CC": "iht+oe_right"}}


def strategy_for(gemm: str, pair: str, table: str = "lv2") -> str:
    """Strategy of ``gemm`` for pattern ``pair`` under ``table``. OE-Left on wgrad falls back to
    IHT: X is saved quantized for memory, which conflicts with the BF16 operand OE-Left needs
    (`specs/adahop.md` §4). Unknown pairs fall back to plain MX ("none")."""
    if table not in STRATEGY_TABLES:
        raise ValueError(f"unknown strategy table {table!r}; use one of {tuple(STRATEGY_TABLES)}")
    s = STRATEGY_TABLES[table].get(pair, "none")
    if gemm == "wgrad" and s == "iht+oe_left":
        s = "iht"
    return s


@dataclass
class Plan:
    """The frozen AdaHOP plan: per layer, the voted patterns and one strategy per GEMM."""

    table: str
    layers: dict[str, dict[str, str]] = field(default_factory=dict)
    """``{layer_fqn: {"x": "C", "w": "N", "dy": "R", "fprop": "iht", "dgrad": ..., "wgrad": ...}}``."""

    def strategy(self, layer: str, gemm: str) -> str:
        """Strategy of ``gemm`` (fprop/dgrad/wgrad) for ``layer`` (its qualified name).

        Raises:
            KeyError: the plan has no such layer (made for another model)."""
        try:
            return self.layers[layer][gemm]
        except KeyError:
            raise KeyError(f"the plan has no strategy for layer {layer!r} {gemm}; was it made for this model?") from None

    def to_json(self) -> str:
        """The plan as JSON: ``{"table": "lv2", "layers": {fqn: {...}}}``."""
        return json.dumps({"table": self.table, "layers": self.layers}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Parse :meth:`to_json` output. Raises ValueError for a missing key or unknown strategy."""
        d = json.loads(text)
        if "table" not in d or "layers" not in d:
            raise ValueError("not an adahop plan: expected keys 'table' and 'layers'")
        for name, entry in d["layers"].items():
            for g in GEMMS:
                if entry.get(g) not in STRATEGIES:
                    raise ValueError(f"plan layer {name!r}: {g}={entry.get(g)!r} is not one of {STRATEGIES}")
        return cls(table=d["table"], layers=d["layers"])

    def save(self, path: str | Path) -> None:
        """Write the plan to ``path`` atomically (a ``plan.json`` for ``adahop train --plan``)."""
        from .utils import atomic_write_text

        atomic_write_text(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan written by :meth:`save` (ValueError if it is not one)."""
        return cls.from_json(Path(path).read_text())

    def with_table(self, table: str) -> "Plan":
        """This plan's voted patterns mapped through ``table`` (e.g. an Lv2 run's plan for an Lv1 recipe):
        a new Plan, or this one when the table is already ``table``. Source: the Lv1/Lv2 strategy tables
        of `specs/adahop.md` §5 (the patterns are the measurement, the table is the recipe's).

        Raises:
            ValueError: an entry without its patterns (x, w, dy), so there is nothing to re-map."""
        if table == self.table:
            return self
        missing = [n for n, e in self.layers.items() if not all(k in e for k in ("x", "w", "dy"))]
        if missing:
            raise ValueError(f"the plan was frozen with table {self.table!r} and its layer {missing[0]!r} has no patterns "
                             f"(x, w, dy) to re-map through table {table!r}; use a plan made with table {table!r}")
        return Plan.from_patterns({n: {k: e[k] for k in ("x", "w", "dy")} for n, e in self.layers.items()}, table)

    @classmethod
    def from_patterns(cls, patterns: dict[str, dict[str, str]], table: str = "lv2") -> "Plan":
        """Build a plan from voted patterns ``{layer: {"x": "R"|"C"|"N", "w": ..., "dy": ...}}``."""
        layers = {}
        for name, p in patterns.items():
            pats = {k: Pattern.parse(p.get(k, "N")) for k in ("x", "w", "dy")}
            pairs = gemm_pairs(pats["x"], pats["w"], pats["dy"])
            entry = {k: str(v) for k, v in pats.items()}
            entry.update({f"{g}_pair": pairs[g] for g in GEMMS})
            entry.update({g: strategy_for(g, pairs[g], table) for g in GEMMS})
            layers[name] = entry
        return cls(table=table, layers=layers)


class Calibrator:
    """Collects the patterns of X, W and ∇Y per layer per call, then majority-votes.

    Ties go to the pattern seen first (``Counter.most_common``), tensors never seen count as
    NONE (`specs/adahop.md` §2.4).
    """

    def __init__(self, *, table: str = "lv2", steps: int = 30, threshold: float = 2.0):
        if table not in STRATEGY_TABLES:
            raise ValueError(f"unknown strategy table {table!r}; use one of {tuple(STRATEGY_TABLES)}")
        self.table, self.steps, self.threshold = table, steps, threshold
        self.history: dict[str, dict[str, list[str]]] = {}

    def observe(self, layer: str, tensor: str, t: torch.Tensor) -> Pattern:
        """Detect and record the pattern of ``tensor`` ("x", "w" or "dy") of ``layer``."""
        p = detect_pattern(t, threshold=self.threshold)
        self.history.setdefault(layer, {}).setdefault(tensor, []).append(str(p))
        return p

    def vote(self) -> dict[str, dict[str, str]]:
        """Majority pattern per (layer, tensor)."""
        out = {}
        for layer, tensors in self.history.items():
            out[layer] = {k: Counter(tensors.get(k, [])).most_common(1)[0][0] if tensors.get(k) else "N" for k in ("x", "w", "dy")}
        return out

    def freeze(self, layers: list[str] | None = None) -> Plan:
        """The plan implied by the vote; ``layers`` lists layers to include even if never seen."""
        votes = self.vote()
        for name in layers or []:
            votes.setdefault(name, {"x": "N", "w": "N", "dy": "N"})
        return Plan.from_patterns(votes, self.table)
