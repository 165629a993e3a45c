"""`MAdam`: M+Adam (Liang, Loeschcke, Toftrup, Anandkumar; arXiv 2607.10611), additive Adam steps
plus multiplicative (exponent-space) steps every step, for BF16/FP8/FP4 master weights.

Neither form is verified against the paper's text (`specs/related_methods.md` §3.2; `docs/optim.md`):

- ``form="arxiv"``: Algorithm 1 as a third-party reimplementation reads it (spec §3.2 B, literal:
  for ``|w| >= τ`` its multiplicative term is an additive step of size ≈ η_mul);
- ``form="arxiv-relative"``: the same with the multiplicative term ``ln2·ρ·u_e``, a step
  proportional to ``|w|`` (the spec's dimensional reading);
- ``form="workshop"``: the OPT-2025 mantissa–exponent form (spec §3.2 A), four moments.

The formulas are in :mod:`adahop.kernels.optim_step`.
"""

from __future__ import annotations

from .base import MasterOptimizer
from .names import MADAM_FORMS

__all__ = ["MAdam", "MADAM_FORMS"]



class MAdam(MasterOptimizer):
    """M+Adam.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; ``lr`` is η_a (additive).
        form: a key of :data:`MADAM_FORMS`.
        mul_lr_scale: η_mul / η_a (the multiplicative branch follows the schedule of ``lr``).
        tau: floor of ``|w|`` in ρ (arXiv forms) and in the exponent (workshop), 1e-6 [3P default].
        cap: workshop only, the largest |normalized step| of either branch (η*/η); None: no cap.
        w_max: workshop only, the clamp of ``|w|``; None: none.
        **kw: :class:`MasterOptimizer` (``state_dtype``, ``seed``, ``backend``, ``rounding``).

    Raises:
        ValueError: an unknown ``form``, or a hyper-parameter out of range (``mul_lr_scale < 0``, ``tau <= 0``,
            ``cap`` or ``w_max`` <= 0), here or in a parameter group; ``w_max``, or a ``cap`` other than its
            default, under an arXiv form (which reads neither).
    """

    rule_options = ("mul_lr_scale", "tau", "cap", "w_max")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 form: str = "arxiv-relative", mul_lr_scale: float = 1.0, tau: float = 1e-6, cap: float | None = 1.0,
                 w_max: float | None = None, **kw):
        if form not in MADAM_FORMS:
            raise ValueError(f"form={form!r}; M+Adam forms are {tuple(MADAM_FORMS)}")
        self.algorithm = MADAM_FORMS[form]
        self.form = form
        super().__init__(params, lr, betas, eps, weight_decay, mul_lr_scale=mul_lr_scale, tau=tau, cap=cap,
                         w_max=w_max, **kw)

    def _check_group(self, group: dict, index: int) -> None:
        """The base checks, then (arXiv forms) a ``w_max`` or non-default ``cap`` refused: the arXiv forms' update
        reads neither, so a clamp asked for would silently not happen. Runs for the constructor's groups and for
        each ``add_param_group`` (a group added later escaped it)."""
        super()._check_group(group, index)
        if self.form != "workshop" and (group.get("w_max") is not None or group.get("cap") not in (None, 1.0)):
            raise ValueError(f"MAdam(form={self.form!r}): cap={group.get('cap')!r}, w_max={group.get('w_max')!r} (group "
                             f"{index}) are options of the workshop form, which this form's update does not read; use "
                             f"form='workshop', or leave cap and w_max at their defaults")
