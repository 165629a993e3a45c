"""Outlier patterns, their detection, the calibration vote and the pair → strategy tables.

`specs/adahop.md` §1 (pairs and orientation flips), §2 (patterns, detector, calibration) and §5
(strategy tables).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .recipes.spec import DETECTOR_RULES, GEMMS, STRATEGIES, CalibSpec

__all__ = [
    "Pattern",
    "detect_pattern",
    "classify",
    "pattern_stats",
    "peak_ratios",
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

    The official code adds 1e-8 to ``mean(row_var)``; we guard with 1e-30 instead, so the
    statistics do not depend on the tensor's scale (for variances far below 1e-8, e.g. ∇Y, the
    official CVs shrink, both by about the same factor, so their ratio barely moves).

    Args:
        t: a tensor of at least 2 dims (leading dims are flattened into rows), any float dtype.

    Returns:
        ``(cv_row, cv_col)`` as Python floats; ``(0.0, 0.0)`` when there are fewer than 2 rows or
        columns.

    Raises:
        ValueError: ``t`` has fewer than 2 dims.
    """
    if t.ndim < 2:
        raise ValueError(f"pattern detection needs a tensor of at least 2 dims, got shape {tuple(t.shape)}")
    t2 = t.detach().float().reshape(-1, t.shape[-1])
    rows, cols = t2.shape
    if rows < 2 or cols < 2:
        return 0.0, 0.0
    # scaled by a power of two to amax ~1 (exact, so the CVs are unchanged): squares of BF16 values above ~1e19
    # overflowed FP32 and every such tensor read as None (NaN CVs); an Inf or NaN amax leaves t2 as it is
    t2 = torch.ldexp(t2, -torch.frexp(t2.abs().amax())[1])
    row_var, col_var = t2.var(dim=1), t2.var(dim=0)
    cv_row = row_var.std() / (row_var.mean() + 1e-30) / math.sqrt(2 / (cols - 1))
    cv_col = col_var.std() / (col_var.mean() + 1e-30) / math.sqrt(2 / (rows - 1))
    return float(cv_row), float(cv_col)


def peak_ratios(t: torch.Tensor) -> tuple[float, float]:
    """Effect sizes for the optional gate of :func:`classify`: the largest row RMS over the median
    row RMS, and the same for columns (ours, not the official detector's; `specs/adahop.md` §2.2).

    Args:
        t: a tensor of at least 2 dims (leading dims are flattened into rows), any float dtype.

    Returns:
        ``(row_peak, col_peak)`` as Python floats, each ≥ 1; ``inf`` when the median RMS is 0 and
        the largest is not, 1.0 for an all-zero axis.

    Raises:
        ValueError: ``t`` has fewer than 2 dims.
    """
    if t.ndim < 2:
        raise ValueError(f"pattern detection needs a tensor of at least 2 dims, got shape {tuple(t.shape)}")
    t2 = t.detach().float().reshape(-1, t.shape[-1])
    if t2.numel() == 0:
        return 1.0, 1.0
    sq = t2.square()
    out = []
    for rms in (sq.mean(dim=1).sqrt(), sq.mean(dim=0).sqrt()):
        top, med = float(rms.max()), float(rms.median())
        out.append(top / med if med > 0 else (math.inf if top > 0 else 1.0))
    return out[0], out[1]


_RATIO_EPS = 1e-8  # the official ratio test's guard: cv_row / (cv_col + 1e-8) > τ


