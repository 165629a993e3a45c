"""Recipe data: what each of a linear layer's three GEMMs does (`DESIGN.md` §2, STYLE §2.1).

A :class:`Recipe` names ``fprop`` (Y = X·Wᵀ), ``dgrad`` (∇X = ∇Y·W) and ``wgrad`` (∇W = ∇Yᵀ·X).
Each GEMM is written ``C = A·B`` with ``A [M, Kc]``, ``B [Kc, N']`` and contracted dim ``Kc``:

=======  ========  =======  ==========================
GEMM     A         B        Kc
=======  ========  =======  ==========================
fprop    X  [T,K]  Wᵀ [K,N]  K  (in_features)
dgrad    ∇Y [T,N]  W  [N,K]  N  (out_features)
wgrad    ∇Yᵀ[N,T]  X  [T,K]  T  (tokens)
=======  ========  =======  ==========================

Everything is frozen and validated when built; messages name the field and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..formats import SCALE_RULES
from ..formats.mxfp4 import folds_exactly
from ..hadamard import SUPPORTED_SIZES

__all__ = ["OperandSpec", "Transform", "GemmSpec", "CalibSpec", "Recipe", "STRATEGIES", "GEMMS", "DETECTOR_RULES",
           "ACCUMULATIONS", "OE_SELECTS", "SAVED_FORMS", "SmallGemmRule"]

#: The GEMM vocabulary used in fields, logs, plans and tables.
GEMMS = ("fprop", "dgrad", "wgrad")
#: AdaHOP strategies (`specs/adahop.md` §5); "none" is plain MX without a transform.
STRATEGIES = ("bf16", "none", "iht", "iht+oe_left", "iht+oe_right")
#: Outlier-pattern decision rules (`adahop.patterns.classify`): the official ratio test, and the
#: earlier reconstruction kept for comparison (`specs/adahop.md` §2.2).
DETECTOR_RULES = ("ratio", "significance")
#: Names of the strategy tables (`adahop.patterns.STRATEGY_TABLES` holds them; named here, below
#: `patterns`, so that `CalibSpec` can check a name without importing it).
STRATEGY_TABLE_NAMES = ("lv1", "lv2", "iht")
#: Those of them that give some pattern pair Outlier Extraction (a test checks it against the tables).
OE_STRATEGY_TABLES = ("lv1", "lv2")
#: How the FP8 fast path sums an MXFP4 GEMM (`adahop.kernels.mx_matmul`): ``"fp8-mma"`` on the FP8
#: tensor cores (fast; each instruction's 32 products are added below FP32, ‖Δ‖/‖|A||B|‖ ≈ 1e-5 on
#: the H200), ``"fp32"`` the same FP8-exact operands on the BF16 tensor cores (exact products, FP32
#: sums, BF16 GEMM speed). The reference backend computes in FP32 either way.
ACCUMULATIONS = ("fp8-mma", "fp32")
#: How OE picks its rows/columns (`specs/adahop.md` §2.2, §4; issue 18): ``"exact"`` the top-k by the
#: L2 norm along Kc; ``"foid"`` Fast Outlier Index Detection, the top-k by the norm of the first
#: :attr:`GemmSpec.foid_prefix` elements along Kc only (the paper's Figure 9).
OE_SELECTS = ("exact", "foid")
#: How X and W wait for their backward GEMMs (`DESIGN.md` §3; issue 18): ``"mxfp4"`` packed E2M1 codes and
#: E8M0 scales (4.25 bits per element), folded to FP8 by a kernel in backward; ``"fp8"`` their FP8 E4M3
#: fold and row scales (8 bits per element), written by the forward quantizer: no fold kernel in backward.
SAVED_FORMS = ("mxfp4", "fp8")
_FORMATS = ("mxfp4", "nvfp4", "none")
_ROUNDINGS = ("nearest", "stochastic")
_SIGNS = ("none", "fixed", "per_call")


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {msg}")


@dataclass(frozen=True, slots=True, kw_only=True)
class OperandSpec:
    """How one GEMM operand is quantized along the contracted dimension."""

    fmt: str = "mxfp4"
    """``"mxfp4"`` (E2M1 + E8M0, block 32), ``"nvfp4"`` (E2M1 + E4M3 block 16 + FP32 tensor
    scale), or ``"none"`` (quantization switched off: a test and debugging switch)."""
    rounding: str = "nearest"
    """``"nearest"`` (round-half-to-even) or ``"stochastic"``."""
    scale_rule: str = "floor"
    """MXFP4 scale rule: floor | rceil | adahop | tseng (`adahop.formats.mxfp4.block_exponents`)."""
    max_scale_range: int | None = 8
    """MXFP4: limit each block exponent to ≥ row max − r; 8 lets the FP8 fast path fold exactly."""
    tile_2d: bool = False
    """NVFP4 only: 16×16 tiles (NVIDIA's weight recipe)."""

    def validate(self, where: str) -> None:
        """Raise ValueError naming ``where`` and the field when a value is not allowed."""
        _check(self.fmt in _FORMATS, where, f"fmt={self.fmt!r}; allowed {_FORMATS}")
        _check(self.rounding in _ROUNDINGS, where, f"rounding={self.rounding!r}; allowed {_ROUNDINGS}")
        _check(self.scale_rule in SCALE_RULES, where, f"scale_rule={self.scale_rule!r}; allowed {SCALE_RULES}")
        if self.fmt == "mxfp4" and self.rounding == "stochastic":
            _check(self.scale_rule in ("rceil", "tseng"), where,
                   f"stochastic rounding with scale_rule={self.scale_rule!r} clips and biases; use 'rceil' or 'tseng'")
        _check(not self.tile_2d or self.fmt == "nvfp4", where, "tile_2d is an NVFP4 option")
        if self.fmt == "nvfp4":  # quant_kwargs would drop them: a setting that changes nothing
            _check(self.scale_rule == "floor" and self.max_scale_range in (None, 8), where,
                   f"scale_rule={self.scale_rule!r}, max_scale_range={self.max_scale_range} with fmt='nvfp4': both are "
                   "MXFP4 options (E8M0 block exponents); NVFP4's E4M3 block scales take neither, so leave them at "
                   "their defaults")

    @property
    def folds_to_fp8(self) -> bool:
        """True for an MXFP4 operand with an exact FP8 fold (``max_scale_range`` 0…8), which the fast
        path multiplies as FP8 (`DESIGN.md` §3)."""
        return self.fmt == "mxfp4" and folds_exactly(self.max_scale_range)

    def quant_kwargs(self) -> dict:
        """Keyword arguments for :func:`adahop.formats.quantize` (without axis/generator)."""
        if self.fmt == "mxfp4":
            return dict(scale_rule=self.scale_rule, rounding=self.rounding, max_scale_range=self.max_scale_range)
        if self.fmt == "nvfp4":
            return dict(rounding=self.rounding, tile_2d=self.tile_2d)
        return {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Transform:
    """A block Hadamard ``I ⊗ (D_s·H_b)``; ``block_size=0`` means the whole dimension."""

    block_size: int = 32
    signs: str = "none"
    """``"none"`` (Sylvester only), ``"fixed"`` (one sign vector for every layer and step, from
    ``sign_seed``) or ``"per_call"`` (fresh signs at each GEMM call, from the layer generator)."""
    sign_seed: int = 0

    def validate(self, where: str) -> None:
        """Raise ValueError naming ``where`` and the field when a value is not allowed."""
        _check(self.block_size == 0 or self.block_size in SUPPORTED_SIZES, where,
               f"transform block_size={self.block_size}; allowed 0 (whole dim) or {SUPPORTED_SIZES}")
        _check(self.signs in _SIGNS, where, f"transform signs={self.signs!r}; allowed {_SIGNS}")


IHT32 = Transform(block_size=32)


@dataclass(frozen=True, slots=True, kw_only=True)
class GemmSpec:
    """What one GEMM does. ``C = A·B`` with A ``[M, Kc]`` and B ``[Kc, N']``."""

    strategy: str = "none"
    """bf16 | none | iht | iht+oe_left | iht+oe_right (`specs/adahop.md` §5), or ``"calibrated"``:
    taken per layer from the frozen AdaHOP plan."""
    a: OperandSpec = field(default_factory=OperandSpec)
    b: OperandSpec = field(default_factory=OperandSpec)
    inner: Transform | None = None
    """Transform along Kc on both operands (cancels in the product). ``strategy`` 'iht*' implies
    ``IHT32`` when this is None."""
    oe_rank: int = 64
    """Rows of A (OE-Left) or columns of B (OE-Right) routed through the BF16 path."""
    oe_select: str = "exact"
    """How OE picks them (:data:`OE_SELECTS`): ``"exact"`` top-k of the full L2 norm along Kc,
    ``"foid"`` top-k of the norm over the first ``foid_prefix`` elements along Kc."""
    foid_prefix: int = 64
    """FOID's prefix length along Kc (64 in the paper)."""
    outer_a: Transform | None = None
    """Hadamard along A's rows (M), undone on the output (HALO-2's token rotation of ∇Y)."""
    outer_b: Transform | None = None
    """Hadamard along B's columns (N'), undone on the output (HALO-1/2 backward)."""
    mean_split: str = "none"
    """Averis mean-residual split: ``"none"``, ``"a_rows"`` (token mean of A over M: fprop and
    dgrad) or ``"inner"`` (token means of both operands over Kc: wgrad; no inner transform, ValueError)."""
    mean_cross_terms: bool = True
    """For ``mean_split='inner'``: keep the two cross terms of Averis Eq. 12."""
    mean_bf16: bool = False
    """Averis's mean vectors stay BF16 instead of FP4 (ours; `specs/related_methods.md` §1.7 lists it
    beside the paper's FP4 mean). The residual is taken from the BF16-rounded mean, so residual + mean
    is the operand exactly, and the rank-one terms multiply that BF16 mean by the dequantized other
    operand: exact but for the other operand's (and the residual's) quantization.
    With ``mean_split="a_rows"`` it takes no inner transform and no ``outer_b`` (ValueError)."""
    accumulation: str = "fp8-mma"
    """How the FP8 fast path sums the quantized product: ``"fp8-mma"`` or ``"fp32"`` (see
    :data:`ACCUMULATIONS`); set every GEMM's at once with :meth:`Recipe.with_accumulation`."""

    def validate(self, where: str) -> None:
        """Raise ValueError naming ``where`` and the field when a value is not allowed."""
        _check(self.strategy in STRATEGIES + ("calibrated",), where,
               f"strategy={self.strategy!r}; allowed {STRATEGIES + ('calibrated',)}")
        self.a.validate(f"{where}.a")
        self.b.validate(f"{where}.b")
        for name in ("inner", "outer_a", "outer_b"):
            t = getattr(self, name)
            if t is not None:
                t.validate(f"{where}.{name}")
                _check(name == "inner" or t.signs == "none", where,
                       f"{name} signs={t.signs!r}; an outer Hadamard is undone on the output unsigned, "
                       "use signs='none'")
        _check(self.oe_rank >= 1, where, f"oe_rank={self.oe_rank} must be >= 1")
        _check(self.oe_select in OE_SELECTS, where, f"oe_select={self.oe_select!r}; allowed {OE_SELECTS}")
        _check(self.foid_prefix >= 1, where, f"foid_prefix={self.foid_prefix} must be >= 1")
        _check(self.mean_split in ("none", "a_rows", "inner"), where,
               f"mean_split={self.mean_split!r}; allowed ('none', 'a_rows', 'inner')")
        _check(not self.mean_bf16 or self.mean_split != "none", where,
               "mean_bf16=True needs a mean split (mean_split 'a_rows' or 'inner')")
        # the rank-one mean terms are formed outside the inner transform (and the BF16 mean outside
        # outer_b too): under one they would silently miss the product (by ~0.35-1.3 relative)
        _check(self.mean_split != "inner" or self.transform is None, where,
               "mean_split='inner' with an inner transform (strategy 'iht*' or inner=...) is not supported: "
               "its mean terms are formed untransformed; use strategy 'none' and inner=None")
        _check(not (self.mean_bf16 and self.mean_split == "a_rows") or (self.transform is None and self.outer_b is None),
               where, "mean_bf16=True with mean_split='a_rows' takes no inner transform (strategy 'iht*' or inner=...) "
               "and no outer_b: the BF16 mean multiplies the untransformed B; drop them or set mean_bf16=False")
        _check(self.accumulation in ACCUMULATIONS, where, f"accumulation={self.accumulation!r}; allowed {ACCUMULATIONS}")

    @property
    def transform(self) -> Transform | None:
        """The inner transform in effect (IHT32 for the 'iht*' strategies)."""
        if self.inner is not None:
            return self.inner
        return IHT32 if self.strategy.startswith("iht") else None

    @property
    def draws_random_bits(self) -> bool:
        """True when a call of this GEMM draws random bits: stochastic rounding of an operand, or
        random signs drawn per call."""
        tr = self.transform
        return "stochastic" in (self.a.rounding, self.b.rounding) or (tr is not None and tr.signs == "per_call")

    def with_strategy(self, strategy: str) -> "GemmSpec":
        """A copy that runs ``strategy`` (used when a calibrated plan is frozen)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not one of {STRATEGIES}")
        return replace(self, strategy=strategy)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibSpec:
    """AdaHOP calibration (`specs/adahop.md` §2.4)."""

    table: str = "lv2"
    """Strategy table: ``"lv1"``, ``"lv2"`` or ``"iht"`` (every pair IHT, a control;
    `adahop.patterns.STRATEGY_TABLES`)."""
    steps: int = 30
    """Optimizer steps of BF16 GEMMs with pattern detection before the plan is frozen."""
    threshold: float = 2.0
    """Detector threshold τ: on the ratio of the two normalized CVs under rule ``"ratio"``, on the
    larger CV itself under ``"significance"`` (`specs/adahop.md` §2.2)."""
    rule: str = "ratio"
    """Decision rule: ``"ratio"`` (the official AdaHOP detector) or ``"significance"`` (our earlier
    reconstruction, kept for comparison); see :func:`adahop.patterns.classify`."""
    floor: float | None = None
    """Optional (ours, off by default): a Row/Column verdict also needs its own CV ≥ this."""
    min_peak: float | None = None
    """Optional (ours, off by default): a Row (Column) verdict also needs the largest row (column)
    RMS to be at least this many times the median one."""

    def validate(self, where: str) -> None:
        """Raise ValueError naming ``where`` and the field when a value is not allowed."""
        _check(self.table in STRATEGY_TABLE_NAMES, where, f"table={self.table!r}; allowed {STRATEGY_TABLE_NAMES}")
        _check(self.steps >= 1, where, f"steps={self.steps} must be >= 1")
        _check(self.rule in DETECTOR_RULES, where, f"rule={self.rule!r}; allowed {DETECTOR_RULES}")
        _check(self.threshold >= 1 if self.rule == "ratio" else self.threshold > 0, where,
               f"threshold={self.threshold} must be {'>= 1 for the ratio rule' if self.rule == 'ratio' else '> 0'}")
        _check(self.floor is None or self.floor > 0, where, f"floor={self.floor} must be > 0 or None (off)")
        _check(self.min_peak is None or self.min_peak >= 1, where, f"min_peak={self.min_peak} must be >= 1 or None (off)")


@dataclass(frozen=True, slots=True, kw_only=True)
class SmallGemmRule:
    """Which GEMMs of a linear layer ``K → N`` are too small to gain from the FP8 fast path: those
    run exact BF16 GEMMs instead (issue 18 §3; our rule, after torchtitan's ``auto_filter_small_kn``,
    which skips whole layers by torchao's H100 float8 tables).

    Decided from the layer's static shape, per GEMM (the token count T is taken as large, as in
    training, where T ≥ K, N). The FP8 GEMM saves time in proportion to its product
    ``M·Kc·N'``; what it costs on top is (1) a fixed host and launch cost per GEMM call (the
    quantizers, the fold, the scales), which a per-token product ``K·N`` below :attr:`min_kn` does not
    pay back, and (2) the quantizer's memory traffic, ``∝ M·Kc + Kc·N'``, so that the gain per byte
    grows with the *outer* dimensions ``M·N'/(M + N')``: with T large, N for fprop
    (``[T,K]·[K,N]``), K for dgrad (``[T,N]·[N,K]``), and the smaller of N and K for wgrad
    (``[N,T]·[T,K]``), compared with :attr:`min_outer`.

    The defaults are a first choice, to be measured (`adahop bench model --bf16-small-gemms`):
    on the H200 of issue 18 every llama-125m GEMM (768 wide, ``K·N`` ≤ 1.6M) ran slower than BF16
    even replayed from CUDA graphs (0.83×), while 4 blocks of Llama-3.1-8B (``K·N`` ≥ 4.2M) ran
    1.11× faster; torchao's rowwise filter keeps a layer only above 2048 inputs and 1024 outputs.
    With them: llama-125m and llama-350m run all-BF16, Llama-3.2-1B keeps every layer but k/v_proj
    (2048 → 512), Llama-3.1-8B keeps all.
    """

    min_kn: int = 2048 * 2048
    """A layer with ``K·N`` (in_features · out_features) below this runs its three GEMMs in BF16."""
    min_outer: int = 1024
    """A GEMM whose static outer dimension (fprop N, dgrad K, wgrad min(K, N)) is below this runs in BF16."""

    def validate(self, where: str) -> None:
        """Raise ValueError naming ``where`` and the field when a value is not allowed."""
        _check(isinstance(self.min_kn, int) and self.min_kn >= 0, where, f"min_kn={self.min_kn!r} must be an int >= 0")
        _check(isinstance(self.min_outer, int) and self.min_outer >= 0, where,
               f"min_outer={self.min_outer!r} must be an int >= 0")

    def bf16_gemms(self, in_features: int, out_features: int) -> tuple[str, ...]:
        """The GEMMs (of :data:`GEMMS`, in that order) of a layer ``in_features → out_features`` that
        this rule runs in BF16."""
        k, n = in_features, out_features
        if k * n < self.min_kn:
            return GEMMS
        outer = {"fprop": n, "dgrad": k, "wgrad": min(k, n)}
        return tuple(g for g in GEMMS if outer[g] < self.min_outer)


@dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """A named training recipe: one :class:`GemmSpec` per GEMM plus layer-level options."""

    name: str
    description: str = ""
    fprop: GemmSpec = field(default_factory=GemmSpec)
    dgrad: GemmSpec = field(default_factory=GemmSpec)
    wgrad: GemmSpec = field(default_factory=GemmSpec)
    calibration: CalibSpec | None = None
    """Set for AdaHOP recipes: GEMMs whose strategy is 'calibrated' take it from the plan."""
    bf16_last_layers: int = 0
    """Transformer blocks at the end of the model whose linears stay BF16 (NVIDIA recipe)."""
    bf16_first_layers: int = 0
    """Transformer blocks at the start of the model whose linears stay BF16."""
    bf16_small_gemms: SmallGemmRule | None = None
    """GEMMs too small to gain from the FP8 fast path (:class:`SmallGemmRule`) run exact BF16.
    None (the presets): every GEMM runs the recipe, so a recipe's numerics never depend on the
    model's width; ``recipe.with_small_gemms_bf16()`` turns the default rule on (a speed choice)."""
    saved_operands: str = "mxfp4"
    """The form in which X and W are saved for the backward GEMMs that take them quantized
    (:data:`SAVED_FORMS`): ``"fp8"`` trades the fold kernel of each saved operand for 8 bits a
    saved element instead of 4.25. Only MXFP4 operands with an exact FP8 fold
    (``max_scale_range`` ≤ 8), on the fast path, change; the numbers are the same either way
    (the fold is exact). The ``@saved-fp8`` variant of a preset sets it."""

    def __post_init__(self) -> None:
        for g in GEMMS:
            getattr(self, g).validate(f"recipe {self.name!r} {g}")
        calibrated = any(getattr(self, g).strategy == "calibrated" for g in GEMMS)
        if calibrated and self.calibration is None:
            raise ValueError(f"recipe {self.name!r}: a GEMM has strategy 'calibrated' but calibration is None")
        if self.calibration is not None:
            self.calibration.validate(f"recipe {self.name!r} calibration")
        if self.bf16_last_layers < 0 or self.bf16_first_layers < 0:
            raise ValueError(f"recipe {self.name!r}: bf16_first_layers/bf16_last_layers must be >= 0")
        if self.bf16_small_gemms is not None:
            _check(isinstance(self.bf16_small_gemms, SmallGemmRule), f"recipe {self.name!r}",
                   f"bf16_small_gemms must be a SmallGemmRule or None, got {type(self.bf16_small_gemms).__name__}")
            self.bf16_small_gemms.validate(f"recipe {self.name!r} bf16_small_gemms")
        _check(self.saved_operands in SAVED_FORMS, f"recipe {self.name!r}",
               f"saved_operands={self.saved_operands!r}; allowed {SAVED_FORMS}")

    def gemm(self, name: str) -> GemmSpec:
        """The spec of GEMM ``name`` (fprop, dgrad or wgrad)."""
        if name not in GEMMS:
            raise ValueError(f"unknown GEMM {name!r}; use one of {GEMMS}")
        return getattr(self, name)

    def with_accumulation(self, accumulation: str) -> "Recipe":
        """A copy whose three GEMMs sum on the fast path as ``accumulation`` (:data:`ACCUMULATIONS`).

        Raises:
            ValueError: an unknown ``accumulation``."""
        if accumulation not in ACCUMULATIONS:
            raise ValueError(f"recipe {self.name!r}: accumulation={accumulation!r}; allowed {ACCUMULATIONS}")
        return replace(self, **{g: replace(getattr(self, g), accumulation=accumulation) for g in GEMMS})

    def with_calibration_steps(self, steps: int) -> "Recipe":
        """A copy that calibrates its outlier patterns over ``steps`` training steps, then freezes the plan
        (``adahop train --calib-steps``; AdaHOP paper §4.1 votes over the first steps).

        Raises:
            ValueError: a recipe without calibration (its strategies are fixed), or ``steps`` not an int >= 1."""
        if self.calibration is None:
            raise ValueError(f"recipe {self.name!r} has fixed strategies and no calibration to set the steps of; "
                             f"use an adahop-* recipe, or drop the calibration steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"calibration steps must be an int >= 1, got {steps!r}")
        return replace(self, calibration=replace(self.calibration, steps=steps))

    def with_small_gemms_bf16(self, rule: SmallGemmRule | None = SmallGemmRule()) -> "Recipe":
        """A copy that runs the GEMMs ``rule`` finds too small in BF16 (None: none of them)."""
        return replace(self, bf16_small_gemms=rule)

    def small_bf16_gemms(self, in_features: int, out_features: int) -> tuple[str, ...]:
        """The GEMMs of a layer ``in_features → out_features`` that :attr:`bf16_small_gemms` runs in
        BF16 (none when it is None or the recipe is all-BF16 anyway)."""
        if self.bf16_small_gemms is None or self.is_bf16:
            return ()
        return self.bf16_small_gemms.bf16_gemms(in_features, out_features)

    @property
    def accumulations(self) -> dict[str, str]:
        """The fast path's accumulation of each GEMM, ``{"fprop": "fp8-mma", ...}``: ``"fp32"`` for a GEMM
        with an NVFP4 operand, whose GEMM (`adahop.kernels.nvfp4_matmul`) always sums in FP32 and reads
        no ``GemmSpec.accumulation``."""
        specs = {g: getattr(self, g) for g in GEMMS}
        return {g: "fp32" if "nvfp4" in (s.a.fmt, s.b.fmt) else s.accumulation for g, s in specs.items()}

    @property
    def is_bf16(self) -> bool:
        """True when every GEMM runs in BF16 (no quantization at all)."""
        return all(getattr(self, g).strategy == "bf16" for g in GEMMS)

    @property
    def draws_random_bits(self) -> bool:
        """True when any GEMM draws random bits (stochastic rounding or per-call random signs)."""
        return any(getattr(self, g).draws_random_bits for g in GEMMS)
