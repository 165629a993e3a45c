#!/usr/bin/env python
"""Bit-exactness of the fused quantizer against the reference on chosen (shape, axis, Hadamard,
signs, rule) cases, plus stochastic-rounding error against the reference's; used to pin down the
configuration behind tseng's GPU failure (docs/kernels_notes.md).

    python scripts/diag_quantizer.py
"""

from __future__ import annotations

import torch

from adahop.kernels import fold_to_fp8, iht_quantize_mxfp4

dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator(device=dev).manual_seed(0)
CASES = [  # (rows, cols, axis, hb, signs, rule)
    (16384, 128, 1, 64, True, "tseng"), (16384, 128, 1, 64, True, "floor"), (16384, 128, 1, 64, False, "floor"),
    (16384, 128, 1, 32, True, "tseng"), (16384, 256, 1, 64, True, "tseng"), (16384, 512, 1, 64, True, "tseng"),
    (128, 512, 0, 64, True, "tseng"), (128, 512, 0, 32, False, "floor"), (512, 512, 0, 64, True, "tseng"),
]
for r, c, axis, hb, with_signs, rule in CASES:
    x = (torch.randn(r, c, device=dev, generator=g) * 1e-6).bfloat16()
    s = (torch.randint(0, 2, (hb,), device=dev, generator=g).float() * 2 - 1) if with_signs else None
    kw = dict(axis=axis, hadamard_block=hb, signs=s, scale_rule=rule, max_scale_range=8)
    qt = iht_quantize_mxfp4(x, backend="triton", **kw)
    qr = iht_quantize_mxfp4(x, backend="reference", **kw)
    f8r, rsr = fold_to_fp8(qr, backend="reference")
    d = dict(codes=(qt.codes != qr.codes).sum().item(), scales=(qt.scales != qr.scales).sum().item(),
             fp8=(qt.fp8[0].view(torch.uint8) != f8r.view(torch.uint8)).sum().item(), rscale=(qt.fp8[1] != rsr).sum().item())
    rule_sr = "rceil" if rule == "floor" else rule
    ks = dict(kw, scale_rule=rule_sr, rounding="stochastic")
    et = (iht_quantize_mxfp4(x, backend="triton", generator=torch.Generator(device=dev).manual_seed(1), **ks).dequantize() - x.float())
    er = (iht_quantize_mxfp4(x, backend="reference", generator=torch.Generator(device=dev).manual_seed(1), **ks).dequantize() - x.float())
    qsr = iht_quantize_mxfp4(x, backend="triton", generator=torch.Generator(device=dev).manual_seed(1), **ks)
    fa, fs = qsr.fp8
    sr_fold = ((fa.float() * fs[:, None]).norm() / qsr.dequantize().norm()).item()
    print(f"{r}x{c} ax{axis} hb{hb} signs={with_signs} {rule}: RNE diffs {d} | SR err rms triton/ref "
          f"{(et.norm() / er.norm()).item():.3f} | SR fp8-cache norm / dequant norm {sr_fold:.4g}", flush=True)
