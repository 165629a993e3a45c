"""AdaHOP in an ``accelerate`` loop: the conversion, the step hook on the optimizer, and the plan in
``accelerator.save_state`` / ``load_state``.

    prepare_adahop(model, optimizer, "adahop-lv2", accelerator=accelerator)   # before accelerator.prepare
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

from __future__ import annotations

import warnings
from pathlib import Path

from . import check_converted, missing_extra, process_seed, resolve_plan, resolve_recipe
from ..nn.convert import (convert_model, get_controller, load_controller_state, register_step_hook,
                          strategy_counts)
from ..optim.master import PackedMaster

__all__ = ["prepare_adahop", "AdaHOPState"]


class AdaHOPState:
    """The controller state of a converted model (plan, calibration votes, step) as an object with
    ``state_dict`` / ``load_state_dict``, for ``accelerator.register_for_checkpointing``."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict:
        # accelerate calls it on every process (its save writes on the main one): every rank's votes
        from ..train.distributed import controller_state_all_ranks

        return controller_state_all_ranks(self.model)

    def load_state_dict(self, state: dict) -> None:
        load_controller_state(self.model, state)


def prepare_adahop(model, optimizer, recipe="adahop-lv2", *, accelerator=None, exclude=("lm_head",), module_filter_fn=None,
                   seed: int = 0, plan=None, calib_steps: int | None = None, backend: str = "auto"):
    """Make ``model`` run ``recipe`` in an accelerate loop; call it before ``accelerator.prepare``.

    It converts ``model`` with :func:`adahop.convert_model` (unless it is converted already), hooks
    :func:`adahop.on_step` onto ``optimizer``'s own post-step hook (accelerate runs the inner step
    only when gradients sync, so accumulation micro-steps are not counted), pools the calibration
    votes of all processes, and, given ``accelerator``, registers the plan for
    ``save_state``/``load_state`` and at the freeze logs the strategy counts with ``accelerator.log``
    (its trackers) and writes ``plan.json`` into ``accelerator.project_dir`` when it has one.

    Args:
        model: the ``nn.Module`` (not yet wrapped by ``accelerator.prepare``).
        optimizer: its ``torch.optim.Optimizer`` (an ``AcceleratedOptimizer`` is unwrapped).
        recipe, exclude, module_filter_fn, seed, backend: as in :func:`adahop.convert_model`.
        plan: a frozen :class:`adahop.Plan` or a ``plan.json`` path. calib_steps: override the calibration length.
        accelerator: the ``accelerate.Accelerator`` of the loop.

    Returns:
        The :class:`AdaHOPState` registered for checkpointing.

    Raises:
        ImportError: accelerate is not installed (install ``adahop[hf]``).
        ValueError: as :func:`adahop.convert_model`; a model converted with another recipe or without the
            ``plan``/``calib_steps`` given here; a model already given a step hook (a second call counted every
            step twice).
    """
    try:
        import accelerate  # noqa: F401
    except ImportError as e:
        raise missing_extra("accelerate", "hf", "adahop.integrations.accelerate") from e
    recipe = resolve_recipe(recipe, calib_steps)
    if getattr(model, "_adahop_controller", None) is None:
        convert_model(model, recipe, exclude=exclude, module_filter_fn=module_filter_fn, seed=process_seed(seed),
                      plan=resolve_plan(plan), backend=backend)
    else:
        check_converted(model, recipe, resolve_plan(plan), calib_steps, f"prepare_adahop({recipe.name!r})")
    from ..train.distributed import agree_on_plan

    agree_on_plan(model)

    def on_freeze(m):
        if accelerator is None or not accelerator.is_main_process:
            return
        p = get_controller(m).plan
        accelerator.log({f"adahop/{k}": v for k, v in strategy_counts(m).items()}, step=get_controller(m).step)
        if accelerator.project_dir:
            Path(accelerator.project_dir).mkdir(parents=True, exist_ok=True)
            p.save(Path(accelerator.project_dir) / "plan.json")

    register_step_hook(model, getattr(optimizer, "optimizer", optimizer), on_freeze=on_freeze)
    packed = sorted({p.fmt for p in model.parameters() if isinstance(p, PackedMaster)})
    if accelerator is not None and packed:  # accelerate's savers fail on the subclass, deep inside, with no hint
        warnings.warn(f"prepare_adahop: the model holds packed {'/'.join(packed)} master weights, which "
                      "accelerator.save_state cannot store (nor save_pretrained or torch.load read back); use BF16 "
                      "masters (convert_master_weights(model, 'bf16')) where the loop checkpoints", stacklevel=2)
    state = AdaHOPState(model)
    if accelerator is not None:
        accelerator.register_for_checkpointing(state)
    return state
