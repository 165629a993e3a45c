"""`KahanAdamW`: AdamW on a low-precision master plus a compensation buffer (Kahan summation, as in
Zamirai et al., "Revisiting BFloat16 Training", 2020): what a rounding drops is added back next step."""

from __future__ import annotations

from .base import MasterOptimizer

__all__ = ["KahanAdamW"]


class KahanAdamW(MasterOptimizer):
    """AdamW with Kahan-compensated master updates: ``y = Δ + c``, ``w' = round(w + y)``,
    ``c' = y − (w' − w)``; ``c`` (state ``comp``) has the states' dtype. Arguments: :class:`MasterOptimizer`."""

    algorithm = "kahan"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, **kw):
        kw.setdefault("rounding", "nearest")
        super().__init__(params, lr, betas, eps, weight_decay, **kw)
