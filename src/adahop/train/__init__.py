"""Layer 7: the training application (`adahop train`, `adahop compare`)."""

from .config import TrainConfig

__all__ = ["TrainConfig", "Diverged", "train"]


def __getattr__(name: str):  # the loop imports torch: only on first use (PEP 562), not for `--help`
    if name in ("Diverged", "train"):
        from . import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'adahop.train' has no attribute {name!r}")
