"""Bad input to the PTQ Python API (adahop.ptq) is refused with a ValueError that names it: each case here
once returned a wrong value silently or ended in a raw exception (a new user's probe, 2026-12-05)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adahop.ptq.decode import int_matvec
from adahop.ptq.export import load_packed
from adahop.ptq.fit import FitOptions, fit_harp
from adahop.ptq.grids import make_grid
from adahop.ptq.incoherence import RHTRotation, TwoSided, rht_block
from adahop.ptq.ldlq import gptq
from adahop.ptq.quantize import pack_bits, quantize_layer
from adahop.ptq.rotation import HARPRotation


def _two_sided(m=64, n=128, rot=HARPRotation):
    return TwoSided.random_signs(rot(m), rot(n), generator=torch.Generator().manual_seed(0))


def test_two_sided_refuses_signs_that_are_not_plus_minus_one_and_operands_of_other_shapes():
    u, v = HARPRotation(64), HARPRotation(128)
    with pytest.raises(ValueError, match="float vectors of ±1"):  # weight_inverse returned zeros
        TwoSided(u, v, torch.full((64,), 2.0), torch.zeros(128))
    with pytest.raises(ValueError, match="float vectors of ±1"):
        TwoSided(u, v, torch.ones(64, dtype=torch.long), torch.ones(128))
    with pytest.raises(ValueError, match=r"signs of shapes \(64, 1\)/\(128,\)"):
        TwoSided(u, v, torch.ones(64, 1), torch.ones(128))
    t = _two_sided()
    with pytest.raises(ValueError, match=r"given a weight of shape \(128,\); it takes \[64, 128\]"):  # broadcast before
        t.weight(torch.randn(128))
    with pytest.raises(ValueError, match=r"given a Hessian of shape \(64, 64\); it takes \[128, 128\]"):
        t.hessian(torch.eye(64))
    with pytest.raises(ValueError, match="given a torch.int64 weight"):
        t.weight(torch.ones(64, 128, dtype=torch.long))


def test_rotations_refuse_integer_inputs_and_non_integer_settings():
    with pytest.raises(ValueError, match="applied to a torch.int64 tensor"):  # returned truncated integers
        HARPRotation(64).apply(torch.ones(2, 64, dtype=torch.long))
    for kw, msg in [({"radix": 8.0}, r"integer radix >= 2, got 8.0 \(float\)"), ({"seed": None}, "integer seed >= 0, got None"),
                    ({"passes": True}, "integer passes >= 1, got True")]:
        with pytest.raises(ValueError, match=msg):
            HARPRotation(64, **kw)
    assert HARPRotation(64, passes=np.int64(2)).passes == 2
    with pytest.raises(ValueError, match="positive integer dimension, got -8"):  # accepted, block 8
        RHTRotation(-8)
    assert rht_block(np.int64(1344)) == 64


def test_a_harp_fit_of_a_transform_without_harp_rotations_or_of_a_negated_hessian_is_refused():
    w, h = torch.randn(64, 128), torch.eye(128)
    with pytest.raises(ValueError, match="HARP fits HARPRotation s, the transform holds RHTRotation"):  # AttributeError
        fit_harp(w, h, _two_sided(rot=RHTRotation), make_grid("int", 2), FitOptions(steps=2))
    with pytest.raises(ValueError, match="128 negative diagonal entries"):  # read as "lower --harp-lr"
        fit_harp(w, -h, _two_sided(), make_grid("int", 2), FitOptions(steps=2))


def test_gptq_and_quantize_layer_name_bad_shapes_options_and_hessians():
    w, grid = torch.randn(64, 128), make_grid("int", 4)
    with pytest.raises(ValueError, match=r"the weight must be 2-D \[out, in\]; it has shape \(128,\)"):
        gptq(w[0], torch.eye(128), grid)
    with pytest.raises(ValueError, match="block=0 must be an integer >= 1"):
        gptq(w, torch.eye(128), grid, block=0)
    with pytest.raises(ValueError, match="damp=nan must be a finite number > 0"):  # "raise --damp" before
        gptq(w, torch.eye(128), grid, damp=float("nan"))
    asym = torch.eye(128)
    asym[0, 5] = 0.5
    with pytest.raises(ValueError, match="not symmetric"):
        gptq(w, asym, grid)
    for method in ("rtn", "rht-rtn"):  # an einsum RuntimeError before
        with pytest.raises(ValueError, match=r"the Hessian \[in, in\]; got \(64, 128\) and \(64, 64\)"):
            quantize_layer(w, torch.eye(64), method, grid, generator=torch.Generator())
    with pytest.raises(ValueError, match="FP16 group scales hold at most 65504"):  # "a bug, please report it" before
        quantize_layer(w * 1e6, torch.eye(128), "rtn", make_grid("int", 2), generator=torch.Generator())


def test_grids_refuse_non_integer_bits_and_group_sizes():
    assert make_grid("int", np.int64(4)).bits == 4
    for args, msg in [(("int", 4.0), "--bits 4.0: must be an integer, not float"), (("mxfp4", 4.0), "--bits 4.0"),
                      (("int", 4, 2.5), "--group-size 2.5: must be an integer"), (("int", 4, True), "--group-size True")]:
        with pytest.raises(ValueError, match=msg):
            make_grid(*args)


def test_int_matvec_and_load_packed_name_their_bad_input(tmp_path):
    codes, scales, x = pack_bits(torch.zeros(8 * 64, dtype=torch.uint8), 4), torch.ones(8, 1, dtype=torch.float16), torch.randn(2, 64)
    with pytest.raises(ValueError, match="group_size=0 must be an int >= 1"):  # ZeroDivisionError before
        int_matvec(x, codes, scales, 8, 64, 4, 0)
    with pytest.raises(ValueError, match="x must be floating point"):
        int_matvec(x.long(), codes, scales, 8, 64, 4, 64)
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="x on cpu \\(CUDA tensors, or the CPU under TRITON_INTERPRET=1\\)"):  # "0 active drivers" before
            int_matvec(x, codes, scales, 8, 64, 4, 64, backend="triton")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a safetensors file"):  # SafetensorError before
        load_packed(cfg)
    art = tmp_path / "ptq_packed.safetensors"
    art.write_bytes(b"")
    from adahop.ptq.decode import load_packed_model

    with pytest.raises(ValueError, match=f"is the packed artifact itself; pass its folder, {tmp_path}"):
        load_packed_model(art)  # it said ".../ptq_packed.safetensors: no ptq_packed.safetensors"
