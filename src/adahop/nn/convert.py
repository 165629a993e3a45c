"""One-call conversion of a model's `nn.Linear` layers, the step hook, and `describe`."""

from __future__ import annotations

import fnmatch
import json
import numbers
import os
import re
import warnings

import torch
from torch import nn

from ..patterns import Plan
from ..recipes import GEMMS, Recipe, get_recipe
from ..utils import mix_seed
from .linear import Controller, LowPrecisionLinear, check_plan_shapes, plan_for_another_model
from .recompute import is_recomputed, mark_blocks

__all__ = ["convert_model", "convert_layers", "on_step", "get_controller", "describe", "saved_bytes", "seed_compiled_rng",
           "supports_shape", "controller_state", "load_controller_state", "register_step_hook", "plan_rows", "strategy_counts",
           "small_gemm_count"]

_BLOCK_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


# The layer dimension each outer Hadamard runs along (T, the tokens, is only known at run time).
_OUTER_DIMS = {("fprop", "outer_b"): "N", ("dgrad", "outer_b"): "K", ("wgrad", "outer_b"): "K", ("wgrad", "outer_a"): "N"}


def _outer_need(recipe: Recipe) -> str:
    """What a recipe with whole-dimension outer Hadamards (HALO-1/2) also needs of the layer dims, for a message."""
    dims = sorted({d for (g, side), d in _OUTER_DIMS.items() if getattr(recipe.gemm(g), side) is not None})
    names = " and ".join({"K": "in_features", "N": "out_features"}[d] for d in dims)
    return f", {names} a power of two (the recipe rotates it whole)," if dims else ""


def supports_shape(recipe: Recipe, in_features: int, out_features: int) -> bool:
    """Whether ``recipe`` quantizes a layer of this shape: K and N must be whole blocks (32 for
    MXFP4, 16 for NVFP4), as the hardware GEMMs and the FP8 fast path need, and every outer
    Hadamard (HALO) must fit the dimension it rotates (a power of two for a whole-dim one)."""
    block = 16 if any(recipe.gemm(g).a.fmt == "nvfp4" for g in ("fprop", "dgrad", "wgrad")) else 32
    if in_features % block or out_features % block:
        return False
    dims = {"K": in_features, "N": out_features}
    for (g, side), d in _OUTER_DIMS.items():
        tr = getattr(recipe.gemm(g), side)
        if tr is not None:
            n = dims[d]
            b = tr.block_size or n
            if b & (b - 1) or n % b:
                return False
    return True


