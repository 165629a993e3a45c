"""Layer 7: AdaHOP inside the training stacks users already run.

- :mod:`adahop.integrations.transformers`: ``AdaHOPCallback`` for the Hugging Face ``Trainer``.
- :mod:`adahop.integrations.accelerate`: ``prepare_adahop`` for ``accelerate`` loops.
- :mod:`adahop.integrations.torchtitan`: ``AdaHOPConverter`` for torchtitan's model converters.

Each submodule imports its framework when it is imported, so ``import adahop`` never needs them;
the extras ``hf`` and ``torchtitan`` install them. What each does and does not do yet:
docs/integrations.md.
"""

from __future__ import annotations

from ..patterns import Plan
from ..recipes import Recipe, get_recipe

__all__ = ["resolve_recipe", "resolve_plan", "check_converted", "missing_extra", "process_seed"]


def process_seed(seed: int) -> int:
    """The conversion seed of this process: ``seed`` in one process, and under ``torch.distributed`` (torchrun)
    each rank's own (:func:`adahop.train.distributed.rank_seed`, as ``adahop train`` converts), so that the
    stochastic rounding and random signs are independent noise on every rank, not the same draws. Raises
    nothing. Source: ours (docs/distributed.md, Randomness)."""
    import torch.distributed as dist

    from ..train.distributed import rank_seed

    if dist.is_available() and dist.is_initialized():
        return rank_seed(seed, dist.get_rank(), dist.get_world_size())
    return seed


def resolve_recipe(recipe: str | Recipe, calib_steps: int | None = None) -> Recipe:
    """``recipe`` (a preset name or a :class:`Recipe`) with its calibration length set to ``calib_steps``
    when given (AdaHOP recipes only; ``adahop train --calib-steps`` does the same).

    Raises:
        ValueError: an unknown preset name, ``calib_steps`` < 1, or ``calib_steps`` with a recipe that does not
            calibrate (its strategies are fixed: the steps were dropped silently, where ``convert_model`` refuses them)."""
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if calib_steps is not None:
        if calib_steps < 1:
            raise ValueError(f"calib_steps must be >= 1, got {calib_steps}")
        r = r.with_calibration_steps(calib_steps)  # refuses a recipe without calibration, naming it
    return r


def resolve_plan(plan) -> Plan | None:
    """A :class:`Plan`, a path to a ``plan.json``, or None, as a Plan or None.

    Raises:
        ValueError: the file does not exist or is not a plan."""
    if plan is None or isinstance(plan, Plan):
        return plan
    from pathlib import Path

    if not Path(plan).exists():
        raise ValueError(f"plan {plan}: no such file; pass a plan.json written by adahop (a run, a checkpoint, analyze)")
    return Plan.load(plan)


def check_converted(model, recipe: Recipe, plan: Plan | None, calib_steps: int | None, who: str) -> None:
    """Raise a ValueError when ``model`` is already converted and ``recipe``, ``plan`` or ``calib_steps``
    asks for something its conversion did not do: they would be ignored, silently (a plan meant to skip
    calibration, and 30 BF16 steps ran instead)."""
    from ..nn.convert import get_controller

    ctrl = get_controller(model)
    fix = "pass them to adahop.convert_model, or give an unconverted model"
    if ctrl.recipe.name != recipe.name:
        raise ValueError(f"{who}: the model is already converted with recipe {ctrl.recipe.name!r}, not {recipe.name!r}; "
                         f"pass that recipe, or give an unconverted model")
    if plan is not None and (ctrl.plan is None or ctrl.plan.to_json() != plan.to_json()):
        raise ValueError(f"{who}: the model is already converted {'without' if ctrl.plan is None else 'with another'} "
                         f"plan, and plan= would not be applied; {fix}")
    have = ctrl.recipe.calibration.steps if ctrl.recipe.calibration is not None else None
    if calib_steps is not None and have is not None and have != calib_steps:
        raise ValueError(f"{who}: the model is already converted with {have} calibration steps, and calib_steps="
                         f"{calib_steps} would not be applied; {fix}")


def missing_extra(package: str, extra: str, what: str) -> ImportError:
    """The error for a framework that is not installed: names the pip extra that installs it."""
    return ImportError(f"{what} needs the {package!r} package, which is not installed; install it with "
                       f"pip install 'adahop[{extra}]' (or pip install {package})")
