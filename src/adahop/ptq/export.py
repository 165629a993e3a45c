"""What `adahop ptq` writes: a transformers folder with the dequantized weights in BF16, and beside it
the packed artifact (codes, scales, signs, HARP parameters) from which those weights are rebuilt.

``DIR/`` holds ``config.json``, ``model.safetensors`` (BF16: ``S U Q(W̃) Vᵀ S`` per quantized layer,
the rest as loaded), the tokenizer, ``ptq_packed.safetensors`` and ``ptq.json`` (the results).
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it, so any tool can evaluate it.
:func:`dequantize_packed` rebuilds each layer's weight from the artifact alone (FP32; the BF16 export is
that weight rounded), which shows the artifact holds everything the weights need.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .grids import make_grid
from .incoherence import RHTRotation, TwoSided
from .quantize import RotationOptions, parse_method, unpack_bits
from .rotation import HARPRotation

__all__ = ["PACKED_FILE", "RESULTS_FILE", "save_quantized", "load_packed", "dequantize_packed", "unfinished"]

PACKED_FILE = "ptq_packed.safetensors"
RESULTS_FILE = "ptq.json"


def save_quantized(model, tokenizer, out: Path, layers: dict, meta: dict) -> None:
    """Write ``model`` (quantized in place) in BF16 with ``tokenizer`` to ``out``, and the packed artifact.

    Args:
        model: the transformers causal LM whose quantized layers hold their dequantized weights.
        tokenizer: saved beside it (``save_pretrained``).
        out: the folder (created).
        layers: ``{name: LayerResult}`` of :func:`adahop.ptq.calibrate.quantize_model`.
        meta: method, bits, quantizer, group size, seed and rotation options; stored in the
            artifact's metadata with each layer's shape, and as ``adahop_ptq`` in config.json.

    The weights an earlier, interrupted attempt left in ``out`` (`adahop ptq` redoes a folder of its own without
    ``ptq.json``) are removed first: a second interruption mid-write then leaves a folder that fails to load,
    never this attempt's config and weights beside the last attempt's packed codes (which
    :func:`adahop.ptq.load_packed_model` would run, silently another method or width). Its config.json stays
    until ``save_pretrained`` replaces it, so that the folder is still known as ours and may be redone.
    """
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / PACKED_FILE, out / RESULTS_FILE, *out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        stale.unlink(missing_ok=True)
    cfg = model.config
    if hasattr(cfg, "adahop"):  # a run folder's training section: this folder is no run folder
        delattr(cfg, "adahop")
    cfg.adahop_ptq = meta
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    tensors = {f"{name}.{k}": v.contiguous() for name, r in layers.items() for k, v in r.stored.items()}
    shapes = {name: list(r.weight.shape) for name, r in layers.items()}
    save_file(tensors, out / PACKED_FILE, metadata={"adahop_ptq": json.dumps({**meta, "layers": shapes})})


def unfinished(folder: Path) -> str | None:
    """Why ``folder`` (an `adahop ptq` output) is not finished, or None: its ``ptq.json`` is written last, after the
    export and any zero-shot scoring, so a folder without it comes from a run that stopped (its weights are whole
    once the packed artifact exists, which the loaders check)."""
    if (folder / RESULTS_FILE).is_file():
        return None
    return (f"{folder} has no {RESULTS_FILE}: the `adahop ptq` run that wrote it did not finish, so its results are "
            f"not recorded; rerun it with the same --out to finish it")


def load_packed(path: str | Path) -> dict[str, tuple]:
    """Each layer of ``ptq_packed.safetensors``: ``{name: (grid, stored, transform, (m, n))}``, with ``stored``
    the layer's tensors (``codes``, scales, ...) and ``transform`` its :class:`TwoSided` (signs and the RHT or
    HARP rotations, on the CPU) or None without incoherence processing.

    ``path``: the file, or the folder `adahop ptq` wrote it into.

    Raises:
        ValueError: no such file, or a file without the ``adahop_ptq`` metadata.
    """
    path = Path(path)
    if path.is_dir():
        path = path / PACKED_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no such file; pass the {PACKED_FILE} of an `adahop ptq` output folder, or the folder")
    try:
        f = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error class for a file that is not one
        raise ValueError(f"{path}: not a safetensors file ({e}); pass the {PACKED_FILE} of an `adahop ptq` output folder") from None
    with f:
        md = f.metadata() or {}
        if "adahop_ptq" not in md:
            raise ValueError(f"{path}: no adahop_ptq metadata; pass a {PACKED_FILE} written by `adahop ptq`")
        meta = json.loads(md["adahop_ptq"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    rot, _ = parse_method(meta["method"])
    ro = RotationOptions(**meta["rotation"])
    out = {}
    for name, (m, n) in meta["layers"].items():
        t = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        grid = make_grid(meta["quantizer"], meta["bits"], meta["group_size"])
        transform = None
        if rot is not None:
            signs = [1.0 - 2.0 * unpack_bits(t[f"signs_{s}"], 1, d).float() for s, d in (("out", m), ("in", n))]
            if rot == "rht":
                u, v = RHTRotation(m, min_block=ro.min_block), RHTRotation(n, min_block=ro.min_block)
            else:
                u, v = (HARPRotation(d, ro.radix, ro.max_radix, ro.passes, ro.mixer, seed=meta["seed"],
                                     theta_format=ro.theta_format) for d in (m, n))
                for side, r in (("out", u), ("in", v)):
                    pre = f"theta_{side}."
                    r.load_packed_params({k[len(pre):]: x for k, x in t.items() if k.startswith(pre)})
            transform = TwoSided(u, v, *signs)
        out[name] = (grid, t, transform, (m, n))
    return out


def dequantize_packed(path: str | Path) -> dict[str, torch.Tensor]:
    """Each layer's float32 weight ``[m, n]`` rebuilt from ``ptq_packed.safetensors`` alone (``path``: the
    file or its folder).

    Raises:
        ValueError: as :func:`load_packed`.
    """
    out = {}
    for name, (grid, t, transform, (m, n)) in load_packed(path).items():
        q = grid.decode(unpack_bits(t["codes"], grid.bits, m * n).reshape(m, n), t)
        with torch.no_grad():
            out[name] = q if transform is None else transform.weight_inverse(q)
    return out
