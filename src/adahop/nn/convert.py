"""One-call conversion of a model's `nn.Linear` layers, the step hook, and `describe`."""

from __future__ import annotations

import fnmatch
import re
import warnings

import torch
from torch import nn

from ..patterns import Plan
from ..recipes import Recipe, get_recipe
from ..utils import mix_seed
from .linear import Controller, LowPrecisionLinear, plan_for_another_model

__all__ = ["convert_model", "on_step", "get_controller", "describe", "saved_bytes", "seed_compiled_rng", "supports_shape"]

_BLOCK_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


# The layer dimension each outer Hadamard runs along (T, the tokens, is only known at run time).
_OUTER_DIMS = {("fprop", "outer_b"): "N", ("dgrad", "outer_b"): "K", ("wgrad", "outer_b"): "K", ("wgrad", "outer_a"): "N"}


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


def convert_model(model: nn.Module, recipe: str | Recipe, *, exclude=("lm_head",), seed: int = 0,
                  plan: Plan | None = None, backend: str = "auto") -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`LowPrecisionLinear` running ``recipe``.

    Args:
        model: any module built of ``nn.Linear`` (Hugging Face Llama/Qwen3, ``nn.Sequential``...).
        recipe: a preset name (see :func:`adahop.list_recipes`) or a :class:`Recipe`.
        exclude: fnmatch patterns of qualified names to keep as they are; a pattern without
            wildcards also matches as a name suffix (``"lm_head"`` matches ``"model.lm_head"``);
            None or ``()`` excludes nothing.
        seed: run seed for stochastic rounding and random signs.
        plan: a frozen AdaHOP plan (from ``plan.json`` or a checkpoint): calibration is skipped.
        backend: ``"auto"`` (the fast path on CUDA, the reference elsewhere, decided per call from
            the input's device, so converting before or after ``.to("cuda")`` is the same),
            ``"triton"`` or ``"reference"``. It never changes the recipe's numerics.

    Returns:
        ``model``, modified in place. The original Parameters are kept. Layers whose shape the
        recipe cannot quantize stay BF16 GEMMs (one warning lists them); so do the linears of
        the last ``recipe.bf16_last_layers`` / first ``bf16_first_layers`` transformer blocks.

    Raises:
        ValueError: unknown recipe name (lists the known ones) or backend, a model already converted, a
            bare ``nn.Linear`` (wrap it in ``nn.Sequential``), a model with no ``nn.Linear`` left to
            convert (e.g. GPT-2's ``Conv1D`` layers) under a quantizing recipe, or a ``plan`` without
            an entry for a converted layer.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if getattr(model, "_adahop_controller", None) is not None:
        raise ValueError("this model is already converted; convert a fresh model")
    if type(model) is nn.Linear:
        raise ValueError("convert_model swaps the nn.Linear layers *inside* a module and cannot replace the module "
                         "it is given; wrap a bare layer first: convert_model(nn.Sequential(linear), ...)")
    if exclude is None:
        exclude = ()
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and not _excluded(n, exclude)]
    if not names and not recipe.is_bf16:  # nothing would run the recipe: the "MXFP4" run would be BF16
        conv1d = sum(type(m).__name__ == "Conv1D" for m in model.modules())
        why = (f"its {conv1d} linear maps are transformers Conv1D modules (GPT-2 style, weight stored [in, out]), "
               "which adahop does not convert; use a model built of nn.Linear (Llama, Qwen, GPT-NeoX, ...)") if conv1d \
            else f"exclude={tuple(exclude)!r} leaves none, or it has none"
        raise ValueError(f"convert_model: the model has no nn.Linear layer to run recipe {recipe.name!r}: {why}")
    controller = Controller(recipe, seed=seed, plan=plan)
    blocks = sorted({int(m.group(1)) for n in names if (m := _BLOCK_RE.search(n))})
    n_blocks = (max(blocks) + 1) if blocks else 0
    unsupported: dict[str, str] = {}  # name -> in->out, of layers the recipe cannot quantize
    for layer_id, name in enumerate(names):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lin = getattr(owner, child)
        m = _BLOCK_RE.search(name)
        blk = int(m.group(1)) if m else None
        edge = blk is not None and (blk < recipe.bf16_first_layers or blk >= n_blocks - recipe.bf16_last_layers)
        fits = supports_shape(recipe, lin.in_features, lin.out_features)
        if not fits and not recipe.is_bf16:
            unsupported[name] = f"{lin.in_features}->{lin.out_features}"
        try:
            new = LowPrecisionLinear.from_linear(lin, recipe, name=name, layer_id=layer_id, controller=controller,
                                                 backend=_layer_backend(backend, lin.weight.device), force_bf16=edge or not fits)
        except KeyError:  # a plan made for another model: say so before anything runs
            raise plan_for_another_model(name, controller.plan) from None
        setattr(owner, child, new)
    if unsupported:
        warnings.warn(f"adahop: recipe {recipe.name!r} cannot quantize these layers (dimensions not multiples of the "
                      f"block size, or not a power of two where the recipe rotates a whole dimension); they run BF16 "
                      f"GEMMs: {', '.join(f'{n} ({io})' for n, io in unsupported.items())}", stacklevel=2)
    controller.unquantizable = list(unsupported)  # reported by the run summary
    model._adahop_controller = controller
    return model


def _layer_backend(backend: str, device: torch.device) -> str:
    """The layer's backend: "auto" stays "auto" (resolved per call from the input's device, so a model
    converted on the CPU and moved to a GPU takes the fast path there); "triton" and "reference" are
    checked now, so that a backend this machine cannot run fails at conversion."""
    from ..kernels import resolve_backend

    resolved = resolve_backend(backend, device)  # checks every value, "auto" included
    return "auto" if backend == "auto" else resolved


def _excluded(name: str, patterns) -> bool:
    if isinstance(patterns, str):
        patterns = (patterns,)
    return any(fnmatch.fnmatchcase(name, p) or name == p or name.endswith("." + p) for p in patterns)


def get_controller(model: nn.Module) -> Controller:
    """The :class:`Controller` of a converted model. Raises ValueError if it is not converted."""
    c = getattr(model, "_adahop_controller", None)
    if c is None:
        raise ValueError("model is not converted; call adahop.convert_model(model, recipe) first")
    return c


def on_step(model: nn.Module, step: int) -> bool:
    """Tell the converted model that ``step`` optimizer steps are done (call after each
    ``optimizer.step()``). Freezes the AdaHOP plan at the end of calibration; returns True then."""
    return get_controller(model).on_step(step)


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
        device = next((l.weight.device for l in ctrl.layers), ctrl.sign_seed.device)
        if ctrl.sign_seed.device != device:  # once: the seed lives beside the layers
            ctrl.sign_seed = ctrl.sign_seed.to(device)
        ctrl.sign_seed.fill_(mix_seed(*parts, "signs") & 0xFFFFFFFF)


def saved_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the converted linears saved for backward at the last forward, the bytes a plain
    ``nn.Linear`` in the same compute dtype saves: its input X and its cast weight)."""
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
    what a plain ``nn.Linear`` saves, X and the cast W)."""
    ctrl = get_controller(model)
    head = (f"{'layer':<44} {'K->N':>12} {'X':>2} {'W':>2} {'dY':>2}  {'fprop':<13} {'dgrad':<13} {'wgrad':<13} "
            f"{'saved KiB (plain)':>18}")
    lines = [f"recipe {ctrl.recipe.name}, step {ctrl.step}, " + ("calibrating" if ctrl.calibrating else "plan frozen" if ctrl.plan else "fixed strategies"), head, "-" * len(head)]
    for m in ctrl.layers:
        s, p = m.strategies(), m.patterns
        lines.append(f"{m.name:<44} {f'{m.in_features}->{m.out_features}':>12} {p.get('x', '-'):>2} {p.get('w', '-'):>2} "
                     f"{p.get('dy', '-'):>2}  {s['fprop']:<13} {s['dgrad']:<13} {s['wgrad']:<13} "
                     f"{_kib(m.saved_bytes, getattr(m, 'hp_saved_bytes', 0)):>18}")
    return "\n".join(lines)
