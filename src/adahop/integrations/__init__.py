"""Layer 7: AdaHOP inside the training stacks users already run.

- :mod:`adahop.integrations.transformers`: ``AdaHOPCallback`` for the Hugging Face ``Trainer``.
- :mod:`adahop.integrations.accelerate`: ``prepare_adahop`` for ``accelerate`` loops.
- :mod:`adahop.integrations.torchtitan`: ``AdaHOPConverter`` for torchtitan's model converters.

Each submodule imports its framework when it is imported, so ``import adahop`` never needs them;
the extras ``hf`` and ``torchtitan`` install them. What each does and does not do yet:
docs/integrations.md.
"""

from __future__ import annotations

import dataclasses

from ..patterns import Plan
from ..recipes import Recipe, get_recipe

__all__ = ["resolve_recipe", "resolve_plan", "missing_extra"]


def resolve_recipe(recipe: str | Recipe, calib_steps: int | None = None) -> Recipe:
    """``recipe`` (a preset name or a :class:`Recipe`) with its calibration length set to ``calib_steps``
    when given (AdaHOP recipes only; ``adahop train --calib-steps`` does the same).

    Raises:
        ValueError: an unknown preset name, or ``calib_steps`` < 1."""
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if calib_steps is not None:
        if calib_steps < 1:
            raise ValueError(f"calib_steps must be >= 1, got {calib_steps}")
        if r.calibration is not None:
            r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, steps=calib_steps))
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


def missing_extra(package: str, extra: str, what: str) -> ImportError:
    """The error for a framework that is not installed: names the pip extra that installs it."""
    return ImportError(f"{what} needs the {package!r} package, which is not installed; install it with "
                       f"pip install 'adahop[{extra}]' (or pip install {package})")
