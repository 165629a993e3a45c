"""torchao's float8 training (``torchao.float8.convert_to_float8_training``) as recipes of
``adahop bench model``: the rows a Hopper user would pick instead of MXFP4, measured on the same
model in the same process (issue 18). torchao is an optional dependency (in the ``[test]`` extras);
its float8 GEMMs are ``torch._scaled_mm``, so they need a CUDA GPU with FP8 tensor cores (sm_89+).
"""

from __future__ import annotations

from torch import nn

__all__ = ["TORCHAO_RECIPES", "is_torchao_recipe", "float8_config", "convert_float8"]

#: ``bench model`` recipe name -> torchao's float8 recipe (``Float8LinearConfig.from_recipe_name``):
#: ``rowwise`` scales X, W, ∇Y per row along the contracted dim; ``tensorwise`` one scale per tensor.
TORCHAO_RECIPES = {"torchao-fp8-rowwise": "rowwise", "torchao-fp8-tensorwise": "tensorwise"}


def is_torchao_recipe(name: str) -> bool:
    """True for the names of :data:`TORCHAO_RECIPES` (and any other ``torchao-`` name, which
    :func:`float8_config` rejects with the list)."""
    return name.startswith("torchao-")


def float8_config(recipe: str, device):
    """torchao's ``Float8LinearConfig`` for ``recipe``, after checking that it can run on ``device``.

    Raises:
        ValueError: an unknown ``torchao-*`` name (lists the known ones).
        RuntimeError: ``device`` is not a CUDA GPU with compute capability 8.9 or more (torchao's
            float8 GEMM is ``torch._scaled_mm``), or torchao is not installed (says how to install it).
    """
    import torch

    if recipe not in TORCHAO_RECIPES:
        raise ValueError(f"unknown torchao recipe {recipe!r}; use one of {', '.join(TORCHAO_RECIPES)}")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise RuntimeError(f"{recipe}: torchao's float8 training needs a CUDA GPU with FP8 tensor cores (sm_89+, "
                           f"its GEMM is torch._scaled_mm); got device {dev}. Run it on an H100/H200, or drop it from --recipes")
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9):
        raise RuntimeError(f"{recipe}: torchao's float8 training needs compute capability 8.9 or more (FP8 tensor "
                           f"cores); this GPU has {cap[0]}.{cap[1]}")
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError:
        raise RuntimeError(f"{recipe} needs torchao (pip install torchao; a wheel without its torch pin: "
                           "pip install --no-deps torchao-*.whl)") from None
    return Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe])


def _keep(module: nn.Module, fqn: str) -> bool:
    # the layers adahop converts (the LM head stays high precision, as in convert_model's default),
    # with the dims float8 GEMMs need (multiples of 16)
    return (isinstance(module, nn.Linear) and not fqn.endswith("lm_head")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_float8(model: nn.Module, config) -> int:
    """Swap ``model``'s ``nn.Linear`` layers (all but ``lm_head``; dims multiples of 16) for torchao's
    ``Float8Linear`` under ``config`` (from :func:`float8_config`); returns how many were swapped."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(model, module_filter_fn=_keep, config=config)
    return sum(isinstance(m, Float8Linear) for m in model.modules())
