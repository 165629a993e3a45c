"""Selective activation recompute: a transformer block keeps its GEMMs' and attention's outputs for
backward and recomputes everything else (RMSNorm, RoPE, SiLU·mul, residual adds) from them.

Why (issue 18, the memory target; `docs/benchmarks_history.md`, round 33): compiled, torchao's float8
training saves no linear input at all, since Inductor recomputes the RMSNorm and SiLU·mul outputs and
their FP8 casts in backward. A converted layer's prepared X (packed MXFP4 for wgrad, 10,880 B a token a
block at Llama-3.2-1B) is an output of its opaque op, which the partitioner cannot recompute, and handing
the op the BF16 X instead only made the partitioner save that. Here the recompute is forced: each block
runs under ``torch.utils.checkpoint`` (non-reentrant) with a selective policy (:func:`policy`), the way
torchtitan's per-op selective activation checkpointing does, and each converted layer inside saves its
input X by reference instead of preparing it (:meth:`~adahop.nn.LowPrecisionLinear.set_recompute_x`).
Backward recomputes X and its wgrad quantizes it there: the same quantizer pass, moved from forward to
backward (`DESIGN.md` §2), so the layer's kernels are unchanged and only the block's cheap elementwise
ops run twice. The numbers are those of a run without it (tests/test_recompute.py).

A converted layer whose GEMMs draw no random bits runs as the opaque op (:mod:`adahop.nn.opaque`) in
eager mode too, so that the checkpoint keeps its outputs whole instead of running its quantizers again;
one that draws them (stochastic rounding, per-call signs) runs its forward again in backward, which takes
the bits of the forward it repeats (:meth:`~adahop.nn.LowPrecisionLinear.generator`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .linear import LowPrecisionLinear

__all__ = ["SAVED_OPS", "policy", "context_fn", "mark_layers", "mark_blocks", "selective_recompute", "undo_selective_recompute",
           "is_recomputed", "calibrates_under_recompute"]


def _ops(*names: str) -> frozenset:
    # some attention kernels exist only in CUDA builds of torch: skip the absent ones
    found = set()
    for name in names:
        ns, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


#: The ops whose outputs a recomputed block keeps: the GEMMs (BF16 ``mm``/``addmm``/``bmm``, torchao's FP8
#: ``_scaled_mm``, a converted layer's opaque forward) and attention. Recomputing them would repeat the block's
#: FLOPs; everything else is elementwise or a reduction over one row.
SAVED_OPS = _ops("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._scaled_mm.default",
                 "aten._scaled_dot_product_flash_attention.default",
                 "aten._scaled_dot_product_flash_attention_for_cpu.default",
                 "aten._scaled_dot_product_efficient_attention.default",
                 "aten._scaled_dot_product_cudnn_attention.default",
                 "aten._flash_attention_forward.default", "aten._efficient_attention_forward.default",
                 "adahop.lp_linear_fwd.default")


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective-checkpoint policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``):
    :data:`SAVED_OPS` and random ops (``nondeterministic_seeded``: a recompute would draw other bits) are
    saved, every other op is recomputed in backward. An in-place random op (``bernoulli_``: CPU dropout) is
    recomputed: the checkpoint cannot keep a tensor that is mutated after it (torch raises), and it restores
    the RNG state before the recompute, so the op draws the forward's bits again."""
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        schema = getattr(op, "_schema", None)
        return CheckpointPolicy.PREFER_RECOMPUTE if schema is not None and schema.is_mutable else CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def context_fn():
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` that
    applies :func:`policy`: pass it where blocks are checkpointed by hand (torchtitan, your own loop),
    and call :func:`mark_layers` on each such block."""
    return create_selective_checkpoint_contexts(policy)


def mark_layers(module: nn.Module, on: bool = True) -> int:
    """Make every converted layer in ``module`` save its input X by reference for backward (``on``), or
    its prepared operand again (``on=False``); returns how many layers it set. Only for layers that run
    inside a checkpointed region with :func:`policy`: elsewhere X itself would be kept, 16 bits an
    element where the prepared operand takes 4.25."""
    layers = [m for m in module.modules() if isinstance(m, LowPrecisionLinear)]
    for m in layers:
        m.set_recompute_x(on)
    return len(layers)


def selective_recompute(model: nn.Module) -> nn.Module:
    """Run each transformer block of ``model`` (a ``transformers`` model, converted or not) under
    selective activation recompute (module docstring); returns ``model``. Before or after
    ``adahop.convert_model`` (which marks the layers it makes inside the blocks); train in ``model.train()``
    mode (transformers checkpoints only then).
    BF16 models take it too, for a comparison at equal recompute.

    Source: issue 18's memory target; the policy follows torchtitan's per-op selective activation
    checkpointing (GEMM and attention outputs saved).

    Raises:
        ValueError: ``model`` is not a ``transformers`` model that supports gradient checkpointing
            (checkpoint the blocks by hand with :func:`context_fn` and :func:`mark_layers`).
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"selective_recompute: {type(model).__name__} is not a transformers model with gradient "
                         "checkpointing; wrap each block in torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False, "
                         "context_fn=adahop.nn.recompute.context_fn) and call adahop.nn.recompute.mark_layers(block)")
    kwargs = {"use_reentrant": False, "context_fn": context_fn}
    # transformers adds a hook that makes the embeddings' output require grad; undo_selective_recompute removes it
    # only if it was not there before
    model._adahop_added_grads_hooks = not getattr(model, "_require_grads_hooks", None)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model._adahop_recompute = True
    mark_blocks(model)
    return model


def undo_selective_recompute(model: nn.Module) -> nn.Module:
    """Turn :func:`selective_recompute` off again: the blocks run without checkpoints and the converted layers save
    their prepared operands; returns ``model``. ``adahop train`` runs an AdaHOP recipe's eager BF16 calibration
    steps under recompute, for memory, and calls this at the plan's freeze (eager, the numbers are the same)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if hasattr(model, "activation_checkpointing_disable"):  # transformers >= 5.2x; the older name warns there
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
    for b in model.modules():
        if isinstance(b, GradientCheckpointingLayer):
            mark_layers(b, on=False)
    if getattr(model, "_adahop_added_grads_hooks", False) and hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()  # the embeddings' require-grad hook the enable added (helper 63)
    model._adahop_recompute = model._adahop_added_grads_hooks = False
    return model


def calibrates_under_recompute(model: nn.Module, device: torch.device) -> bool:
    """Whether an AdaHOP recipe's calibration steps of ``model`` on ``device`` run under :func:`selective_recompute`
    when the run itself does not (``adahop train`` in one process, ``bench model``): on a GPU, for a model with
    transformers' gradient checkpointing. Those steps are eager BF16 steps, also under ``--compile``, and need more
    memory than the steps after them (round 34: plain Lv2 at Llama-3.2-1B 4096 x 8 ran out of memory there on an
    H100, where its compiled steps fit); eager, recompute changes no number, and :func:`undo_selective_recompute`
    turns it off at the freeze."""
    return torch.device(device).type == "cuda" and getattr(model, "supports_gradient_checkpointing", False)


def mark_blocks(model: nn.Module) -> int:
    """:func:`mark_layers` on every checkpointed block of a ``transformers`` ``model``; returns how many layers it set
    (``convert_model`` calls it when :func:`selective_recompute` came first)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(mark_layers(b) for b in model.modules() if isinstance(b, GradientCheckpointingLayer))


def is_recomputed(model: nn.Module) -> bool:
    """True when :func:`selective_recompute` was applied to ``model``."""
    return getattr(model, "_adahop_recompute", False)
