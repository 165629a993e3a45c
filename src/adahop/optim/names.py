"""Names of ``adahop train --optimizer`` (torch-free: the config checks them before torch loads)."""

OPTIMIZERS = ("adamw", "sr-adamw", "kahan-adamw", "m+adam")

#: ``form`` → update rule of :mod:`adahop.kernels.optim_step`.
MADAM_FORMS = {"arxiv-relative": "madam-arxiv-relative", "arxiv": "madam-arxiv", "workshop": "madam-workshop"}

MASTER_FORMATS = ("fp32", "bf16", "fp8", "fp4", "nvfp4")

#: ``--master-rounding``: ``auto`` is stochastic for ``sr-adamw``, round-to-nearest for the others.
MASTER_ROUNDINGS = ("auto", "nearest", "stochastic")
PACKED_FORMATS = ("fp8", "fp4", "nvfp4")


def resolved_rounding(optimizer: str, rounding: str) -> str:
    """The rounding of ``optimizer``'s master writes under ``--master-rounding rounding``: what ``auto``
    means (stochastic for ``sr-adamw``, which rounds so by definition; nearest for the others)."""
    if optimizer == "sr-adamw":
        return "stochastic"
    return "nearest" if rounding == "auto" else rounding
