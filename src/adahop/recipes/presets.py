"""Named recipe presets: one small definition each (STYLE §2.2).

AdaHOP presets follow `specs/adahop.md`; the rival recipes live in :mod:`adahop.recipes.rivals`.
"""

from __future__ import annotations

from dataclasses import replace

from .rivals import RIVALS
from .spec import GEMMS, OE_STRATEGY_TABLES, CalibSpec, GemmSpec, OperandSpec, Recipe

__all__ = ["PRESETS", "VARIANTS", "register", "get_recipe", "list_recipes"]

PRESETS: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to :data:`PRESETS` under its name (names are unique)."""
    if recipe.name in PRESETS:
        raise ValueError(f"a recipe named {recipe.name!r} is already registered")
    PRESETS[recipe.name] = recipe
    return recipe


#: Variants a recipe name may carry after ``@`` (`get_recipe`): the per-GEMM ablation and the
#: exponent-range arm of issue 19.
VARIANTS = ("only-fprop", "only-dgrad", "only-wgrad", "msr-none", "foid", "bf16-calib", "mean-bf16", "saved-fp8")


def get_recipe(name: str) -> Recipe:
    """The preset called ``name``, or a variant of one: ``BASE@VARIANT[@VARIANT]``.

    Variants (a documented override of the base preset's GEMM table, for ablations):

    - ``only-fprop`` / ``only-dgrad`` / ``only-wgrad``: that GEMM keeps the base's spec, the other
      two run BF16 (``mxfp4-had@only-wgrad``: which GEMM carries the loss gap). An AdaHOP base
      keeps its calibration, and its plan decides the one quantized GEMM.
    - ``msr-none``: every MXFP4 operand without the row exponent-range limit (``max_scale_range``
      None instead of 8: blocks may sit more than 2⁸ below their row's largest, so the FP8 fold
      does not apply and the fast path multiplies the exact BF16 operands instead:
      `adahop.kernels.mx_matmul_dequant`).
    - ``foid``: OE picks its rows/columns by FOID (the norm of the first 64 elements along Kc)
      instead of the exact top-k (`GemmSpec.oe_select`; issue 18).
    - ``mean-bf16``: Averis keeps its mean vectors in BF16 (`GemmSpec.mean_bf16`), not FP4.
    - ``saved-fp8``: X and W wait for backward as their FP8 fold, not packed MXFP4
      (`Recipe.saved_operands`): the same numbers, no fold kernel in backward, 8 bits a saved
      element instead of 4.25 (a speed-for-memory choice; issue 18).
    - ``bf16-calib``: a recipe with IHT on every GEMM (``mxfp4-had``) first runs AdaHOP's 30
      exact-BF16 calibration steps, then IHT everywhere (strategy table ``"iht"``); GEMMs an
      ``only-*`` variant made BF16 stay BF16, in either order. It is the
      control that holds the warm-up fixed when AdaHOP is compared with uniform IHT
      (`docs/results.md`, per-GEMM ablation).

    Raises:
        ValueError: unknown preset (lists the known names) or variant, a variant given twice, a variant
            that would change nothing (``foid`` without OE, ``msr-none`` without a limited MXFP4 operand,
            ``only-X`` where X is BF16 in the base or the only GEMM it quantizes, ``saved-fp8`` without a backward
            GEMM whose saved operand folds to FP8, checked after every variant), or
            ``bf16-calib`` on a recipe that calibrates already or has a GEMM neither IHT nor BF16 (or none IHT).
    """
    base, *variants = name.split("@")
    try:
        recipe = PRESETS[base]
    except KeyError:
        raise ValueError(f"unknown recipe {base!r}; known recipes: {', '.join(list_recipes())}") from None
    for v in variants:  # names first: a misspelling is named as such, whatever else is wrong
        if v not in VARIANTS:
            raise ValueError(f"unknown recipe variant {v!r}; allowed after '@': {', '.join(VARIANTS)}")
    if len(set(variants)) != len(variants) or sum(v.startswith("only-") for v in variants) > 1:
        raise ValueError(f"recipe {name!r}: each variant at most once, and one only-GEMM at most")
    for v in variants:
        recipe = _variant(recipe, v)
    if "saved-fp8" in variants:  # on the final recipe: a later variant (only-*, msr-none) may leave it nothing
        _check_saved_fp8(recipe, name)
    return replace(recipe, name=name) if variants else recipe


def _variant(recipe: Recipe, variant: str) -> Recipe:
    if variant.startswith("only-") and variant[5:] in GEMMS:
        keep = variant[5:]
        quantized = [g for g in GEMMS if recipe.gemm(g).strategy != "bf16"]
        if not quantized:
            raise ValueError(f"recipe variant {variant!r} on {recipe.name!r}, which quantizes no GEMM: it would run as "
                             f"the base under another name; apply only-* to a recipe that quantizes, e.g. mxfp4@{variant}")
        if quantized == [keep] or keep not in quantized:  # the base itself, or every GEMM BF16: a row that measures nothing
            raise ValueError(f"recipe variant {variant!r} on {recipe.name!r}, which quantizes {', '.join(quantized)}: it "
                             f"would run as {'the base' if quantized == [keep] else 'the bf16 recipe'} under another name; "
                             + ("drop the variant" if quantized == [keep] else
                                f"pick one of {', '.join('only-' + g for g in quantized)}"))
        bf16 = {g: GemmSpec(strategy="bf16") for g in GEMMS if g != keep}
        return replace(recipe, description=f"{recipe.description} [only {keep} quantized; the other GEMMs BF16]", **bf16)
    if variant == "msr-none":
        if not any(op.fmt == "mxfp4" and op.max_scale_range is not None and recipe.gemm(g).strategy != "bf16"
                   for g in GEMMS for op in (recipe.gemm(g).a, recipe.gemm(g).b)):
            raise ValueError(f"recipe variant 'msr-none' needs MXFP4 operands with the exponent-range limit (mxfp4, "
                             f"mxfp4-had, tseng, adahop-lv1/lv2); {recipe.name!r} has none: it would run as the base under another name")

        def unlimited(op: OperandSpec) -> OperandSpec:
            return replace(op, max_scale_range=None) if op.fmt == "mxfp4" else op
        specs = {g: replace(getattr(recipe, g), a=unlimited(recipe.gemm(g).a), b=unlimited(recipe.gemm(g).b))
                 for g in GEMMS}
        return replace(recipe, description=f"{recipe.description} [MXFP4 without the exponent-range limit]", **specs)
    if variant == "foid":
        table = recipe.calibration.table if recipe.calibration is not None else None
        if not any("oe" in recipe.gemm(g).strategy or (recipe.gemm(g).strategy == "calibrated" and table in OE_STRATEGY_TABLES)
                   for g in GEMMS):
            raise ValueError(f"recipe variant 'foid' needs a recipe with Outlier Extraction (adahop-lv1, adahop-lv2); "
                             f"{recipe.name!r} has none: FOID would select nothing and it would run as the base under another name")
        specs = {g: replace(getattr(recipe, g), oe_select="foid") for g in GEMMS}
        return replace(recipe, description=f"{recipe.description} [OE indices by FOID]", **specs)
    if variant == "mean-bf16":
        if all(recipe.gemm(g).mean_split == "none" for g in GEMMS):
            raise ValueError(f"recipe variant 'mean-bf16' needs a recipe with a mean split (averis, averis-mxfp4); "
                             f"{recipe.name!r} has none")
        specs = {g: replace(recipe.gemm(g), mean_bf16=recipe.gemm(g).mean_split != "none") for g in GEMMS}
        return replace(recipe, description=f"{recipe.description} [mean vectors in BF16]", **specs)
    if variant == "bf16-calib":
        # BF16 GEMMs stay (after @only-*: either order gives the same recipe); the IHT ones calibrate
        strategies = {recipe.gemm(g).strategy for g in GEMMS}
        if recipe.calibration is not None or "iht" not in strategies or not strategies <= {"iht", "bf16"}:
            raise ValueError(f"recipe variant 'bf16-calib' needs a recipe with IHT on every GEMM it quantizes and no "
                             f"calibration (such as mxfp4-had); {recipe.name!r}, with the variants before it, has "
                             f"{sorted(strategies)}" + (" and calibrates already" if recipe.calibration is not None else ""))
        specs = {g: replace(recipe.gemm(g), strategy="calibrated") for g in GEMMS if recipe.gemm(g).strategy == "iht"}
        return replace(recipe, description=f"{recipe.description} [after BF16 calibration steps, as AdaHOP (30 unless --calib-steps)]",
                       calibration=CalibSpec(table="iht"), **specs)
    if variant == "saved-fp8":  # what it changes is checked on the final recipe (_check_saved_fp8)
        return replace(recipe, description=f"{recipe.description} [X and W saved as their FP8 fold]", saved_operands="fp8")
    raise ValueError(f"unknown recipe variant {variant!r}; allowed after '@': {', '.join(VARIANTS)}")


def _check_saved_fp8(recipe: Recipe, name: str) -> None:
    """Refuse ``saved-fp8`` where ``recipe`` (every variant of ``name`` applied) runs as without it."""
    if not any(recipe.gemm(g).strategy != "bf16" and recipe.gemm(g).b.folds_to_fp8 for g in ("dgrad", "wgrad")):
        raise ValueError(f"recipe variant 'saved-fp8' needs a backward GEMM whose saved operand (W for dgrad, X for "
                         f"wgrad) is MXFP4 with an exact FP8 fold; {name!r} has none, so it would run as the base "
                         f"under another name")


def list_recipes() -> list[str]:
    """Names of all presets, in registration order."""
    return list(PRESETS)


def _same(spec: GemmSpec) -> dict[str, GemmSpec]:
    return dict(fprop=spec, dgrad=spec, wgrad=spec)


MX = OperandSpec(fmt="mxfp4", scale_rule="floor", max_scale_range=8)
"""MXFP4 with the OCP floor rule and the row exponent range limited to 8 (the FP8 fold)."""
MX_ADAHOP = OperandSpec(fmt="mxfp4", scale_rule="adahop", max_scale_range=8)
"""MXFP4 with AdaHOP's scale rule (`specs/adahop.md` §6.1)."""

register(Recipe(name="bf16", description="BF16 GEMMs everywhere: the quality reference.",
                **_same(GemmSpec(strategy="bf16"))))
register(Recipe(name="mxfp4", description="Plain MXFP4 on all three GEMMs, no outlier handling (OCP floor scale).",
                **_same(GemmSpec(strategy="none", a=MX, b=MX))))
register(Recipe(name="mxfp4-had", description="MXFP4 with the 32-block inner Hadamard (IHT) on every GEMM "
                "(AdaHOP with every pair mapped to IHT; the paper's 'MXFP4+Had.').",
                **_same(GemmSpec(strategy="iht", a=MX_ADAHOP, b=MX_ADAHOP))))

for _rival in RIVALS:  # Tseng, HALO-0/1/2, NVFP4, Averis, Quartet (`adahop.recipes.rivals`)
    register(_rival)


def _adahop(level: str) -> Recipe:
    return Recipe(
        name=f"adahop-{level}",
        description=f"AdaHOP-{level.capitalize()}: 30 BF16 calibration steps classify X, W, dY as Row/Column/None; "
        f"each GEMM then gets IHT, IHT+OE (top-64 rows/cols in BF16) or "
        + ("BF16 for Column-Column pairs." if level == "lv2" else "IHT+OE-Right for Column-Column pairs."),
        **_same(GemmSpec(strategy="calibrated", a=MX_ADAHOP, b=MX_ADAHOP, oe_rank=64)),
        calibration=CalibSpec(table=level, steps=30, threshold=2.0),
    )


register(_adahop("lv1"))
register(_adahop("lv2"))
