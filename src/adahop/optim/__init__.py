"""Optimizers for low-precision master weights (`DESIGN.md` §2 layer 7, beside `nn`): AdamW,
SR-AdamW, Kahan-AdamW and M+Adam over FP32, BF16, FP8 or FP4 masters (`specs/related_methods.md` §3).

- :mod:`.master`: the master-weight storage (BF16 Parameters, packed FP8/FP4 ones);
- :mod:`.base`: the shared step (the fused kernel of :mod:`adahop.kernels.optim_step`);
- :mod:`.adamw`, :mod:`.sr_adamw`, :mod:`.kahan_adamw`, :mod:`.madam`: one rule each;
- :func:`build_optimizer`: the name → optimizer table of ``adahop train --optimizer``.
"""

from __future__ import annotations

import importlib

__all__ = ["AdamW", "SRAdamW", "KahanAdamW", "MAdam", "MasterOptimizer", "OPTIMIZERS", "MADAM_FORMS", "MASTER_FORMATS",
           "PACKED_FORMATS", "STATE_DTYPES", "PackedMaster", "build_optimizer", "convert_master_weights",
           "master_format", "read_master", "write_master", "memory_bytes"]

# where each name lives: imported on first use (PEP 562), so that `adahop.optim.checks`, which the
# run config calls before torch is loaded, imports no torch
_WHERE = {"AdamW": "adamw", "SRAdamW": "sr_adamw", "KahanAdamW": "kahan_adamw", "MAdam": "madam", "MADAM_FORMS": "madam",
          "MasterOptimizer": "base", "STATE_DTYPES": "base", "OPTIMIZERS": "names", "build_optimizer": "build",
          "memory_bytes": "build", **{n: "master" for n in ("MASTER_FORMATS", "PACKED_FORMATS", "PackedMaster",
                                                            "convert_master_weights", "master_format", "read_master",
                                                            "write_master")}}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'adahop.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
