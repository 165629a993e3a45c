"""Which optimizer options combine, checked before a run builds anything (`adahop train`)."""

from __future__ import annotations

import dataclasses

from .names import MADAM_FORMS, MASTER_FORMATS, MASTER_ROUNDINGS, OPTIMIZERS, PACKED_FORMATS

__all__ = ["check_optimizer_options"]

STATES = ("fp32", "bf16")


def check_optimizer_options(cfg, bad) -> None:
    """Call ``bad(field, message)`` (it raises) for an unknown choice or a combination that cannot
    run; each message names the fix. ``cfg`` is a :class:`adahop.train.TrainConfig`.

    Refused: packed (fp8/fp4/nvfp4) masters under ``--parallel ddp|fsdp`` (DDP and FSDP2 move
    parameters as plain tensors) or with ``--compile`` (the packed tensor is not traced);
    ``sr-adamw`` on FP32 masters (nothing to round: it would be ``adamw``); a non-positive
    ``--madam-mul-lr``; ``--master-rounding stochastic`` on FP32 masters, and ``nearest`` with
    ``sr-adamw``; ``--madam-form`` or ``--madam-mul-lr`` set (not their defaults) with an optimizer
    other than ``m+adam``, which never reads them (the run would pass for an M+Adam one).
    """
    if cfg.optimizer not in OPTIMIZERS:
        bad("optimizer", f"{cfg.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if cfg.master_weights not in MASTER_FORMATS:
        bad("master_weights", f"{cfg.master_weights!r}; use one of {', '.join(MASTER_FORMATS)}")
    if cfg.optimizer_states not in STATES:
        bad("optimizer_states", f"{cfg.optimizer_states!r}; use fp32 or bf16")
    if cfg.madam_form not in MADAM_FORMS:
        bad("madam_form", f"{cfg.madam_form!r}; use one of {', '.join(MADAM_FORMS)}")
    if not cfg.madam_mul_lr > 0:
        bad("madam_mul_lr", f"must be > 0, got {cfg.madam_mul_lr}")
    if cfg.master_rounding not in MASTER_ROUNDINGS:
        bad("master_rounding", f"{cfg.master_rounding!r}; use one of {', '.join(MASTER_ROUNDINGS)}")
    if cfg.master_rounding == "stochastic" and cfg.master_weights == "fp32":
        bad("master_rounding", "FP32 masters are not rounded; pass --master-weights bf16|fp8|fp4|nvfp4, or drop "
                               "--master-rounding")
    if cfg.master_rounding == "nearest" and cfg.optimizer == "sr-adamw":
        bad("master_rounding", "sr-adamw rounds stochastically by definition; use --optimizer adamw for "
                               "round-to-nearest, or drop --master-rounding")
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    if cfg.optimizer != "m+adam":
        for name in ("madam_form", "madam_mul_lr"):
            if getattr(cfg, name) != defaults.get(name, getattr(cfg, name)):
                bad(name, f"{getattr(cfg, name)} is an M+Adam setting and --optimizer {cfg.optimizer} does not read it; "
                          f"add --optimizer m+adam, or drop --{name.replace('_', '-')}")
    packed = cfg.master_weights in PACKED_FORMATS
    if packed and cfg.parallel != "none":
        bad("master_weights", f"{cfg.master_weights} masters are packed tensors, which --parallel {cfg.parallel} cannot "
                              f"shard or broadcast; use --master-weights bf16 with --parallel, or run one process")
    if packed and cfg.compile:
        bad("master_weights", f"{cfg.master_weights} masters are dequantized on the fly by a tensor subclass that "
                              "torch.compile does not trace here; drop --compile, or use --master-weights bf16")
    if cfg.optimizer == "sr-adamw" and cfg.master_weights == "fp32":
        bad("optimizer", "sr-adamw rounds the master update stochastically, and FP32 masters are not rounded; pass "
                         "--master-weights bf16 (or fp8/fp4), or use --optimizer adamw")