def classify(cv_row: float, cv_col: float, *, rule: str = "ratio", threshold: float = 2.0, floor: float | None = None,
             min_peak: float | None = None, row_peak: float | None = None, col_peak: float | None = None) -> Pattern:
    """The decision rule of the outlier detector, on precomputed :func:`pattern_stats`.

    Rules (`specs/adahop.md` §2.2):

    - ``"ratio"`` (default): the official AdaHOP detector (``outlier_detection.py``; its verbatim
      copy is the "reference detector" of AMD-AGI/ALTO ``tests/unittest/debug/test_moe_pattern_hooks.py``,
      commit e5fe08b). ROW if ``cv_row / (cv_col + 1e-8) > τ``, COLUMN if
      ``cv_col / (cv_row + 1e-8) > τ``, else NONE; τ = 2. It has no floor: smooth structure on both
      axes is NONE, while a tensor with ``cv_row ≈ 0`` (an RMS-normalized input) is COLUMN even
      without outlier columns. The official kurtosis gate defaults to 0 and never rejects anything
      (a kurtosis is ≥ 1), so there is none here.
    - ``"significance"``: our earlier reconstruction, kept for comparison: ROW if ``cv_row ≥ τ`` and
      ``cv_row ≥ cv_col``, COLUMN if ``cv_col ≥ τ`` and ``cv_col > cv_row``, else NONE. It fires on
      statistical significance (a 5% spread of row scales gives ``cv_row ≈ 2.2``), not on outliers.

    Optional gates (ours, off by default; measure them in a census before recommending them): a
    ROW/COLUMN verdict becomes NONE unless its own CV is ≥ ``floor``, and unless its peak ratio
    (:func:`peak_ratios`: largest RMS over median RMS on that axis) is ≥ ``min_peak``.

    Args:
        cv_row, cv_col: the statistics of :func:`pattern_stats`.
        rule: ``"ratio"`` or ``"significance"``. threshold: τ.
        floor, min_peak: the optional gates (None: off).
        row_peak, col_peak: :func:`peak_ratios`, needed only with ``min_peak``.

    Raises:
        ValueError: unknown ``rule``, or ``min_peak`` without the peak ratio it tests.
    """
    if rule == "ratio":
        if cv_row > threshold * (cv_col + _RATIO_EPS):
            p = Pattern.ROW
        elif cv_col > threshold * (cv_row + _RATIO_EPS):
            p = Pattern.COLUMN
        else:
            return Pattern.NONE
    elif rule == "significance":
        if cv_row >= threshold and cv_row >= cv_col:
            p = Pattern.ROW
        elif cv_col >= threshold and cv_col > cv_row:
            p = Pattern.COLUMN
        else:
            return Pattern.NONE
    else:
        raise ValueError(f"unknown detector rule {rule!r}; use one of {DETECTOR_RULES}")
    cv, peak = (cv_row, row_peak) if p is Pattern.ROW else (cv_col, col_peak)
    if floor is not None and not cv >= floor:
        return Pattern.NONE
    if min_peak is not None:
        if peak is None:
            raise ValueError("min_peak needs the peak ratios (row_peak, col_peak from peak_ratios(t))")
        if not peak >= min_peak:
            return Pattern.NONE
    return p


