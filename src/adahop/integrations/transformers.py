"""AdaHOP in the Hugging Face ``Trainer``: one callback converts, calls the step hook, logs the
plan, and keeps it in every checkpoint.

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.add_callback(AdaHOPCallback("adahop-lv2", trainer=trainer))
    trainer.train()                                   # trainer.train(resume_from_checkpoint=True) keeps the plan
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

from . import check_converted, missing_extra, process_seed, resolve_plan, resolve_recipe

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as e:  # transformers is a core dependency; a broken install still says what to do
    raise missing_extra("transformers", "hf", "adahop.integrations.transformers") from e

from ..nn.convert import (PLAN_COLUMNS, controller_state, convert_model, describe, get_controller, load_controller_state,
                          on_step, plan_rows, strategy_counts)

__all__ = ["AdaHOPCallback"]

log = logging.getLogger(__name__)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every AdaHOPCallback: a restored one finds the one it replaced


class AdaHOPCallback(TrainerCallback, ExportableState):
    """Run ``recipe`` in a ``transformers.Trainer``.

    - **train begin**: converts the model with :func:`adahop.convert_model` (``exclude``,
      ``module_filter_fn``, ``seed``, ``plan``, ``backend`` as there), unless it is converted already;
      under ``torchrun`` every rank then freezes one plan (votes pooled across ranks).
    - **after each optimizer step** (``on_step_end``, so gradient-accumulation micro-steps do not
      count): :func:`adahop.on_step` with the Trainer's ``global_step``.
    - **at the freeze**: writes ``<output_dir>/plan.json``, logs :func:`adahop.describe` to the Python
      logger, and, when ``trainer`` is given, the strategy counts as scalars through ``trainer.log``
      (every ``report_to`` logger) and the plan as a table to TensorBoard (text) and W&B (a Table).
      A callback cannot reach the Trainer's loggers without ``trainer``: pass it to log there.
    - **each checkpoint**: ``checkpoint-N/plan.json``, and the controller state (plan or the
      calibration votes so far, step counter) in ``trainer_state.json`` (``stateful_callbacks``).
    - **resume** (``trainer.train(resume_from_checkpoint=...)``): that state is restored, so a frozen
      plan is kept and calibration does not run again; a run stopped mid-calibration continues its vote.

    Args:
        recipe: a preset name (``adahop recipes``) or a :class:`adahop.Recipe`.
        exclude, module_filter_fn, seed, backend: as in :func:`adahop.convert_model`.
        plan: a frozen :class:`adahop.Plan` or the path of a ``plan.json``: calibration is skipped.
        calib_steps: override the recipe's calibration length (30 optimizer steps for AdaHOP).
        trainer: the ``Trainer``, to log the plan through its loggers.

    Raises:
        ValueError: (at train begin) the model is already converted with another recipe, or without the
            ``plan`` or ``calib_steps`` given here (they would be ignored); a resumed checkpoint saved under
            another recipe, or one without AdaHOP state past the calibration window; a saved plan made for
            another model; bad arguments as :func:`adahop.convert_model` raises them.
    """

    def __init__(self, recipe="adahop-lv2", *, exclude=("lm_head",), module_filter_fn=None, seed: int = 0, plan=None,
                 calib_steps: int | None = None, backend: str = "auto", trainer=None):
        self.recipe = resolve_recipe(recipe, calib_steps)
        self.plan = resolve_plan(plan)
        self.exclude, self.module_filter_fn, self.seed, self.backend = exclude, module_filter_fn, seed, backend
        self.calib_steps, self.trainer = calib_steps, trainer
        self.adahop_state = None  # set by the Trainer when it restores callbacks itself (restore_callback_states_from_checkpoint)
        self.model = None
        _LIVE.add(self)

    def _inherit_from_replaced(self) -> None:
        """With ``restore_callback_states_from_checkpoint`` the Trainer replaces this callback by one built from
        :meth:`state`'s JSON ``args``, which cannot hold ``trainer``, ``module_filter_fn`` or ``plan``: the
        replacement then logged no strategy counts and converted without the filter. It takes them back from
        the callback it replaced (the one whose Trainer now holds it)."""
        if self.trainer is not None:
            return
        for old in list(_LIVE):
            if old is not self and old.trainer is not None and any(
                    cb is self for cb in old.trainer.callback_handler.callbacks):
                self.trainer = old.trainer
                self.module_filter_fn = self.module_filter_fn or old.module_filter_fn
                self.plan = self.plan if self.plan is not None else old.plan
                return

    # ---- ExportableState: what trainer_state.json keeps of this callback ----------------------------
    def state(self) -> dict:
        return {"args": {"recipe": self.recipe.name, "exclude": list(self.exclude or ()), "seed": self.seed,
                         "calib_steps": self.calib_steps, "backend": self.backend},
                "attributes": {"adahop_state": controller_state(self.model) if self.model is not None else None}}

    # ---- events ------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._inherit_from_replaced()
        if getattr(model, "_adahop_controller", None) is None:
            convert_model(model, self.recipe, exclude=self.exclude, module_filter_fn=self.module_filter_fn,
                          seed=process_seed(self.seed),
                          plan=self.plan, backend=self.backend)
        else:
            check_converted(model, self.recipe, self.plan, self.calib_steps, f"AdaHOPCallback({self.recipe.name!r})")
        self.model = model
        from ..train.distributed import agree_on_plan

        agree_on_plan(model)  # under torchrun: every rank votes on everyone's observations
        if state.global_step > 0:  # a resume: the Trainer has just loaded trainer_state.json
            saved = self.adahop_state or _saved_state(state, type(self).__name__)
            if saved is None:  # the step counter (stochastic-rounding streams, the vote's steps) at least goes on
                saved, ctrl = {"step": state.global_step}, get_controller(model)
                if ctrl.calibrating:
                    _resume_without_votes(state.global_step, ctrl.recipe.calibration.steps)
            load_controller_state(model, saved)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if on_step(self.model, state.global_step):
            # trainer.log (in _report) ends with the Trainer's on_log, which clears should_log: the step's own
            # loss, which the Trainer logs after this event, would then be dropped and averaged into the next
            keep = control.should_log
            self._report(args, state)
            control.should_log = keep

    def on_save(self, args, state, control, **kwargs):
        if self.model is None:
            return
        ctrl = get_controller(self.model)
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if ctrl.plan is not None and state.is_world_process_zero and folder.is_dir():
            ctrl.plan.save(folder / "plan.json")
        if ctrl.calibrator is not None and args.world_size > 1:
            # trainer_state.json (written by rank 0 before this event, which every rank runs) holds rank 0's votes
            # alone, and a resume gave them to every rank: it gets every rank's
            from ..train.distributed import controller_state_all_ranks

            every = controller_state_all_ranks(self.model)  # collective
            if state.is_world_process_zero and (folder / "trainer_state.json").is_file():
                _keep_state(folder / "trainer_state.json", type(self).__name__, every)

    # ---- the freeze --------------------------------------------------------------------------------
    def _report(self, args, state) -> None:
        plan = get_controller(self.model).plan
        if not state.is_world_process_zero:
            return
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        plan.save(Path(args.output_dir) / "plan.json")
        log.info("adahop: plan frozen at step %d\n%s", state.global_step, describe(self.model))
        if self.trainer is None:
            return
        self.trainer.log({f"adahop/{k}": float(v) for k, v in strategy_counts(self.model).items()})  # what runs
        rows = plan_rows(plan)
        for cb in self.trainer.callback_handler.callbacks:
            name = type(cb).__name__
            if name == "TensorBoardCallback" and getattr(cb, "tb_writer", None) is not None:
                cb.tb_writer.add_text("adahop/plan", _markdown(rows), state.global_step)
            elif name == "WandbCallback" and getattr(cb, "_initialized", False):
                cb._wandb.log({"adahop/plan": cb._wandb.Table(columns=list(PLAN_COLUMNS), data=rows)})


def _resume_without_votes(step: int, calib_steps: int) -> None:
    """A resume from a checkpoint that holds no AdaHOP state (written without this callback): calibration
    votes over optimizer steps 1 … calib_steps, so only what is left of that window can be observed."""
    if step >= calib_steps:
        raise ValueError(f"AdaHOPCallback: resumed at step {step} from a checkpoint without AdaHOP state, past the "
                         f"calibration window (steps 1-{calib_steps}), so no plan can be calibrated; pass plan= (a "
                         "plan.json of a run or of `adahop analyze`), or train from step 0 with the callback")
    log.warning("adahop: resumed at step %d from a checkpoint without AdaHOP state; the plan is voted over steps %d-%d "
                "only (plan.json records that window)", step, step + 1, calib_steps)


def _keep_state(path: Path, name: str, adahop_state: dict) -> None:
    """Write ``adahop_state`` as the first ``name`` callback's in the trainer_state.json at ``path``."""
    import json

    ts = json.loads(path.read_text())
    entry = ts.get("stateful_callbacks", {}).get(name)
    first = entry[0] if isinstance(entry, list) and entry else entry
    if isinstance(first, dict):
        first.setdefault("attributes", {})["adahop_state"] = adahop_state
        from ..utils import atomic_write_text

        atomic_write_text(path, json.dumps(ts, indent=2, sort_keys=True) + "\n")


def _saved_state(state, name: str):
    saved = state.stateful_callbacks.get(name)
    if isinstance(saved, list):  # several callbacks of this class: the first is ours
        saved = saved[0] if saved else None
    return (saved or {}).get("attributes", {}).get("adahop_state")


def _markdown(rows: list[list[str]]) -> str:
    head = "| " + " | ".join(PLAN_COLUMNS) + " |\n|" + "---|" * len(PLAN_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(r) + " |\n" for r in rows)
