"""The FP32 constants of the ``2^y`` polynomial that the fused optimizer step's reference
(`optim_step.py`) and its Triton kernel (`_triton_optim_step.py`) both evaluate, so that they
agree bit for bit. A module of its own so the kernel does not import the op that imports it."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["LN2", "EXP_COEFFS"]

#: ln 2 rounded to FP32.
LN2 = float(np.float32(math.log(2.0)))
#: Taylor coefficients of e^t (t = y·ln2) for 2^y, |y| <= 1, in FP32 (Horner, highest first).
EXP_COEFFS = tuple(float(np.float32(1.0 / math.factorial(k))) for k in range(8, -1, -1))