def convert_model(model: nn.Module, recipe: str | Recipe, *, exclude=("lm_head",), module_filter_fn=None, seed: int = 0,
                  plan: Plan | None = None, calib_steps: int | None = None, backend: str = "auto") -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`LowPrecisionLinear` running ``recipe``.

    Args:
        model: any module built of ``nn.Linear`` (Hugging Face Llama/Qwen3, ``nn.Sequential``...).
        recipe: a preset name (see :func:`adahop.list_recipes`) or a :class:`Recipe`.
        exclude: fnmatch patterns of qualified names to keep as they are; a pattern without
            wildcards also matches as a name suffix (``"lm_head"`` matches ``"model.lm_head"``); a pattern
            that matches a module keeps every linear inside it (``"model.layers.0"``: that block, ``"mlp"``:
            every MLP); None or ``()`` excludes nothing.
        module_filter_fn: torchao's filter, ``(module, fqn) -> bool``, called for each ``nn.Linear``
            that ``exclude`` keeps: a layer converts only when it returns True (so a filter written
            for ``torchao.float8.convert_to_float8_training`` works unchanged). None converts all.
        seed: run seed for stochastic rounding and random signs.
        plan: a frozen AdaHOP plan, or the path of its ``plan.json`` (from a run, a checkpoint or
            ``adahop analyze``): calibration is skipped. AdaHOP recipes only.
        calib_steps: training steps the AdaHOP recipe calibrates over before it freezes its plan (None:
            the recipe's own, 30 for the presets), as ``adahop train --calib-steps`` and the integrations'
            ``calib_steps``. AdaHOP recipes only.
        backend: ``"auto"`` (the fast path on CUDA, the reference elsewhere, decided per call from
            the input's device, so converting before or after ``.to("cuda")`` is the same),
            ``"triton"`` or ``"reference"``. It never changes the recipe's numerics.

    Returns:
        ``model``, modified in place. The original Parameters are kept. Layers whose shape the
        recipe cannot quantize stay BF16 GEMMs (one warning lists them); so do the linears of
        the last ``recipe.bf16_last_layers`` / first ``bf16_first_layers`` transformer blocks.

    Raises:
        ValueError: unknown recipe name (lists the known ones) or backend, a ``plan`` or ``calib_steps`` under a
            recipe without calibration, ``calib_steps`` < 1 or given with ``plan``, a plan path that does not exist, a model already converted, a
            bare ``nn.Linear`` (wrap it in ``nn.Sequential``), a model with no ``nn.Linear`` left to
            convert (e.g. GPT-2's ``Conv1D`` layers) or none whose shape it can quantize under a quantizing
            recipe, or a ``plan`` without an entry for a converted layer.
        TypeError: ``recipe`` is neither a name nor a Recipe, ``seed`` is not an int, or ``module_filter_fn``
            is not callable or returns something other than a bool.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a preset name (adahop.list_recipes()) or an adahop.Recipe, got {type(recipe).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if isinstance(plan, (str, os.PathLike)):  # a plan.json path, as the integrations take it
        if not os.path.isfile(plan):
            raise ValueError(f"plan {plan}: no such file; pass a plan.json written by adahop (a run, a checkpoint, analyze)")
        plan = Plan.load(plan)
    if plan is not None and recipe.calibration is None:
        raise ValueError(f"plan= is for AdaHOP recipes; recipe {recipe.name!r} has fixed strategies and would ignore it: "
                         "drop plan=, or use an adahop-* recipe")
    if calib_steps is not None:
        if plan is not None:
            raise ValueError("calib_steps= with plan=: a frozen plan skips calibration, so the steps would be unused; "
                             "drop one of them")
        recipe = recipe.with_calibration_steps(calib_steps)
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"module_filter_fn must be a callable (module, fqn) -> bool, got {type(module_filter_fn).__name__}")
    if getattr(model, "_adahop_controller", None) is not None:
        raise ValueError("this model is already converted; convert a fresh model")
    if type(model) is nn.Linear:
        raise ValueError("convert_model swaps the nn.Linear layers *inside* a module and cannot replace the module "
                         "it is given; wrap a bare layer first: convert_model(nn.Sequential(linear), ...)")
    if exclude is None:
        exclude = ()
    if any(isinstance(m, LowPrecisionLinear) for m in model.modules()):
        raise ValueError("this module already holds converted layers (a part of a converted model?); convert the "
                         "whole model once, from a fresh copy")
    warn_unmatched_excludes(model, exclude, stacklevel=3)
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and not _excluded(n, exclude)
             and _kept_by(module_filter_fn, m, n)]
    if not names and not recipe.is_bf16:  # nothing would run the recipe: the "MXFP4" run would be BF16
        conv1d = sum(type(m).__name__ == "Conv1D" for m in model.modules())
        subs = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear]
        if conv1d:
            why = (f"its {conv1d} linear maps are transformers Conv1D modules (GPT-2 style, weight stored [in, out]), "
                   "which adahop does not convert; use a model built of nn.Linear (Llama, Qwen, GPT-NeoX, ...)")
        elif subs:  # subclasses may do more in forward: converted only by name
            why = (f"its {len(subs)} linear layers are subclasses of nn.Linear ({type(model.get_submodule(subs[0])).__name__}"
                   f" {subs[0]}, ...), which convert_model leaves alone; convert them by name with "
                   f"adahop.nn.convert.convert_layers(model, adahop.get_recipe({recipe.name!r}), names)")
        else:
            why = f"exclude={tuple(exclude)!r}" + (" and module_filter_fn" if module_filter_fn else "") + " leave none, or it has none"
        raise ValueError(f"convert_model: the model has no nn.Linear layer to run recipe {recipe.name!r}: {why}")
    return convert_layers(model, recipe, names, seed=seed, plan=plan, backend=backend)


def warn_unmatched_excludes(model: nn.Module, exclude, *, stacklevel: int = 2) -> None:
    """Warn of each ``exclude`` pattern (a string or several) that matches no module of ``model``: a typo
    would convert what it meant to keep. ``"lm_head"``, the default, is not checked (models name it otherwise)."""
    names = [n for n, _ in model.named_modules()]
    for p in (exclude,) if isinstance(exclude, str) else exclude:
        if p != "lm_head" and not any(_excluded(n, (p,)) for n in names):
            warnings.warn(f"adahop: exclude pattern {p!r} matches no module of the model, so it keeps nothing out of the "
                          f"conversion; patterns match qualified names (e.g. 'lm_head', 'model.layers.0.*')",
                          stacklevel=stacklevel + 1)


def convert_layers(model: nn.Module, recipe: Recipe, names: list[str], *, layer_cls=LowPrecisionLinear, seed: int = 0,
                   plan: Plan | None = None, backend: str = "auto") -> nn.Module:
    """The swap behind :func:`convert_model`, for integrations whose linears are subclasses of
    ``nn.Linear`` (torchtitan's): replace the ``nn.Linear`` modules named ``names`` (qualified names,
    in model order) by ``layer_cls.from_linear(...)`` under one shared :class:`Controller`, with the
    same BF16 edge layers, shape check and warning as :func:`convert_model`. Returns ``model``.

    Raises:
        ValueError: a quantizing recipe that none of the layers can run (their shapes, or all in the recipe's
            BF16 blocks), a ``plan`` without an entry for a converted layer, or ``ADAHOP_GEMM_ACCUMULATION``
            set (the recipe holds the accumulation now)."""
    if "ADAHOP_GEMM_ACCUMULATION" in os.environ:  # once read at import: the numbers must not follow the environment
        raise ValueError("ADAHOP_GEMM_ACCUMULATION is no longer read: the FP8 fast path's accumulation is part of the "
                         "recipe; unset it and convert with recipe.with_accumulation('fp32') (GemmSpec.accumulation)")
    controller = Controller(recipe, seed=seed, plan=plan)
    blocks = sorted({int(m.group(1)) for n in names if (m := _BLOCK_RE.search(n))})
    n_blocks = (max(blocks) + 1) if blocks else 0
    edges = (recipe.bf16_first_layers, recipe.bf16_last_layers)
    if len(names) > 1 and not blocks and any(edges) and not recipe.is_bf16:  # one layer: no block to keep
        # the recipe's BF16 edge blocks are found by the block index in the names: without one, none is kept
        warnings.warn(f"adahop: recipe {recipe.name!r} keeps its first {edges[0]} and last {edges[1]} transformer "
                      f"blocks in BF16, but no converted layer's name holds a block index ('layers.N.', 'h.N.', "
                      f"'blocks.N.' or 'layer.N.'; e.g. {names[0]!r}), so every layer runs the recipe. Keep those "
                      f"blocks out with exclude= (e.g. exclude=('lm_head', 'decoder.block.11')), or convert with "
                      f"dataclasses.replace(recipe, bf16_first_layers=0, bf16_last_layers=0) to say none is meant",
                      stacklevel=3)
    unsupported: dict[str, str] = {}  # name -> in->out, of layers the recipe cannot quantize
    todo = []  # (name, owner, child, linear, edge, fits), decided before any layer is swapped
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lin = getattr(owner, child)
        m = _BLOCK_RE.search(name)
        blk = int(m.group(1)) if m else None
        edge = blk is not None and (blk < recipe.bf16_first_layers or blk >= n_blocks - recipe.bf16_last_layers)
        fits = supports_shape(recipe, lin.in_features, lin.out_features)
        if not fits and not recipe.is_bf16:
            unsupported[name] = f"{lin.in_features}->{lin.out_features}"
        todo.append((name, owner, child, lin, edge, fits))
    if unsupported:
        warnings.warn(f"adahop: recipe {recipe.name!r} cannot quantize these layers (dimensions not multiples of the "
                      f"block size, or not a power of two where the recipe rotates a whole dimension); they run BF16 "
                      f"GEMMs: {', '.join(f'{n} ({io})' for n, io in unsupported.items())}", stacklevel=3)
    if todo and not recipe.is_bf16 and all(edge or not fits for *_, edge, fits in todo):
        why = [f"{n}: " + (f"shape {unsupported[n]}" if n in unsupported else "in a BF16 block of the recipe") for n, *_ in todo]
        raise ValueError(f"recipe {recipe.name}: none of the model's {len(todo)} linear layers can run it "
                         f"({'; '.join(why[:4])}{'; ...' if len(why) > 4 else ''}): every GEMM would be BF16's, and the "
                         f"model would pass for a {recipe.name} one. Use a model whose layer dims are multiples of the "
                         f"recipe's block size (32, or 16 for NVFP4){_outer_need(recipe)} with more blocks than the recipe "
                         f"keeps in BF16, or the bf16 recipe")
    small = [recipe.small_bf16_gemms(lin.in_features, lin.out_features) for _, _, _, lin, *_ in todo]
    if todo and not recipe.is_bf16 and all(edge or not fits or len(sm) == len(GEMMS)
                                           for (*_, edge, fits), sm in zip(todo, small)):
        # a speed rule the user chose, so not refused as above; but the model would pass for a recipe one
        warnings.warn(f"adahop: recipe {recipe.name!r} with bf16_small_gemms={recipe.bf16_small_gemms}: every GEMM of "
                      f"the model's {len(todo)} linear layers is too small for the rule and runs BF16, so the model trains "
                      f"as BF16. Lower the rule's min_kn/min_outer, or drop it (recipe.with_small_gemms_bf16(None))",
                      stacklevel=3)
    if controller.plan is not None and recipe.calibration is not None:
        check_plan_shapes(controller.plan, [(n, lin.in_features, lin.out_features) for n, _, _, lin, edge, fits in todo
                                            if fits and not edge])
    # every place a converted linear is held: one reachable under two names (a weight-shared block) kept its exact
    # nn.Linear at the second (named_modules lists a module once)
    places = {id(lin): [] for _, _, _, lin, *_ in todo}
    for mod in model.modules():
        for cname, c in mod._modules.items():
            if id(c) in places:
                places[id(c)].append((mod, cname))
    for layer_id, (name, owner, child, lin, edge, fits) in enumerate(todo):
        try:
            new = layer_cls.from_linear(lin, recipe, name=name, layer_id=layer_id, controller=controller,
                                                 backend=_layer_backend(backend, lin.weight.device), force_bf16=edge or not fits)
        except KeyError:  # a plan made for another model: say so before anything runs
            raise plan_for_another_model(name, controller.plan) from None
        for mod, cname in places[id(lin)] or [(owner, child)]:
            setattr(mod, cname, new)
    _warn_fused_weights(model, recipe, todo)
    controller.unquantizable = list(unsupported)  # reported by the run summary
    model._adahop_controller = controller
    if is_recomputed(model):  # selective_recompute came first: the new layers inside its blocks save X by reference too
        mark_blocks(model)
    return model


def _warn_fused_weights(model: nn.Module, recipe: Recipe, todo: list) -> None:
    """Warn when weights of 3 or more dimensions (a mixture of experts' fused expert tensors, as transformers
    5 stores Qwen3-MoE and Mixtral experts; convolutions) or of transformers ``Conv1D`` modules (GPT-2's linear
    maps, weight [in, out]) hold part of the model's matrix weights: they are no nn.Linear, so their GEMMs stay
    as they are while the model passes for a ``recipe`` one (a GPT-2 converted with ``exclude=()`` ran its
    lm_head alone in the recipe, silently)."""
    if recipe.is_bf16:
        return
    fused = [(n, p.numel()) for n, p in model.named_parameters() if p.ndim >= 3]
    conv1d = [(f"{n}.weight", m.weight.numel()) for n, m in model.named_modules()
              if type(m).__name__ == "Conv1D" and isinstance(getattr(m, "weight", None), torch.Tensor)]
    if not fused and not conv1d:
        return
    kept = fused + conv1d
    in_fused = sum(k for _, k in kept)
    share = in_fused / (in_fused + sum(lin.weight.numel() for _, _, _, lin, *_ in todo))
    what = " and ".join(w for w, on in (("weights of 3 or more dimensions", fused),
                                         ("transformers Conv1D weights (GPT-2 style)", conv1d)) if on)
    warnings.warn(f"adahop: {len(kept)} {what} are not nn.Linear layers and keep their own "
                  f"GEMMs ({', '.join(n for n, _ in kept[:3])}{', ...' if len(kept) > 3 else ''}: e.g. a mixture of "
                  f"experts' fused experts, GPT-2's attention and MLP): {share:.0%} of the matrix weights outside the "
                  f"embeddings run unconverted, not in {recipe.name!r}", stacklevel=4)


def _layer_backend(backend: str, device: torch.device) -> str:
    """The layer's backend: "auto" stays "auto" (resolved per call from the input's device, so a model
    converted on the CPU and moved to a GPU takes the fast path there); "triton" and "reference" are
    checked now, so that a backend this machine cannot run fails at conversion."""
    from ..kernels import resolve_backend

    resolved = resolve_backend(backend, device)  # checks every value, "auto" included
    return "auto" if backend == "auto" else resolved


def _kept_by(module_filter_fn, module: nn.Module, fqn: str) -> bool:
    if module_filter_fn is None:
        return True
    keep = module_filter_fn(module, fqn)
    if not isinstance(keep, bool):  # a filter returning e.g. None would silently convert nothing
        raise TypeError(f"module_filter_fn({type(module).__name__}, {fqn!r}) returned {keep!r}; it must return True "
                        "(convert the layer) or False (keep it as it is)")
    return keep


def _excluded(name: str, patterns) -> bool:
    """Whether module ``name`` (a qualified name) is kept out by ``patterns`` (one or several): ``name``, or the
    name of a module holding it, matches one as an fnmatch pattern, or equals it or ends with ``"." + pattern``.
    So ``"model.layers.0"`` keeps that whole block and ``"mlp"`` every MLP's linears, as it keeps a linear of that
    name (a pattern that matched only a container kept nothing, silently: the block ran the recipe)."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    parts = name.split(".")
    scopes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]  # name itself, then each module holding it
    return any(fnmatch.fnmatchcase(n, p) or n == p or n.endswith("." + p) for p in patterns for n in scopes)


def get_controller(model: nn.Module) -> Controller:
    """The :class:`Controller` of a converted model, or of the converted model a wrapper holds as ``.module``
    (DistributedDataParallel, DataParallel, accelerate's and DeepSpeed's wrappers) or ``._orig_mod``
    (``torch.compile``). Raises ValueError if it is not converted."""
    c = getattr(model, "_adahop_controller", None)
    inner = model
    while c is None and isinstance(inner, nn.Module):  # a wrapper made after the conversion: its module's
        inner = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
        c = getattr(inner, "_adahop_controller", None)
    if c is None:
        raise ValueError("model is not converted; call adahop.convert_model(model, recipe) first")
    return c


def on_step(model: nn.Module, step: int) -> bool:
    """Tell the converted model that ``step`` optimizer steps are done (call after each
    ``optimizer.step()``). Freezes the AdaHOP plan at the end of calibration; returns True then."""
    return get_controller(model).on_step(step)


def controller_state(model: nn.Module) -> dict:
    """What a checkpoint must keep of a converted model beyond its weights, as plain JSON data:
    ``{"recipe": its name, "step": optimizer steps done, "plan": the frozen plan as a dict or None,
    "calibration_history": the patterns seen so far while calibrating, or None, "calibration_from": the
    steps done at the first of them, or None}``: this process's (under torch.distributed, a checkpoint
    written by one rank keeps every rank's votes with ``adahop.train.distributed.controller_state_all_ranks``).
    :func:`load_controller_state` restores it.

    Raises:
        ValueError: ``model`` is not converted."""
    ctrl = get_controller(model)
    cal = ctrl.calibrator
    return {"recipe": ctrl.recipe.name, "step": ctrl.step, "plan": json.loads(ctrl.plan.to_json()) if ctrl.plan else None,
            "calibration_history": cal.history if cal else None, "calibration_from": cal.first_step if cal else None}


def own_calibration_history(state: dict) -> dict:
    """This process's calibration votes in a saved state (``calibration_history``, optionally
    ``calibration_histories``: every rank's, as ``adahop.train.distributed.controller_state_all_ranks`` and sharded
    checkpoints save them). Under torch.distributed: its own rank's when the world size is the one that saved
    them; otherwise rank 0 takes ``calibration_history`` (all of them merged, or the one process's that saved
    it) and the other ranks none, so that the pooled vote counts each observation once (every rank took rank
    0's, and the vote counted them once per rank; helper 33). Raises KeyError: no ``calibration_history``."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    per_rank = state.get("calibration_histories")
    if per_rank is not None and len(per_rank) == world:
        return per_rank[rank]
    return state["calibration_history"] if rank == 0 else {}


def load_controller_state(model: nn.Module, state: dict) -> None:
    """Restore :func:`controller_state` output: a saved plan is adopted (calibration does not run
    again), a calibration in progress continues from its saved history, and the step counter
    (which seeds the stochastic-rounding streams and the compiled path's sign seed) continues
    from the saved step.

    Raises:
        ValueError: ``model`` is not converted, the state was saved under another recipe (states saved
            before the recipe was recorded are not checked), the plan was made for another model, or the
            calibration history has votes for layers the model does not convert (another exclude / filter)."""
    ctrl = get_controller(model)
    saved = state.get("recipe")
    if saved is not None and saved != ctrl.recipe.name:
        raise ValueError(f"the saved AdaHOP state is of recipe {saved!r}, but the model is converted with "
                         f"{ctrl.recipe.name!r}: resuming would mix the two in one run; resume with {saved!r}, "
                         f"or start a new run (another output folder) for {ctrl.recipe.name!r}")
    if state.get("plan"):
        ctrl.set_plan(Plan.from_dict(state["plan"]))
    elif state.get("calibration_history") is not None and ctrl.calibrator is not None:
        history = own_calibration_history(state)
        converted = {l.name for l in ctrl.layers if not l.force_bf16}
        foreign = sorted(set(history) - converted)
        if foreign:  # their votes would enter the plan (and its strategy counts) for layers this model does not run
            raise ValueError(f"the saved calibration history has votes for {len(foreign)} layer(s) this model does not "
                             f"convert ({foreign[0]!r} ...): the checkpoint was made with another exclude / "
                             "module_filter_fn; resume with the conversion it was made with, or start a new run")
        ctrl.calibrator.history = history
        ctrl.calibrator.first_step = state.get("calibration_from", 0)
    ctrl.step = int(state["step"])
    ctrl.seed_signs(ctrl.step)


def register_step_hook(model: nn.Module, optimizer: torch.optim.Optimizer, on_freeze=None):
    """Call :func:`on_step` after every ``optimizer.step()`` through the optimizer's own post-step hook,
    counting the steps from the model's step counter (restored by :func:`load_controller_state` on
    resume). A step the optimizer skips (a GradScaler's inf step, an accumulation micro-step under
    accelerate) runs no hook and is not counted. ``on_freeze(model)`` runs once the plan freezes.
    Returns the hook's handle (``.remove()`` detaches it).

    Raises:
        ValueError: ``model`` is not converted, or already has a step hook that is still attached."""
    ctrl = get_controller(model)
    prev = getattr(ctrl, "step_hook", None)  # absent from a controller pickled before it existed
    if prev is not None and prev.id in (prev.hooks_dict_ref() or {}):  # still attached to its optimizer
        raise ValueError("the model already has a step hook (prepare_adahop or register_step_hook was called on it "
                         "before): a second one would count every optimizer step twice and end calibration early; call it "
                         "once, or .remove() the first one's handle")

    def hook(_opt, _args, _kwargs):
        if ctrl.on_step(ctrl.step + 1) and on_freeze is not None:
            on_freeze(model)

    ctrl.step_hook = optimizer.register_step_post_hook(hook)
    return ctrl.step_hook


def seed_compiled_rng(model: nn.Module, step: int, micro: int = 0) -> None:
    """Seed the random draws of micro-batch ``micro`` of ``step`` of a ``torch.compile``d model.

    Compiled converted layers cannot create a ``torch.Generator`` per GEMM call as eager mode
    does (dynamo cannot trace one). Their stochastic-rounding bits come from PyTorch's default
    generator, and their per-call random Hadamard signs are hashed from the controller's
    ``sign_seed`` tensor (:func:`adahop.hadamard.hashed_signs`), a graph input: unlike a traced
    RNG op, a value the compiled backward recomputes from it is the forward's, so X and dY of a
    wgrad are rotated with the same signs (issue 24 §0). This sets both from (the model's seed,
    which ``adahop train`` makes per rank, ``step``, ``micro``): reproducible, resumable,
    different across ranks, steps and micro-batches. It reseeds the global RNG, so call it only
    for compiled runs of recipes that draw random bits (it does nothing for the others). The
    draws stay the unbiased stochastic rounding / random signs of `specs/baselines.md` §2; only
    their random stream differs from eager mode's.

    Args:
        model: a converted model. step: the optimizer step about to run (0-based).
        micro: the gradient-accumulation micro-batch within the step (0-based).

    Raises:
        ValueError: ``model`` is not converted.
    """
    ctrl = get_controller(model)
    if ctrl.recipe.draws_random_bits:
        parts = (ctrl.seed, step, "compiled") + ((micro,) if micro else ())  # micro 0: the seeds of earlier versions
        torch.manual_seed(mix_seed(*parts))
        ctrl.place_sign_seed(next((l.weight.device for l in ctrl.layers), ctrl.sign_seed.device))
        ctrl.seed_signs(step, micro)


def saved_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the converted linears saved for backward at the last forward, the bytes a plain
    ``nn.Linear`` in the same compute dtype saves: its input X, and under autocast its cast weight).
    Summed layer by layer on both sides: an input that layers share (q, k and v's X: one tensor without
    autocast, one copy under it since :mod:`adahop.nn.shared_cast`) counts once per layer; the memory a
    step holds is :mod:`adahop.bench.saved_census`'s."""
    ours = bf16 = 0
    for m in model.modules():
        if isinstance(m, LowPrecisionLinear):
            ours += m.saved_bytes
            bf16 += getattr(m, "hp_saved_bytes", 0)
    return ours, bf16


