"""Layer 4: recipes as frozen data, and the named presets."""

from .presets import PRESETS, get_recipe, list_recipes, register
from .spec import ACCUMULATIONS, GEMMS, OE_SELECTS, STRATEGIES, CalibSpec, GemmSpec, OperandSpec, Recipe, SmallGemmRule, Transform

__all__ = ["PRESETS", "get_recipe", "list_recipes", "register", "ACCUMULATIONS", "OE_SELECTS", "GEMMS", "STRATEGIES", "CalibSpec",
           "GemmSpec", "OperandSpec", "Recipe", "SmallGemmRule", "Transform"]
