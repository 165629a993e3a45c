"""Layer 6: the autograd function, the converted linear, conversion and the step hook."""

from .convert import (controller_state, convert_model, describe, get_controller, load_controller_state, on_step,
                      register_step_hook, saved_bytes, seed_compiled_rng, small_gemm_count, supports_shape)
from .function import LowPrecisionLinearFn
from .linear import Controller, LowPrecisionLinear

__all__ = ["controller_state", "load_controller_state", "convert_model", "describe", "get_controller", "on_step", "register_step_hook", "saved_bytes", "seed_compiled_rng", "small_gemm_count",
           "supports_shape",
           "LowPrecisionLinearFn", "LowPrecisionLinear", "Controller"]
