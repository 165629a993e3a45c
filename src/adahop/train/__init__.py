"""Layer 7: the training application (`adahop train`, `adahop compare`)."""

from .config import TrainConfig
from .loop import Diverged, train

__all__ = ["TrainConfig", "Diverged", "train"]
