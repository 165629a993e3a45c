"""adahop: train LLMs with MXFP4 GEMMs at BF16 quality (AdaHOP, arXiv 2604.02525).

    model = adahop.convert_model(model, "adahop-lv2")   # every nn.Linear but lm_head
    for step in ...:
        loss.backward(); opt.step(); adahop.on_step(model, step + 1)
    print(adahop.describe(model))
"""

import importlib

__version__ = "0.1.0"

# The names below are imported on first use (PEP 562), so that `import adahop.cli` (the command
# line: `--help`, option errors) does not pay for torch; `adahop.convert_model` works as usual.
_LAZY = {
    "lowp_matmul": ".gemm",
    **dict.fromkeys(("LowPrecisionLinear", "convert_model", "describe", "get_controller", "on_step", "register_step_hook",
                     "saved_bytes"), ".nn"),
    **dict.fromkeys(("STRATEGY_TABLES", "Calibrator", "Pattern", "Plan", "detect_pattern"), ".patterns"),
    **dict.fromkeys(("Recipe", "get_recipe", "list_recipes"), ".recipes"),
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'adahop' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
