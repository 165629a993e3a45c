"""`AdamW` on low-precision masters: the update rounded to nearest-even (pure BF16 AdamW, the
failure mode of `specs/related_methods.md` §3.1: steps under half an ulp of ``w`` vanish)."""

from __future__ import annotations

from .base import MasterOptimizer

__all__ = ["AdamW"]


class AdamW(MasterOptimizer):
    """AdamW (decoupled weight decay) whose master write rounds to nearest-even; with FP32 masters and
    states it is ``torch.optim.AdamW`` up to FP32 rounding. Arguments: :class:`MasterOptimizer`."""

    algorithm = "adamw"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, **kw):
        kw.setdefault("rounding", "nearest")
        super().__init__(params, lr, betas, eps, weight_decay, **kw)
