"""The name -> optimizer table of ``adahop train --optimizer`` and the bytes a run's weights and
states take (:mod:`adahop.optim`)."""

from __future__ import annotations

import torch

from .adamw import AdamW
from .base import STATE_DTYPES
from .kahan_adamw import KahanAdamW
from .madam import MAdam
from .master import master_format, weight_bytes
from .names import MADAM_FORMS, MASTER_FORMATS, MASTER_ROUNDINGS, OPTIMIZERS, resolved_rounding
from .sr_adamw import SRAdamW

__all__ = ["build_optimizer", "memory_bytes"]

_CLASSES = {"adamw": AdamW, "sr-adamw": SRAdamW, "kahan-adamw": KahanAdamW, "m+adam": MAdam}


def build_optimizer(name: str, params, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                    master: str = "fp32", states: str = "fp32", madam_form: str = "arxiv-relative",
                    mul_lr_scale: float = 1.0, rounding: str = "auto", seed: int = 0,
                    backend: str = "auto") -> torch.optim.Optimizer:
    """The optimizer ``name`` (:data:`OPTIMIZERS`) over ``params`` (parameters or groups).

    ``adamw`` with FP32 masters and FP32 states is ``torch.optim.AdamW`` itself (the reference, as
    before); every other combination is a :class:`MasterOptimizer`. ``master`` only checks the
    combination (the parameters already carry their storage: :func:`convert_master_weights`).
    ``rounding`` (:data:`MASTER_ROUNDINGS`) is that of every master write: ``auto`` is stochastic for
    ``sr-adamw`` and nearest for the others; FP32 masters are not rounded.

    Raises:
        ValueError: unknown name, state dtype, M+Adam form or rounding, naming the choices;
            ``rounding="nearest"`` with ``sr-adamw``; ``sr-adamw`` or ``rounding="stochastic"`` with FP32 masters
            (it would be silently unused); a low-precision ``master`` over FP32 parameters (not converted), or
            ``master="fp32"`` over parameters stored otherwise.
    """
    if name not in _CLASSES:
        raise ValueError(f"--optimizer {name!r}: use one of {OPTIMIZERS}")
    if states not in STATE_DTYPES:
        raise ValueError(f"--optimizer-states {states!r}: use one of {tuple(STATE_DTYPES)}")
    if master not in MASTER_FORMATS:
        raise ValueError(f"--master-weights {master!r}: use one of {MASTER_FORMATS}")
    if rounding not in MASTER_ROUNDINGS:
        raise ValueError(f"--master-rounding {rounding!r}: use one of {MASTER_ROUNDINGS}")
    if rounding == "nearest" and name == "sr-adamw":
        raise ValueError("--master-rounding nearest: sr-adamw rounds stochastically; use --optimizer adamw")
    if name == "sr-adamw" and master == "fp32":  # as TrainConfig refuses it (optim.checks)
        raise ValueError("sr-adamw rounds the master update stochastically, and FP32 masters are not rounded; pass "
                         "master='bf16' (or fp8/fp4/nvfp4, after convert_master_weights), or use 'adamw'")
    if rounding == "stochastic" and master == "fp32":  # as TrainConfig refuses it: FP32 writes round nothing
        raise ValueError("--master-rounding stochastic: FP32 masters are not rounded; pass --master-weights "
                         "bf16|fp8|fp4|nvfp4 (after convert_master_weights), or rounding='auto'")
    # generators are read twice (the storage check, then the optimizer): lists of them
    params = [dict(g, params=[g["params"]] if torch.is_tensor(g["params"]) else list(g["params"])) if isinstance(g, dict)
              else g for g in ([params] if torch.is_tensor(params) else params)]
    # the declared masters must be the parameters' storage: the rounding has nothing to round otherwise, and FP32
    # masters declared over BF16 parameters would keep torch's AdamW states in BF16
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if master != "fp32":
        fp32 = sum(master_format(p) == "fp32" for p in tensors)
        if fp32:
            raise ValueError(f"master={master!r}, but {fp32} of the {len(tensors)} parameters are FP32: call "
                             f"convert_master_weights(model, {master!r}) before building the optimizer")
    else:
        other = sorted({master_format(p) for p in tensors} - {"fp32"})
        if other:
            raise ValueError(f"master='fp32', but parameters are stored as {', '.join(other)}: pass master={other[0]!r} "
                             f"(their storage), or keep the model in FP32")
    if name == "adamw" and master == "fp32" and states == "fp32":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_dtype=STATE_DTYPES[states], seed=seed,
              backend=backend)
    if name != "sr-adamw":  # SRAdamW sets its own
        kw["rounding"] = resolved_rounding(name, rounding)
    if name == "m+adam":
        if madam_form not in MADAM_FORMS:
            raise ValueError(f"--madam-form {madam_form!r}: use one of {tuple(MADAM_FORMS)}")
        return MAdam(params, form=madam_form, mul_lr_scale=mul_lr_scale, **kw)
    return _CLASSES[name](params, **kw)


def memory_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Bytes of master weights and optimizer state on this rank (local shards under FSDP2), and
    per parameter: ``{"params", "weight_bytes", "state_bytes", "bytes_per_param"}``. Tied parameters
    count once; state scalars (the step count) are not counted."""
    seen, n, wb = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = p._local_tensor if hasattr(p, "_local_tensor") else p
        n += local.numel()
        wb += weight_bytes(local)
    sb = sum((v._local_tensor if hasattr(v, "_local_tensor") else v).numel() * v.element_size()
             for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.ndim > 0)
    return dict(params=n, weight_bytes=wb, state_bytes=sb, bytes_per_param=(wb + sb) / n if n else None)
