"""The vocabulary of `adahop ptq` (no torch here: the CLI parser imports it on every start)."""

METHODS = ("rtn", "gptq", "rht-rtn", "rht-gptq", "harp-rtn", "harp-gptq")
"""``[rht-|harp-]`` incoherence, then the ``rtn`` or ``gptq`` backend."""

QUANTIZERS = ("int", "mxfp4", "nvfp4")
"""Weight grids: symmetric int with FP16 group scales; MXFP4 and NVFP4 of :mod:`adahop.formats`."""

MIXERS = ("had_or_qr", "had_or_ident", "qr", "identity")
"""HARP's fixed block mixers ``M_b`` (`specs/related_methods.md` §2.2)."""

THETA_FORMATS = ("fp16", "int8")
"""How the artifact stores HARP's Cayley parameters: FP16, or int8 with one FP16 scale per block (about half the
bits; `specs/related_methods.md` §2.6's optional export)."""
