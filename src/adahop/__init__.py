"""adahop: train LLMs with MXFP4 GEMMs at BF16 quality (AdaHOP, arXiv 2604.02525).

    model = adahop.convert_model(model, "adahop-lv2")   # every nn.Linear but lm_head
    for step in ...:
        loss.backward(); opt.step(); adahop.on_step(model, step + 1)
    print(adahop.describe(model))
"""

from .gemm import lowp_matmul
from .nn import LowPrecisionLinear, convert_model, describe, get_controller, on_step, saved_bytes
from .patterns import STRATEGY_TABLES, Calibrator, Pattern, Plan, detect_pattern
from .recipes import Recipe, get_recipe, list_recipes

__version__ = "0.1.0"

__all__ = ["lowp_matmul", "LowPrecisionLinear", "convert_model", "describe", "get_controller", "on_step",
           "saved_bytes", "STRATEGY_TABLES", "Calibrator", "Pattern", "Plan", "detect_pattern", "Recipe",
           "get_recipe", "list_recipes", "__version__"]