def detect_pattern(t: torch.Tensor, *, rule: str = "ratio", threshold: float = 2.0, floor: float | None = None,
                   min_peak: float | None = None, stats: tuple[float, float] | None = None) -> Pattern:
    """Classify ``t`` (storage layout, e.g. X [T,K], W [N,K], ∇Y [T,N]) as ROW, COLUMN or NONE.

    :func:`pattern_stats`, then :func:`classify` (the official ratio test by default; its
    docstring gives the rules, gates and sources). Leading dims fold into rows.

    Args:
        t: tensor with ≥ 2 dims, any float dtype. rule, threshold, floor, min_peak: as
            :func:`classify` (τ = 2.0 in the official code).
        stats: ``pattern_stats(t)`` when the caller has it already (one read of ``t`` saved).

    Raises:
        ValueError: ``t`` has fewer than 2 dims, or an unknown ``rule``.
    """
    cv_row, cv_col = pattern_stats(t) if stats is None else stats
    peaks = peak_ratios(t) if min_peak is not None else (None, None)
    return classify(cv_row, cv_col, rule=rule, threshold=threshold, floor=floor, min_peak=min_peak,
                    row_peak=peaks[0], col_peak=peaks[1])


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
#: Pair → strategy (`specs/adahop.md` §5). Lv1 differs from Lv2 only at CC (IHT + OE-Right). ``"iht"``
#: (ours, a control) maps every pair to IHT: uniform IHT after the same BF16 calibration steps as
#: AdaHOP (the recipe variant ``@bf16-calib``).
STRATEGY_TABLES: dict[str, dict[str, str]] = {"lv2": dict(_LV2), "lv1": {**_LV2, "CC": "iht+oe_right"},
                                              "iht": {pair: "iht" for pair in _LV2}}


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
    calibration: dict | None = None
    """What the patterns were voted over (:meth:`Calibrator.window`, or the census's window):
    ``{"steps": [first, last], "observation": ..., "rule": ..., ...}``; None when unknown."""
    shapes: dict[str, list[int]] | None = None
    """``{layer_fqn: [in_features, out_features]}`` of the model it was frozen on (a converted model checks
    its layers against it); None for plans written before it was recorded (by `adahop analyze` before 2026-12-05)."""

    def strategy(self, layer: str, gemm: str) -> str:
        """Strategy of ``gemm`` (fprop/dgrad/wgrad) for ``layer`` (its qualified name).

        Raises:
            KeyError: the plan has no such layer (made for another model)."""
        try:
            return self.layers[layer][gemm]
        except KeyError:
            raise KeyError(f"the plan has no strategy for layer {layer!r} {gemm}; was it made for this model?") from None

    def to_json(self) -> str:
        """The plan as JSON: ``{"table": "lv2", "layers": {fqn: {...}}}``, plus ``"calibration"``
        (the voting window) when known."""
        d = {"table": self.table, "layers": self.layers}
        if self.calibration is not None:
            d["calibration"] = self.calibration
        if self.shapes is not None:
            d["shapes"] = self.shapes
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Parse :meth:`to_json` output. Raises ValueError for a missing key or unknown strategy."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The plan of ``json.loads(plan.to_json())`` (as checkpoints and controller states hold it),
        its calibration window included. Raises ValueError for a missing key, an unknown table or strategy."""
        if "table" not in d or "layers" not in d:
            raise ValueError("not an adahop plan: expected keys 'table' and 'layers'")
        # a hand-edited name: the recipe re-derived every layer's strategies from its patterns, the edits dropped
        if d["table"] not in STRATEGY_TABLES:
            raise ValueError(f"plan table {d['table']!r} is not one of {tuple(STRATEGY_TABLES)}; the table names how "
                             "the strategies follow from the voted patterns, so keep the one the plan was frozen with")
        for name, entry in d["layers"].items():
            for g in GEMMS:
                if entry.get(g) not in STRATEGIES:
                    raise ValueError(f"plan layer {name!r}: {g}={entry.get(g)!r} is not one of {STRATEGIES}")
        return cls(table=d["table"], layers=d["layers"], calibration=d.get("calibration"), shapes=d.get("shapes"))

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
        return dataclasses.replace(Plan.from_patterns({n: {k: e[k] for k in ("x", "w", "dy")} for n, e in self.layers.items()},
                                                      table, calibration=self.calibration), shapes=self.shapes)

    @classmethod
    def from_patterns(cls, patterns: dict[str, dict[str, str]], table: str = "lv2",
                      calibration: dict | None = None) -> "Plan":
        """Build a plan from voted patterns ``{layer: {"x": "R"|"C"|"N", "w": ..., "dy": ...}}``;
        ``calibration`` records what they were voted over (:attr:`calibration`)."""
        layers = {}
        for name, p in patterns.items():
            pats = {k: Pattern.parse(p.get(k, "N")) for k in ("x", "w", "dy")}
            pairs = gemm_pairs(pats["x"], pats["w"], pats["dy"])
            entry = {k: str(v) for k, v in pats.items()}
            entry.update({f"{g}_pair": pairs[g] for g in GEMMS})
            entry.update({g: strategy_for(g, pairs[g], table) for g in GEMMS})
            layers[name] = entry
        return cls(table=table, layers=layers, calibration=calibration)


class Calibrator:
    """Collects the patterns of X, W and ∇Y per layer, one observation per optimizer step, then
    majority-votes (`specs/adahop.md` §2.4).

    One observation per (layer, tensor) per optimizer step, as the official collection keeps:
    extra calls within a step (gradient-accumulation micro-batches, a recomputed forward) add no
    votes. **The first call of the step counts**; later ones are not even classified. (The
    official hooks overwrite, so there the last call wins; either way it is one micro-batch of the
    step's data through the same weights. The first is robust to activation recomputation and
    skips the host syncs of the others.) :class:`~adahop.nn.LowPrecisionLinear` never observes
    forward-only calls (evaluation; a frozen layer's forward with grad on is a training call, whose X and W
    are observed: its ∇Y never is, and the freeze does not count that as a short vote), nor a call with no
    tokens (an MoE expert that got none), not even its weight. Ties go to the pattern seen first (``Counter.most_common``), tensors never
    seen count as NONE.

    Args:
        table: strategy table ("lv1", "lv2" or "iht", :data:`STRATEGY_TABLES`). steps: calibration
            steps (the plan is voted over optimizer steps 1 … steps). threshold, rule, floor, min_peak: the detector
            (:func:`classify`); defaults are the official ratio test, τ = 2, no gates.

    Raises:
        ValueError: unknown table or rule, or a value :class:`~adahop.recipes.spec.CalibSpec` refuses.
    """

    def __init__(self, *, table: str = "lv2", steps: int = 30, threshold: float = 2.0, rule: str = "ratio",
                 floor: float | None = None, min_peak: float | None = None):
        if table not in STRATEGY_TABLES:
            raise ValueError(f"unknown strategy table {table!r}; use one of {tuple(STRATEGY_TABLES)}")
        self.spec = CalibSpec(table=table, steps=steps, threshold=threshold, rule=rule, floor=floor, min_peak=min_peak)
        self.spec.validate("Calibrator")
        self.table, self.steps, self.threshold = table, steps, threshold
        self.history: dict[str, dict[str, list[str]]] = {}
        self.first_step: int | None = None  # the `step` of the first observation: the window starts after it
        self._last_step: dict[tuple[str, str], int] = {}  # (layer, tensor) -> the step it was observed at
        self._repeats = 0  # calls at one step in a row, of the first (layer, tensor) seen: a loop without on_step
        self._warned = False
        self._warned_nonfinite = False

    @classmethod
    def from_spec(cls, spec: CalibSpec) -> "Calibrator":
        """The calibrator of a recipe's :class:`~adahop.recipes.spec.CalibSpec`."""
        return cls(table=spec.table, steps=spec.steps, threshold=spec.threshold, rule=spec.rule, floor=spec.floor,
                   min_peak=spec.min_peak)

    def detect(self, t: torch.Tensor, stats: tuple[float, float] | None = None) -> Pattern:
        """This calibrator's detector on ``t`` (:func:`detect_pattern` with its rule and gates; ``stats`` as there)."""
        c = self.spec
        return detect_pattern(t, rule=c.rule, threshold=c.threshold, floor=c.floor, min_peak=c.min_peak, stats=stats)

    def observe(self, layer: str, tensor: str, t: torch.Tensor, *, step: int | None = None) -> Pattern | None:
        """Detect and record the pattern of ``tensor`` ("x", "w" or "dy") of ``layer`` at optimizer
        step ``step`` (any int that changes once per step, e.g. the steps done so far).

        Returns the pattern, or None when nothing was recorded: ``tensor`` was already observed at
        this ``step``, ``t`` is empty, or ``t`` holds NaN or ±Inf (an overflowing iteration, such as one
        a GradScaler skips: its statistics are NaN and would vote None; one warning, and a later call
        of the same step is observed instead). ``step=None`` makes every call its own observation (for
        callers that already pick one tensor per step)."""
        if t.numel() == 0:
            return None
        if step is not None and self._last_step.get((layer, tensor)) == step:
            self._count_repeat(layer, tensor, step)
            return None
        cv_row, cv_col = pattern_stats(t)
        if not (math.isfinite(cv_row) and math.isfinite(cv_col)):  # only a non-finite t: the stats are scale-free
            if not getattr(self, "_warned_nonfinite", False):  # absent from a calibrator pickled before it existed
                self._warned_nonfinite = True
                warnings.warn(f"adahop: {tensor} of layer {layer} holds NaN or Inf at optimizer step {step} while "
                              "calibrating (an overflowing iteration, e.g. one a GradScaler skips); such tensors are "
                              "not counted in the calibration vote", stacklevel=4)
            return None
        if step is not None:
            self._last_step[(layer, tensor)] = step
            if self.first_step is None:
                self.first_step = step
            if (layer, tensor) == next(iter(self._last_step)):
                self._repeats = 0
        p = self.detect(t, (cv_row, cv_col))
        self.history.setdefault(layer, {}).setdefault(tensor, []).append(str(p))
        return p

    #: Calls of one layer at one optimizer step after which a calibration is taken for one whose loop never
    #: calls on_step (gradient accumulation of that many micro-batches is not expected).
    REPEATS_WARN = 256

    def _count_repeat(self, layer: str, tensor: str, step: int) -> None:
        if (layer, tensor) != next(iter(self._last_step)):
            return
        self._repeats += 1
        if self._repeats >= self.REPEATS_WARN and not self._warned:
            self._warned = True
            warnings.warn(f"adahop: layer {layer} has run {self._repeats} forwards at optimizer step {step} while calibrating; "
                          "is adahop.on_step(model, step) called after each optimizer.step()? Until it is, the AdaHOP "
                          "recipe runs BF16 GEMMs and its plan never freezes", stacklevel=4)

    def vote(self) -> dict[str, dict[str, str]]:
        """Majority pattern per (layer, tensor)."""
        out = {}
        for layer, tensors in self.history.items():
            out[layer] = {k: Counter(tensors.get(k, [])).most_common(1)[0][0] if tensors.get(k) else "N" for k in ("x", "w", "dy")}
        return out

    def window(self) -> dict:
        """What the vote covers, as stored in the plan: ``{"steps": [first, steps], "observation": ...,
        "rule": ..., "threshold": ..., "floor": ..., "min_peak": ...}``; ``first`` is 1 unless the first
        observation came later (a run resumed mid-calibration without the votes before it)."""
        c = self.spec
        first = 1 if self.first_step is None else self.first_step + 1  # observed at `step` steps done: optimizer step step+1
        return {"steps": [first, c.steps], "observation": "first call of each optimizer step", "rule": c.rule,
                "threshold": c.threshold, "floor": c.floor, "min_peak": c.min_peak}

    def freeze(self, layers: list[str] | None = None) -> Plan:
        """The plan implied by the vote; ``layers`` lists layers to include even if never seen."""
        votes = self.vote()
        for name in layers or []:
            votes.setdefault(name, {"x": "N", "w": "N", "dy": "N"})
        short = {name: {k: len(self.history.get(name, {}).get(k, [])) for k in ("x", "w", "dy")} for name in votes}
        # a layer whose X was seen but never its ∇Y ran no backward: frozen (weight and input need no gradient), its
        # fprop voted on X and W, the only GEMM it runs, so its ∇Y count is not asked for
        voted = lambda c: ("x", "w", "dy") if c["dy"] or not c["x"] else ("x", "w")  # noqa: E731
        short = {n: c for n, c in short.items() if min(c[k] for k in voted(c)) < max(1, self.steps // 2)}
        if short:  # a vote on no observation is "None": such a plan looks calibrated and is not
            n0, c0 = next(iter(short.items()))
            warnings.warn(f"adahop: the plan froze with {len(short)} of {len(votes)} layers observed on fewer than half of "
                          f"its {self.steps} calibration steps (e.g. {n0}: x {c0['x']}, w {c0['w']}, dy {c0['dy']}); an unseen "
                          "tensor votes None. Run training steps (forward and backward) during calibration, and call "
                          "adahop.on_step(model, step) once per optimizer step", stacklevel=3)
        return Plan.from_patterns(votes, self.table, calibration=self.window())