def _kib(ours: int, plain: int) -> str:
    return f"{ours / 1024:.0f} ({plain / 1024:.0f})"


def describe(model: nn.Module) -> str:
    """A text table: each converted layer, its shape, the pattern of X, W, ∇Y, the strategy of
    fprop, dgrad and wgrad, and the KiB it saved for backward at its last forward (in brackets:
    what a plain ``nn.Linear`` saves: X, and the cast W under autocast). The first line gives the recipe, the step,
    the calibration state and the fast path's accumulation (``Recipe.accumulations``: fp32 for NVFP4
    GEMMs, which always sum in FP32; a model off CUDA is said to run the FP32 reference); a GEMM that ``recipe.bf16_small_gemms`` runs in BF16 shows as
    ``bf16 (small)``, and a line counts them. Last, the recipe's own table (:func:`adahop.recipes.table.gemm_table`):
    each GEMM's operand formats, rounding, scales, transforms and mean split, which the per-layer columns do not show.
    A line counts the layers under selective activation recompute (:mod:`adahop.nn.recompute`)."""
    ctrl = get_controller(model)
    acc = ctrl.recipe.accumulations
    acc_text = acc["fprop"] if len(set(acc.values())) == 1 else ", ".join(f"{g} {a}" for g, a in acc.items())
    head = (f"{'layer':<44} {'K->N':>12} {'X':>2} {'W':>2} {'dY':>2}  {'fprop':<13} {'dgrad':<13} {'wgrad':<13} "
            f"{'saved KiB (plain)':>18}")
    state = "calibrating" if ctrl.calibrating else "plan frozen" if ctrl.plan else "fixed strategies"
    on_cuda = any(p.is_cuda for p in model.parameters())
    # the accumulation is the CUDA fast path's; elsewhere the reference sums in FP32 whatever the recipe says
    acc_text += "" if on_cuda else " (on CUDA; here the reference sums in FP32)"
    lines = [f"recipe {ctrl.recipe.name}, step {ctrl.step}, {state}, fast-path accumulation {acc_text}", head, "-" * len(head)]
    for m in ctrl.layers:
        p = m.patterns
        s = {g: "bf16 (small)" if g in getattr(m, "small_bf16", ()) else v for g, v in m.strategies().items()}
        lines.append(f"{m.name:<44} {f'{m.in_features}->{m.out_features}':>12} {p.get('x', '-'):>2} {p.get('w', '-'):>2} "
                     f"{p.get('dy', '-'):>2}  {s['fprop']:<13} {s['dgrad']:<13} {s['wgrad']:<13} "
                     f"{_kib(m.saved_bytes, getattr(m, 'hp_saved_bytes', 0)):>18}")
    recomputed = sum(m.recompute_x for m in ctrl.layers)
    if recomputed:
        lines.append(f"{recomputed} of {len(ctrl.layers)} layers run under selective activation recompute "
                     "(adahop.nn.recompute): X saved by reference, recomputed and prepared for wgrad in backward")
    if ctrl.recipe.bf16_small_gemms is not None:
        rule = ctrl.recipe.bf16_small_gemms
        lines.append(f"{small_gemm_count(model)} of {len(GEMMS) * len(ctrl.layers)} GEMMs run BF16 as too small for the "
                     f"fast path (bf16_small_gemms: K·N < {rule.min_kn}, or outer dim < {rule.min_outer})")
    from ..recipes.table import gemm_table

    # the strategy columns above are only the per-layer part; formats, outer transforms and mean splits are the recipe's
    lines += ["", f"each quantized GEMM of recipe {ctrl.recipe.name} (a layer's strategy above picks its row's inner "
                  "transform):", gemm_table(ctrl.recipe)]
    return "\n".join(lines)


