"""Layer 4: recipes as frozen data, and the named presets."""

from .presets import PRESETS, get_recipe, list_recipes, register
from .spec import GEMMS, STRATEGIES, CalibSpec, GemmSpec, OperandSpec, Recipe, Transform

__all__ = ["PRESETS", "get_recipe", "list_recipes", "register", "GEMMS", "STRATEGIES", "CalibSpec", "GemmSpec",
           "OperandSpec", "Recipe", "Transform"]
