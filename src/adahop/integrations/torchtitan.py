"""AdaHOP as a torchtitan model converter (torchtitan 0.3.0, the version on PyPI).

torchtitan 0.3.0 converts the model *config* before the model is built (``ModelConfigConverter``),
and runs post-optimizer work through ``ModelSpec.post_optimizer_build_fn``, which registers hooks on
the ``OptimizersContainer``. So a config names AdaHOP in two places, both set by
:func:`with_adahop`:

    config = llama3_debugmodel()                                   # any torchtitan Trainer.Config
    config.model_spec = with_adahop(config.model_spec, AdaHOPConverter.Config(recipe="adahop-lv2"))

or, by torchtitan's converter list plus the hook:

    spec = model_registry("debugmodel", converters=[AdaHOPConverter.Config(recipe="adahop-lv2")])
    spec.post_optimizer_build_fn = adahop_post_optimizer_build_fn

``torchtitan.train --module adahop.integrations.torchtitan --config llama3_debugmodel_adahop`` runs the
first on torchtitan's Llama 3 debug model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from . import missing_extra, process_seed, resolve_plan, resolve_recipe

try:
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.models.common.linear import Linear
    from torchtitan.protocols.module import Module
    from torchtitan.tools.logging import logger
except ImportError as e:
    raise missing_extra("torchtitan", "torchtitan", "adahop.integrations.torchtitan") from e

from ..nn.convert import _excluded, convert_layers, describe, get_controller, register_step_hook, warn_unmatched_excludes
from ..nn.linear import LowPrecisionLinear

__all__ = ["AdaHOPConverter", "AdaHOPLinear", "with_adahop", "adahop_post_optimizer_build_fn", "llama3_debugmodel_adahop"]


class AdaHOPLinear(LowPrecisionLinear, Module):
    """:class:`adahop.LowPrecisionLinear` that also satisfies torchtitan's ``Module`` protocol: it keeps
    the converted ``Linear``'s ``param_init`` (``init_states`` initializes it the same way) and its
    ``sharding_config``."""

    @classmethod
    def from_linear(cls, mod, recipe, **kw):
        new = super().from_linear(mod, recipe, **kw)
        new._param_init, new._sharding_config = mod._param_init, mod._sharding_config
        return new


class AdaHOPConverter(QuantizationConverter):
    """Convert every torchtitan ``Linear`` of the model (but ``exclude``) to :class:`AdaHOPLinear`
    under one AdaHOP controller, right after the model is built (on the meta device, before
    parallelization and weight init). The root model config is replaced by a subclass of its own
    class that carries this converter's config and converts in ``__init__``; the model class, its
    fields and its state-dict keys are unchanged."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "adahop-lv2"
        """Recipe preset (``adahop recipes`` lists them)."""
        exclude: list[str] = field(default_factory=lambda: ["lm_head"])
        """fnmatch patterns (or name suffixes) of linears kept as they are, as in ``adahop.convert_model``."""
        fqns: list[str] = field(default_factory=list)
        """Convert only linears whose qualified name contains one of these (torchtitan's MX converter rule); empty: all."""
        calib_steps: int | None = None
        """Override the recipe's AdaHOP calibration length (30 optimizer steps)."""
        plan: str | None = None
        """A plan.json: use that frozen plan and skip calibration (e.g. to resume a run past its freeze)."""
        plan_out: str | None = None
        """Where rank 0 writes the plan when it freezes (None: not written)."""
        seed: int = 0
        """Seed of the stochastic-rounding and random-sign streams."""
        backend: str = "auto"
        """Kernel backend: auto (fast path on CUDA), triton or reference."""

    def __init__(self, config: Config):
        self.config = config
        resolve_recipe(config.recipe, config.calib_steps)  # an unknown recipe fails at config time, not at build
        resolve_plan(config.plan)

    def convert(self, model_config):
        base = type(model_config)._owner
        if getattr(base, "_adahop_wrapped", False):
            raise ValueError("AdaHOPConverter is listed twice in the converters; list it once")
        cls = _adahop_model_cls(base)
        kept = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config) if f.init}
        return cls.Config(**kept, adahop=self.config)