def small_gemm_count(model: nn.Module) -> int:
    """How many GEMMs of a converted model's layers the recipe's ``bf16_small_gemms`` rule runs in
    BF16 (0 without the rule; layers BF16 for another reason, an edge block or a shape the recipe
    cannot quantize, are not counted)."""
    return sum(len(getattr(m, "small_bf16", ())) for m in model.modules() if isinstance(m, LowPrecisionLinear))


#: The columns of :func:`plan_rows`.
PLAN_COLUMNS = ("layer", "x", "w", "dy", "fprop", "dgrad", "wgrad")


def plan_rows(plan: Plan) -> list[list[str]]:
    """The frozen plan as table rows, one per layer in the plan's order: the columns of
    ``PLAN_COLUMNS`` (qualified name, the voted patterns of X, W, ∇Y, the strategy per GEMM)."""
    return [[name] + [str(e.get(k, "-")) for k in PLAN_COLUMNS[1:]] for name, e in plan.layers.items()]


def strategy_counts(source: "Plan | nn.Module") -> dict[str, int]:
    """How many layers run each strategy, per GEMM: ``{"fprop/iht": 10, "wgrad/bf16": 2, ...}`` (keys sorted;
    every GEMM and strategy that occurs). Given a converted model, what its layers run
    (:meth:`LowPrecisionLinear.strategies`, as :func:`describe` shows them): a recipe variant that keeps some GEMMs in
    BF16 (``@only-wgrad``, ``bf16_small_gemms``) or maps a plan's entry to another strategy counts as it runs. Given
    a :class:`~adahop.patterns.Plan`, the plan's own entries."""
    if isinstance(source, Plan):
        entries = list(source.layers.values())
    else:
        entries = [m.strategies() for m in source.modules() if isinstance(m, LowPrecisionLinear)]
    counts: dict[str, int] = {}
    for e in entries:
        for g in ("fprop", "dgrad", "wgrad"):
            key = f"{g}/{e[g]}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))
