"""Named recipe presets: one small definition each (STYLE §2.2).

AdaHOP presets follow `specs/adahop.md`; the rival recipes live in :mod:`adahop.recipes.rivals`.
"""

from __future__ import annotations

from .rivals import RIVALS
from .spec import CalibSpec, GemmSpec, OperandSpec, Recipe

__all__ = ["PRESETS", "register", "get_recipe", "list_recipes"]

PRESETS: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to :data:`PRESETS` under its name (names are unique)."""
    if recipe.name in PRESETS:
        raise ValueError(f"a recipe named {recipe.name!r} is already registered")
    PRESETS[recipe.name] = recipe
    return recipe


def get_recipe(name: str) -> Recipe:
    """The preset called ``name``. Raises ValueError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(list_recipes())}") from None


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