_CLASSES: dict[type, type] = {}


def _adahop_model_cls(base: type) -> type:
    """A subclass of the model class ``base`` whose Config gains an ``adahop`` field and whose
    ``__init__`` converts the built model (cached per base, as torchtitan's MXFP8 experts are)."""
    if base in _CLASSES:
        return _CLASSES[base]

    class AdaHOPModel(base):
        _adahop_wrapped = True

        @dataclass(kw_only=True, slots=True)
        class Config(base.Config):
            adahop: AdaHOPConverter.Config = field(default_factory=AdaHOPConverter.Config)

        def __init__(self, config):
            super().__init__(config)
            _convert(self, config.adahop)

    AdaHOPModel.__name__ = AdaHOPModel.__qualname__ = f"AdaHOP{base.__name__}"
    _CLASSES[base] = AdaHOPModel
    return AdaHOPModel


def _convert(model, cfg: AdaHOPConverter.Config) -> None:
    warn_unmatched_excludes(model, cfg.exclude, stacklevel=3)  # under pipeline parallelism: of this stage's part
    # exactly torchtitan's Linear: subclasses (ScaledBiasRowwiseLinear) compute something else in forward
    names = [n for n, m in model.named_modules() if type(m) is Linear and not _excluded(n, cfg.exclude)
             and (not cfg.fqns or any(f in n for f in cfg.fqns))]
    recipe = resolve_recipe(cfg.recipe, cfg.calib_steps)
    if not names and not recipe.is_bf16:
        raise ValueError(f"AdaHOPConverter: no torchtitan Linear left to convert (exclude={cfg.exclude}, fqns={cfg.fqns})")
    convert_layers(model, recipe, names, layer_cls=AdaHOPLinear, seed=process_seed(cfg.seed), plan=resolve_plan(cfg.plan),
                   backend=cfg.backend)
    model._adahop_config = cfg
    logger.info(f"adahop: {len(names)} Linear layers run recipe {recipe.name}")


def adahop_post_optimizer_build_fn(optimizers, model_parts, parallel_dims, *, then=None) -> None:
    """torchtitan's ``post_optimizer_build_fn``: hook :func:`adahop.on_step` onto the
    ``OptimizersContainer``'s post-step hook for every converted model part, so the plan freezes
    right after the optimizer step that ends calibration (votes pooled across ranks), and at the
    freeze log the plan and write ``plan_out``. ``then``: the model's own function, run first."""
    if then is not None:
        then(optimizers, model_parts, parallel_dims)
    from ..train.distributed import agree_on_plan

    for part in model_parts:
        if getattr(part, "_adahop_controller", None) is None:
            continue
        agree_on_plan(part)
        register_step_hook(part, optimizers, on_freeze=_on_freeze)


def _on_freeze(model) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    logger.info(f"adahop: plan frozen at step {get_controller(model).step}\n{describe(model)}")
    out = model._adahop_config.plan_out
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        get_controller(model).plan.save(out)


def with_adahop(model_spec, converter: AdaHOPConverter.Config):
    """``model_spec`` (a torchtitan ``ModelSpec``) with its model config converted by ``converter`` and
    its ``post_optimizer_build_fn`` running the AdaHOP step hook after the one it had. Returns it."""
    import functools

    model_spec.model = converter.build().convert(model_spec.model)
    model_spec.post_optimizer_build_fn = functools.partial(adahop_post_optimizer_build_fn,
                                                           then=model_spec.post_optimizer_build_fn)
    return model_spec


def llama3_debugmodel_adahop():
    """torchtitan's ``llama3_debugmodel`` trainer config under adahop-lv2, the plan written to
    ``<dump_folder>/plan.json``."""
    from torchtitan.models.llama3 import config_registry

    config = config_registry.llama3_debugmodel()
    config.model_spec = with_adahop(config.model_spec, AdaHOPConverter.Config(
        recipe="adahop-lv2", plan_out=str(Path(config.dump_folder) / "plan.json")))
    return config
