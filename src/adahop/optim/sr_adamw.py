"""`SRAdamW`: AdamW whose master write is rounded stochastically (the standard fix for the additive
stall: ``E[round(w + Δ)] = w + Δ``, so small steps survive on average)."""

from __future__ import annotations

from .base import MasterOptimizer

__all__ = ["SRAdamW"]


class SRAdamW(MasterOptimizer):
    """AdamW with stochastic rounding of the master update (Philox bits per step, parameter and
    rank; bit-exact between the Triton kernel and its reference). Arguments: :class:`MasterOptimizer`.

    Raises:
        ValueError: ``rounding`` other than ``"stochastic"``, and what :class:`MasterOptimizer` raises."""

    algorithm = "adamw"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, **kw):
        if kw.setdefault("rounding", "stochastic") != "stochastic":
            raise ValueError(f"SRAdamW(rounding={kw['rounding']!r}): SRAdamW rounds stochastically by definition; use "
                             f"AdamW(rounding={kw['rounding']!r}) for another rounding")
        super().__init__(params, lr, betas, eps, weight_decay, **kw)
