"""Post-training quantization (`adahop ptq`): RTN and GPTQ/LDLQ on int, MXFP4 and NVFP4 grids, with
QuIP-style RHT incoherence or HARP's learned rotations (`specs/related_methods.md` §2).

Modules, one idea each: :mod:`~adahop.ptq.rotation` (HARPRotation), :mod:`~adahop.ptq.incoherence`
(signs + RHT, the two-sided transform), :mod:`~adahop.ptq.grids` (quantizer grids),
:mod:`~adahop.ptq.ldlq` (GPTQ/LDLQ), :mod:`~adahop.ptq.fit` (HARP's proxy objective), :mod:`~adahop.ptq.quantize`
(one layer under a method), :mod:`~adahop.ptq.calibrate` (Hessians, block by block),
:mod:`~adahop.ptq.export` (transformers folder + packed artifact), :mod:`~adahop.ptq.decode` (layers that
compute from the packed codes, for decoding), :mod:`~adahop.ptq.cli`.

The names below load on first use, so that the CLI parser (which imports :mod:`~adahop.ptq.names`)
never imports torch. No module shares a name with one of them: importing a submodule binds its name on
this package, so a module ``gptq`` would shadow the function ``gptq`` once anything had imported it.
"""

import importlib

_WHERE = {
    "HARPRotation": "rotation", "radix_schedule": "rotation", "RHTRotation": "incoherence", "TwoSided": "incoherence",
    "rht_block": "incoherence", "IntGrid": "grids", "MXFP4Grid": "grids", "NVFP4Grid": "grids", "make_grid": "grids",
    "gptq": "ldlq", "proxy_error": "ldlq", "FitOptions": "fit", "fit_harp": "fit", "fit_harp_many": "fit", "fit_harp_groups": "fit", "proxy_loss": "fit",
    "quantize_layer": "quantize", "dequantize_packed": "export", "load_packed": "export",
    "PackedLinear": "decode", "int_matvec": "decode", "load_packed_model": "decode",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
