#!/usr/bin/env python
"""Validate adahop's GPU kernels against their PyTorch references, on fresh random inputs.

Checks, each printed as PASS/FAIL with its numbers:

- ``iht_quantize_mxfp4`` (Triton) vs the reference, round-to-nearest: codes, E8M0 scales and the
  FP8 fold bit for bit, into poisoned output buffers (two poisons: every byte must be written),
  for axis 0 and 1, bf16/fp32, ragged dims, strided views (Wᵀ, ∇Yᵀ), Hadamard 16/32/64 with
  signs, every scale rule, NaN/Inf blocks;
- stochastic rounding: scales bit-exact, codes unbiased (t-statistics of the error's mean and of
  its slope against the value), error spread equal to the reference's, fresh across calls,
  reproducible under a seed;
- ``mx_matmul`` vs the reference (float64 product of the dequantized operands), also through
  ``fold_to_fp8`` (no fp8 cache) and for ragged M/N: with ``accumulation="fp32"`` (the FP8-exact
  operands on the BF16 tensor cores) error ≤ 1e-5 of ‖A·B‖ (FP32-accumulation rounding, the
  DESIGN.md §4 criterion); with the default FP8 tensor cores error ≤ 2.5e-4 (2^-12) of ‖|A|·|B|‖:
  Hopper's FP8 MMA adds each instruction's 32 products below FP32 (`scripts/diag_gemm.py`,
  docs/kernels_notes.md), so that path is held to the hardware's bound, which any layout, scale or
  padding bug exceeds by orders of magnitude;
- a sweep of contracted lengths 32…2048 × Hadamard blocks (none, 16…256) × both axes, which
  covers every tile plan of the quantizer (a [64, 4, 32] tile once compiled wrong on sm_90);
- ``fold_to_fp8`` (Triton, the backward's unpack of saved packed MXFP4) vs the reference fold,
  byte for byte, with its time;
- ``rivals``: ``nvfp4_matmul`` on the BF16 tensor cores (exact ``q·s_block`` operands, FP32 sums)
  vs the float64 product of the dequantized operands and the FP32 reference, ≤ 1e-5 of ‖A·B‖, eager
  and compiled, with its time against the FP32 reference; ``block_hadamard`` of whole dimensions
  above 256 (HALO's Kronecker form) vs the butterfly it replaced; the quantizer with a Hadamard
  block above 256 (butterfly, then the kernel) bit for bit; nvfp4 / averis / halo-2 layers replayed
  from CUDA graphs;
- ``nvfp4``: ``iht_quantize_nvfp4`` (Triton) vs the reference, round to nearest: codes, E4M3 block
  scales, the FP32 tensor scale and the BF16 GEMM operand bit for bit, into poisoned buffers, for
  1×16 blocks along either axis, 16×16 tiles, ragged rows and Kc, strided views (Wᵀ, ∇Yᵀ), the
  wgrad RHT-16 with TE's signs, NaN/Inf blocks, a given tensor scale, OE's zeroed rows, with its
  time against the reference; stochastic rounding (the reference's scales bit for bit, every code
  one of its two grid neighbours, t-statistics of the error's mean and slope, fresh, seeded); the
  decode of saved operands bit for bit; an nvfp4 / averis layer's forward+backward on the Triton
  path vs the reference backend (y to FP32 rounding, gradients as close to BF16's) and its time;
- ``torch.compile(fullgraph=True)`` of quantize + GEMM equals eager;
- the fused optimizer step (``optim``): every algorithm, BF16/FP32 weights and states, RNE and
  stochastic rounding, bit for bit against its reference under a fixed Philox seed.

Exits 1 if any check fails. ``--small`` runs tiny shapes (also on the CPU under TRITON_INTERPRET=1).
Usage: ``python scripts/validate_kernels.py [--small] [--log PATH] [--only gemm,compile]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch

try:
    import triton  # noqa: F401
except ImportError:
    sys.exit("validate_kernels.py checks the Triton kernels: install them with pip install -e '.[triton]' (or '.[test]')")

from adahop.bench import cuda_time_ms
from adahop.formats import quantize_nvfp4
from adahop.hadamard import block_hadamard
from adahop.kernels import fold_to_fp8, hadamard_butterfly, iht_quantize_mxfp4, mx_matmul, mx_transpose
from adahop.kernels import iht_quantize_nvfp4, nvfp4_block_values, nvfp4_matmul, nvfp4_matmul_reference
from adahop.kernels import _triton_quantize as tq

RESULTS: list[dict] = []


def record(name: str, ok: bool, **detail) -> None:
    RESULTS.append(dict(name=name, ok=bool(ok), **detail))
    info = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in detail.items())
    print(f"{'PASS' if ok else 'FAIL'}  {name:58s} {info}", flush=True)


def make_input(shape, dtype, dev, gen, special=False):
    """Gaussian rows with per-row scales 2^-8..2^8 and a few outlier channels (never zeros)."""
    r, c = shape
    x = torch.randn(r, c, device=dev, generator=gen)
    x *= torch.exp2(torch.randint(-8, 9, (r, 1), device=dev, generator=gen).float())
    cols = torch.randint(0, c, (max(1, c // 256),), device=dev, generator=gen)
    x[:, cols] *= 64.0  # channel outliers
    if special:
        x[1, 3] = float("nan")
        x[2, 7] = float("inf")
        x[3, :] *= 1e-30  # a tiny row
        x[4, : min(c, 40)] *= 1e12  # a huge block in a normal row: range clamp
    return x.to(dtype)


def poisoned(rows, kp, fp8: bool, byte: int, dev):
    return (torch.full((rows, kp // 2), byte, dtype=torch.uint8, device=dev),
            torch.full((rows, kp // 32), byte, dtype=torch.uint8, device=dev),
            torch.full((rows, kp) if fp8 else (0,), byte, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn),
            torch.full((rows,) if fp8 else (0,), float("nan"), device=dev))


def check_quantize(name, x, axis, hb=32, signs=None, rule="floor", msr=8):
    rows, kc = (x.shape[0], x.shape[1]) if axis == 1 else (x.shape[1], x.shape[0])
    kp = -(-kc // 32) * 32
    fp8 = msr is not None and msr <= 8
    outs = []
    for byte in (0x00, 0xFF):
        outs.append(tq.mx_quantize(x, axis, hb or 0, signs, False, rule, -1 if msr is None else msr, None,
                                   out=poisoned(rows, kp, fp8, byte, x.device)))
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*outs))
    qr = iht_quantize_mxfp4(x, axis=axis, hadamard_block=hb, signs=signs, scale_rule=rule, max_scale_range=msr,
                            backend="reference")
    codes, scales, f8, rs = outs[0]
    bad_codes = (codes != qr.codes).sum().item()
    bad_scales = (scales != qr.scales).sum().item()
    bad_fp8 = 0
    if fp8:
        rf8, rrs = fold_to_fp8(qr, backend="reference")
        bad_fp8 = (f8.view(torch.uint8) != rf8.view(torch.uint8)).sum().item() + (rs != rrs).sum().item()
    q = iht_quantize_mxfp4(x, axis=axis, hadamard_block=hb, signs=signs, scale_rule=rule, max_scale_range=msr,
                           backend="triton")
    api = torch.equal(q.codes, codes) and torch.equal(q.scales, scales) and (q.fp8 is not None) == fp8
    record(f"quant {name}", same and api and bad_codes == 0 and bad_scales == 0 and bad_fp8 == 0,
           full_write=same, codes_diff=bad_codes, scales_diff=bad_scales, fp8_diff=bad_fp8)


def check_outputs(name, x, axis, n_zero=64):
    """``outputs="fp8"`` / ``"codes"`` and OE's ``zero_rows`` against the reference of
    ``x.index_fill(1 - axis, rows, 0)``, into poisoned buffers (every byte must be written)."""
    rows, kc = (x.shape[0], x.shape[1]) if axis == 1 else (x.shape[1], x.shape[0])
    kp = -(-kc // 32) * 32
    idx = torch.randperm(rows, device=x.device)[:n_zero]
    keep = torch.ones(rows, dtype=torch.uint8, device=x.device).index_fill_(0, idx, 0)
    qr = iht_quantize_mxfp4(x.index_fill(1 - axis, idx, 0), axis=axis, max_scale_range=8, backend="reference")
    rf8, rrs = fold_to_fp8(qr, backend="reference")
    diffs = {}
    for what, codes_on, fp8_on in (("fp8", False, True), ("codes", True, False)):
        outs = []
        for byte in (0x00, 0xFF):
            c, sc, f8, rs = poisoned(rows, kp, fp8_on, byte, x.device)
            out = (c[:, :0] if not codes_on else c, sc, f8, rs)
            outs.append(tq.mx_quantize(x, axis, 32, None, False, "floor", 8, None, codes_on, fp8_on, keep, out=out))
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*outs))
        c, sc, f8, rs = outs[0]
        bad = int((sc != qr.scales).sum()) + (0 if same else 1)
        bad += int((c != qr.codes).sum()) if codes_on else 0
        if fp8_on:
            bad += int((f8.view(torch.uint8) != rf8.view(torch.uint8)).sum()) + int((rs != rrs).sum())
        diffs[what] = bad
    record(f"outputs+zero_rows {name}", all(v == 0 for v in diffs.values()),
           fp8_only_diff=diffs["fp8"], codes_only_diff=diffs["codes"])


def check_stochastic(name, x, axis, gen_seed=0):
    dev = x.device
    kw = dict(axis=axis, rounding="stochastic", scale_rule="rceil")
    g = torch.Generator(device=dev).manual_seed(gen_seed)
    qt = iht_quantize_mxfp4(x, generator=g, backend="triton", **kw)
    qt2 = iht_quantize_mxfp4(x, generator=g, backend="triton", **kw)
    qt3 = iht_quantize_mxfp4(x, generator=torch.Generator(device=dev).manual_seed(gen_seed), backend="triton", **kw)
    qr = iht_quantize_mxfp4(x, generator=torch.Generator(device=dev).manual_seed(1), backend="reference", **kw)
    v = hadamard_butterfly(x, block_size=32, axis=axis).double()

    def stats(q):  # t-statistics of the error's mean and of its slope against v (robust SE)
        e = q.dequantize().double() - v
        t_mean = (e.mean() / (e.std() / e.numel() ** 0.5)).item()
        vv = (v * v).sum()
        t_slope = ((e * v).sum() / vv / ((v * v * e * e).sum().sqrt() / vv)).item()
        return t_mean, t_slope, e.pow(2).mean().sqrt().item()

    t_mean, t_slope, rms_t = stats(qt)
    r_mean, r_slope, rms_r = stats(qr)
    spread = rms_t / rms_r
    tol = 0.02 if x.numel() > 10**6 else 0.1
    f8, rs = fold_to_fp8(qt, backend="reference")
    fold_ok = torch.equal(f8.view(torch.uint8), qt.fp8[0].view(torch.uint8)) and torch.equal(rs, qt.fp8[1])
    ok = (torch.equal(qt.scales, qr.scales) and abs(t_mean) < 6 and abs(t_slope) < 6 and abs(spread - 1) < tol
          and not torch.equal(qt.codes, qt2.codes) and torch.equal(qt.codes, qt3.codes) and fold_ok)
    record(f"SR {name}", ok, t_mean=t_mean, t_slope=t_slope, ref_t_mean=r_mean, ref_t_slope=r_slope,
           rms_vs_ref=spread, fold_ok=fold_ok,
           fresh=not torch.equal(qt.codes, qt2.codes), seeded=torch.equal(qt.codes, qt3.codes))


def check_gemm(name, m, kc, n, dev, gen, hb=32, via_fold=False):
    a = make_input((m, kc), torch.bfloat16, dev, gen)
    b = make_input((n, kc), torch.bfloat16, dev, gen).t()  # [Kc, N] view of a row-major [N, Kc]: like Wᵀ
    be = "reference" if via_fold else "auto"
    qa = iht_quantize_mxfp4(a, axis=1, hadamard_block=hb, backend=be)
    qb = iht_quantize_mxfp4(b, axis=0, hadamard_block=hb, backend=be)
    da, db = qa.dequantize().double(), qb.dequantize().double()
    ref = da @ db
    scale = (da.abs() @ db.abs()).norm()  # the size of FP32-accumulation rounding: |A|·|B|
    out = mx_matmul(qa, qb, backend="triton")
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    rel_ab = ((out.double() - ref).norm() / scale).item()
    out16 = mx_matmul(qa, qb, backend="triton", out_dtype=torch.bfloat16)
    rel16 = ((out16.double() - ref).norm() / ref.norm()).item()
    exact = mx_matmul(qa, qb, backend="triton", accumulation="fp32")
    rel_x = ((exact.double() - ref).norm() / ref.norm()).item()
    ok = (out.shape == exact.shape == (m, n) and torch.isfinite(out).all().item() and rel_ab <= 2.5e-4
          and rel16 <= 1e-2 and rel_x <= 1e-5)
    record(f"gemm {name}", ok, fp8_mma_rel_to_absAB=rel_ab, fp8_mma_rel=rel, fp8_mma_rel_bf16_out=rel16,
           fp32_accumulation_rel=rel_x, cached_fp8=qa.fp8 is not None)


def check_gemm_unfoldable(name, m, kc, n, dev, gen):
    """msr-none operands (no exponent-range limit) with one massive activation in every 64th row:
    no FP8 fold, so mx_matmul takes the BF16 GEMM of the dequantized operands (mx_matmul_dequant);
    its quantizer codes must equal the reference's bit for bit, its product the FP64 one to FP32 sums."""
    a = make_input((m, kc), torch.bfloat16, dev, gen)
    a[::64, 7] = 1e4  # a token carrying one massive activation (issue 19's msr arm)
    b = make_input((n, kc), torch.bfloat16, dev, gen).t()
    qa = iht_quantize_mxfp4(a, axis=1, hadamard_block=None, max_scale_range=None, backend="triton")
    qb = iht_quantize_mxfp4(b, axis=0, hadamard_block=32, max_scale_range=None, backend="triton")
    ra = iht_quantize_mxfp4(a, axis=1, hadamard_block=None, max_scale_range=None, backend="reference")
    same = torch.equal(qa.codes, ra.codes) and torch.equal(qa.scales, ra.scales)
    da, db = qa.dequantize().double(), qb.dequantize().double()
    ref, scale = da @ db, (da.abs() @ db.abs()).norm()
    out = mx_matmul(qa, qb, backend="triton")
    rel_ab = ((out.double() - ref).norm() / scale).item()
    row_e = (qa.scales.to(torch.int32).amax(1) - qa.scales.to(torch.int32).amin(1)).amax().item()
    record(f"gemm {name} msr-none (BF16 GEMM of exact operands)", same and rel_ab <= 1e-5 and row_e > 8,
           codes_equal_reference=same, rel_to_absAB=rel_ab, max_row_exponent_range=row_e)


def check_nvfp4_gemm(name, m, kc, n, dev, gen, tile_b=True, rounding="nearest"):
    """``nvfp4_matmul`` on the BF16 tensor cores (exact q·s_block operands, FP32 sums, tensor scales
    after) vs the float64 product of the dequantized operands and vs the FP32 reference; also
    compiled (``adahop::fp8_rowwise_mm``) and with a bfloat16 output."""
    a = make_input((m, kc), torch.bfloat16, dev, gen)
    b = make_input((n, kc), torch.bfloat16, dev, gen).t()  # [Kc, N] view of a row-major [N, Kc]: like Wᵀ
    qa = quantize_nvfp4(a, axis=1, rounding=rounding, generator=gen)
    qb = quantize_nvfp4(b, axis=0, tile_2d=tile_b)
    exact = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64)
    out = nvfp4_matmul(qa, qb, backend="triton")
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    rel_ref = ((out - nvfp4_matmul_reference(qa, qb)).double().norm() / exact.norm()).item()
    out16 = nvfp4_matmul(qa, qb, backend="triton", out_dtype=torch.bfloat16)
    rel16 = ((out16.double() - exact).norm() / exact.norm()).item()
    try:
        comp = torch.compile(lambda x, y: nvfp4_matmul(x, y, backend="triton"), fullgraph=True)(qa, qb)
        rel_c, err = ((comp.double() - exact).norm() / exact.norm()).item(), ""
    except Exception as e:  # noqa: BLE001 - reported as a FAIL
        rel_c, err = float("inf"), f"{type(e).__name__}: {str(e)[:200]}"
    ok = (out.shape == (m, n) and out.dtype == torch.float32 and rel <= 1e-5 and rel_ref <= 1e-5 and rel16 <= 1e-2
          and rel_c <= 1e-5)
    detail = dict(rel=rel, rel_to_fp32_reference=rel_ref, rel_bf16_out=rel16, rel_compiled=rel_c)
    if err:
        detail["error"] = err
    if dev == "cuda":
        detail.update(us_bf16=1e3 * cuda_time_ms(lambda: nvfp4_matmul(qa, qb, backend="triton")),
                      us_fp32_reference=1e3 * cuda_time_ms(lambda: nvfp4_matmul_reference(qa, qb), reps=3))
    record(f"nvfp4 gemm {name}", ok, **detail)


def check_large_block_quantize(name, x, axis, hb, signs=None):
    """``iht_quantize_mxfp4`` with a Hadamard block above 256 (HALO's whole-dimension fprop transform):
    the Kronecker form, then the kernel without a transform, vs the reference, bit for bit, with its time
    (788 µs at 16384 × 512 with the butterfly, round 13)."""
    q = iht_quantize_mxfp4(x, axis=axis, hadamard_block=hb, signs=signs, backend="triton")
    qr = iht_quantize_mxfp4(x, axis=axis, hadamard_block=hb, signs=signs, backend="reference")
    bad = (q.codes != qr.codes).sum().item() + (q.scales != qr.scales).sum().item()
    if q.fp8 is not None:
        rf8, rrs = fold_to_fp8(qr, backend="reference")
        bad += (q.fp8[0].view(torch.uint8) != rf8.view(torch.uint8)).sum().item() + (q.fp8[1] != rrs).sum().item()
    detail = dict(diff=bad)
    if x.is_cuda:
        detail.update(us_triton=1e3 * cuda_time_ms(lambda: iht_quantize_mxfp4(x, axis=axis, hadamard_block=hb, backend="triton")),
                      us_reference=1e3 * cuda_time_ms(lambda: iht_quantize_mxfp4(x, axis=axis, hadamard_block=hb,
                                                                                  backend="reference"), reps=3))
    record(f"quant {name}", bad == 0 and q.fp8 is not None, **detail)


def check_kron_hadamard(name, shape, axis, dev, gen):
    """``block_hadamard`` of a whole dimension above 256 (the Kronecker form, HALO) vs the butterfly
    it replaced, in float64; with its time against the butterfly's."""
    from adahop.hadamard import _fwht

    x = torch.randn(*shape, device=dev, generator=gen)
    n = shape[axis]
    y = block_hadamard(x, block_size=n, axis=axis)
    ref = (_fwht(x.double().movedim(axis, -1)) / n**0.5).movedim(-1, axis)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    detail = dict(rel=rel)
    if dev == "cuda":
        detail.update(us_kronecker=1e3 * cuda_time_ms(lambda: block_hadamard(x, block_size=n, axis=axis)),
                      us_butterfly=1e3 * cuda_time_ms(lambda: _fwht(x.movedim(axis, -1).contiguous()) / n**0.5))
    record(f"hadamard {name}", rel <= 1e-6 and y.shape == x.shape, **detail)


def check_hadamard_tf32(dev, gen):
    """``block_hadamard`` in FP32 under ``torch.set_float32_matmul_precision("high")`` (TF32 GEMMs, which an
    Inductor warning asks users to turn on), dense blocks (≤ 256) and the Kronecker form: as exact as FP32."""
    from adahop.hadamard import _fwht

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        for b in (32, 256, 1024):
            x = torch.randn(4096, 1024, device=dev, generator=gen)
            y = block_hadamard(x, block_size=b, axis=1)
            ref = _fwht(x.double().reshape(4096, -1, b)).reshape(4096, 1024) / b**0.5
            rel = ((y.double() - ref).norm() / ref.norm()).item()
            record(f"hadamard block {b} under TF32 precision", rel <= 1e-6, rel=rel)
    finally:
        torch.set_float32_matmul_precision(before)


def check_fold(name, x, axis, rule="floor"):
    """The Triton fold of a saved (packed) operand vs the reference fold, byte for byte."""
    hb = 32 if x.shape[axis] % 32 == 0 else None
    q = iht_quantize_mxfp4(x, axis=axis, hadamard_block=hb, scale_rule=rule, backend="reference")
    q = dataclasses.replace(q, fp8=None)
    ft, st = fold_to_fp8(q, backend="triton")
    fr, sr = fold_to_fp8(q, backend="reference")
    bad = (ft.view(torch.uint8) != fr.view(torch.uint8)).sum().item() + (st != sr).sum().item()
    detail = {}
    if x.is_cuda:
        detail = dict(us_triton=1e3 * cuda_time_ms(lambda: fold_to_fp8(q, backend="triton")),
                      us_reference=1e3 * cuda_time_ms(lambda: fold_to_fp8(q, backend="reference"), reps=3))
    record(f"fold {name}", bad == 0 and ft.shape == fr.shape, diff=bad, **detail)


def check_nvfp4_quantize(name, x, axis, hb=None, signs=None, tile=False, gs=None, zero=None):
    """``iht_quantize_nvfp4`` (Triton) vs the reference, round to nearest, bit for bit: codes, E4M3 scales,
    tensor scale and BF16 values (against the GEMM's own build from the reference codes), written into
    poisoned buffers (two poisons: every byte must be written); with its time against the reference."""
    from adahop.kernels import _triton_quantize_nvfp4 as nq

    rows, kc = (x.shape[0], x.shape[1]) if axis == 1 else (x.shape[1], x.shape[0])
    kp = -(-kc // 16) * 16
    kw = dict(axis=axis, hadamard_block=hb, signs=signs, tile_2d=tile, global_scale=gs, zero_rows=zero)
    qr = iht_quantize_nvfp4(x, backend="reference", **kw)
    want = (qr.codes, qr.scales.view(torch.uint8), qr.global_scale.reshape(1), nvfp4_block_values(qr, backend="reference"))
    keep = None
    if zero is not None:
        keep = torch.ones(rows, dtype=torch.uint8, device=x.device).index_fill_(0, zero, 0)
    outs = []
    for byte in (0x00, 0xFF):
        out = (torch.full((rows, kp // 2), byte, dtype=torch.uint8, device=x.device),
               torch.full((rows, kp // 16), byte, dtype=torch.uint8, device=x.device),
               torch.full((), float("nan"), device=x.device),
               torch.full((rows, 2 * kp), byte, dtype=torch.uint8, device=x.device).view(torch.bfloat16))
        got = nq.nv_quantize(x, axis, hb or 0, signs, False, tile, None,
                             None if gs is None else gs.reshape(1).float(), True, True, keep, out=out)
        outs.append([got[0], got[1].view(torch.uint8), got[2].reshape(1), got[3]])
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    same = all(torch.equal(bits(a), bits(b)) for a, b in zip(*outs))
    diffs = [int((bits(a) != bits(b)).sum()) for a, b in zip(outs[0][:3], want[:3])]
    v, w = outs[0][3], want[3]
    diffs.append(int((v.isnan() != w.isnan()).sum() + (v.nan_to_num() != w.nan_to_num()).sum()))
    q = iht_quantize_nvfp4(x, backend="triton", outputs="values", **kw)
    api = q.codes_dropped and torch.equal(bits(q.values), bits(outs[0][3])) and torch.equal(bits(q.scales), bits(want[1]))
    detail = dict(full_write=same, codes_diff=diffs[0], scales_diff=diffs[1], gs_diff=diffs[2], values_diff=diffs[3])
    if x.is_cuda:
        detail.update(us_triton=1e3 * cuda_time_ms(lambda: iht_quantize_nvfp4(x, backend="triton", outputs="values", **kw)),
                      us_reference=1e3 * cuda_time_ms(lambda: iht_quantize_nvfp4(x, backend="reference", **kw), reps=3))
    record(f"nvfp4 quant {name}", same and api and not any(diffs), **detail)


def check_nvfp4_plan(name, x, axis, hb=None, signs=None, tile=False):
    """The default plan for rows contiguous (the K-major transposing tile, `transposing_plan`, since
    round 15) vs the row tile it replaced (`row_tile_plan`): the same bytes (codes, scales, tensor
    scale, values) and both times."""
    from adahop.kernels import _triton_quantize_nvfp4 as nq

    args = (x, axis, hb or 0, signs, False, tile, None, None, True, True, None)
    old = nq.row_tile_plan(hb or 0, tile)
    want, got = nq.nv_quantize(*args, plan=old), nq.nv_quantize(*args)
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    same = all(torch.equal(bits(a), bits(b)) for a, b in zip(want, got))
    detail = {}
    if x.is_cuda:
        t0 = 1e3 * cuda_time_ms(lambda: nq.nv_quantize(*args, plan=old))
        t1 = 1e3 * cuda_time_ms(lambda: nq.nv_quantize(*args))
        detail = dict(us_row_tile=t0, us_default=t1, speedup=t0 / t1)
    record(f"nvfp4 plan {name}", same, **detail)


def check_nvfp4_stochastic(name, x, axis, hb=None, signs=None, tile=False):
    """SR: the reference's block and tensor scales bit for bit (the scale rounded up), every value one of
    the two grid neighbours of the scaled input, t-statistics of the error's mean and of its slope against
    the value, the error spread (RMS in units of each block's scale) equal to the reference's, fresh
    across calls, reproducible under a seed."""
    from adahop.formats.e2m1 import E2M1_VALUES

    dev = x.device
    kw = dict(axis=axis, hadamard_block=hb, signs=signs, tile_2d=tile, rounding="stochastic")
    g = torch.Generator(device=dev).manual_seed(0)
    qt, qt2 = (iht_quantize_nvfp4(x, generator=g, backend="triton", **kw) for _ in range(2))
    qt3 = iht_quantize_nvfp4(x, generator=torch.Generator(device=dev).manual_seed(0), backend="triton", **kw)
    qr = iht_quantize_nvfp4(x, generator=torch.Generator(device=dev).manual_seed(1), backend="reference", **kw)
    v = x.float() if hb is None else hadamard_butterfly(x, block_size=hb, axis=axis, signs=signs)
    vm = v.movedim(axis, -1)
    vm = torch.nn.functional.pad(vm, (0, qr.scales.shape[1] * 16 - vm.shape[-1]))
    sb = qr.scales.float().repeat_interleave(16, dim=-1)
    a = (vm / (qr.scales.float() * qr.global_scale).repeat_interleave(16, dim=-1)).abs().clamp(max=6.0).contiguous()
    grid = E2M1_VALUES.to(dev)
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 7)
    hi = torch.where(grid[lo] < a, lo + 1, lo).clamp(max=7)
    got = qt.values.float().abs()
    neighbours = bool(((got == grid[lo] * sb) | (got == grid[hi] * sb) | (sb == 0)).all())

    denom = (qr.scales.float() * qr.global_scale).repeat_interleave(16, dim=-1).double()
    vd = vm.double()

    def stats(q):  # t-statistics of the error's mean and of its slope against v (robust SE); RMS in grid units
        d = q.dequantize().movedim(axis, -1).double()
        e = torch.nn.functional.pad(d, (0, vm.shape[-1] - d.shape[-1])) - vd
        t_mean = (e.mean() / (e.std() / e.numel() ** 0.5)).item()
        vv = (vd * vd).sum()
        t_slope = ((e * vd).sum() / vv / ((vd * vd * e * e).sum().sqrt() / vv)).item()
        return t_mean, t_slope, (e / denom)[denom > 0].pow(2).mean().sqrt().item()

    (t_mean, t_slope, rms_t), (r_mean, r_slope, rms_r) = stats(qt), stats(qr)
    spread = rms_t / rms_r
    scales_ok = torch.equal(qt.scales.view(torch.uint8), qr.scales.view(torch.uint8)) and torch.equal(
        qt.global_scale, qr.global_scale)
    fresh, seeded = not torch.equal(qt.values, qt2.values), torch.equal(qt.values, qt3.values)
    tol = 0.02 if x.numel() > 10**6 else 0.1
    ok = (scales_ok and neighbours and abs(t_mean) < 6 and abs(t_slope) < 6 and abs(spread - 1) < tol and fresh
          and seeded)
    record(f"nvfp4 SR {name}", ok, scales_ok=scales_ok, neighbours=neighbours, t_mean=t_mean, t_slope=t_slope,
           ref_t_mean=r_mean, ref_t_slope=r_slope, rms_vs_ref=spread, fresh=fresh, seeded=seeded)


def check_nvfp4_decode(name, x, axis, tile=False):
    """The decode of a saved packed NVFP4 operand (Triton) vs the gather build, bit for bit, with its time."""
    q = iht_quantize_nvfp4(x, axis=axis, tile_2d=tile, backend="reference")
    got, want = nvfp4_block_values(q, backend="triton"), nvfp4_block_values(q, backend="reference")
    nan_diff = got.isnan() != want.isnan()
    bits_diff = got.nan_to_num().view(torch.int16) != want.nan_to_num().view(torch.int16)
    bad = int(nan_diff.sum() + bits_diff.sum())
    detail = dict(diff=bad)
    if bad:  # the first mismatch with its code and scale bytes, to tell a layout from an arithmetic fault
        i, k = (nan_diff | bits_diff).nonzero()[0].tolist()
        detail.update(first=(i, k, got[i, k].item(), want[i, k].item(), int(q.codes[i, k // 2]),
                             int(q.scales.view(torch.uint8)[i, k // 16])))
    if x.is_cuda:
        detail.update(us_triton=1e3 * cuda_time_ms(lambda: nvfp4_block_values(q, backend="triton")),
                      us_reference=1e3 * cuda_time_ms(lambda: nvfp4_block_values(q, backend="reference")))
    record(f"nvfp4 decode {name}", bad == 0 and got.shape == want.shape, **detail)


def check_nvfp4_layer(recipe, t, k, n, dev, gen):
    """One converted nvfp4 / averis layer, eager, forward+backward on the Triton path (fused quantizer,
    BF16 operands) vs the reference backend: nvfp4's y (RNE) to FP32 rounding, every output as close to
    the BF16 layer's as the reference's (the SR draws differ); with both times."""
    import adahop

    x = make_input((t, k), torch.float32, dev, gen)
    x = x / x.abs().amax(dim=1, keepdim=True)  # no row scales: the BF16 comparison is about quantization

    def layer(backend):
        torch.manual_seed(0)
        lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(dev)
        return lin if backend is None else adahop.convert_model(lin, recipe, backend=backend, exclude=())

    def run(lin):
        lin.zero_grad(set_to_none=True)
        xin = x.detach().requires_grad_(True)
        y = lin(xin)
        y.square().sum().backward()
        return [y.detach(), xin.grad, lin[0].weight.grad]

    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    bf, lt, lr = layer(None), layer("triton"), layer("reference")
    exact, got, ref = run(bf), run(lt), run(lr)
    errs_t, errs_r = [rel(a, e) for a, e in zip(got, exact)], [rel(a, e) for a, e in zip(ref, exact)]
    ok = all(et <= 1.5 * er + 0.01 for et, er in zip(errs_t, errs_r)) and all(map(math.isfinite, errs_t))
    detail = dict(rel_to_bf16_triton=[f"{v:.2e}" for v in errs_t], rel_to_bf16_reference=[f"{v:.2e}" for v in errs_r])
    if recipe == "nvfp4":
        detail["y_rel_to_reference"] = rel(got[0], ref[0])
        ok = ok and detail["y_rel_to_reference"] <= 1e-5
    if dev == "cuda":
        detail.update(ms_triton=cuda_time_ms(lambda: run(lt)), ms_reference=cuda_time_ms(lambda: run(lr), reps=5),
                      ms_bf16=cuda_time_ms(lambda: run(bf)))
    record(f"nvfp4 layer {recipe} {t}x{k}x{n} eager, Triton path vs reference backend", ok, **detail)


def converted_layer_grads(x, recipe: str, dev, out_features: int, *, compiled: bool, mode: str | None = None,
                          steps: int = 1) -> list[torch.Tensor]:
    """[y, dX, dW] of one bias-free linear [x.shape[1] -> out_features] converted to ``recipe``, after
    ``steps`` forward/backward passes of ``sum(y^2)`` (reduce-overhead: warm-up, recording, replays)."""
    import adahop

    torch.manual_seed(0)
    lin = adahop.convert_model(torch.nn.Sequential(torch.nn.Linear(x.shape[1], out_features, bias=False)).to(dev), recipe)
    f = torch.compile(lin, fullgraph=True, mode=mode) if compiled else lin
    for _ in range(steps):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        lin.zero_grad(set_to_none=True)
        xin = x.detach().float().requires_grad_(True)
        y = f(xin)
        y.square().sum().backward()
    # copies: under reduce-overhead all three live in the CUDA-graph pool, which the next replay overwrites
    # and torch.compiler.reset() frees (round 31: a later check then read freed memory)
    return [y.detach().clone(), xin.grad.clone(), lin[0].weight.grad.clone()]


def check_compile(dev, gen):
    x = make_input((256, 512), torch.bfloat16, dev, gen)
    w = make_input((384, 512), torch.bfloat16, dev, gen)

    def fprop(x, w):  # Y = X · Wᵀ
        qx = iht_quantize_mxfp4(x, axis=1)
        qw = mx_transpose(iht_quantize_mxfp4(w, axis=1))
        return mx_matmul(qx, qw, out_dtype=torch.bfloat16)

    try:
        y = torch.compile(fprop, fullgraph=True)(x, w)
        ok, err = torch.equal(y, fprop(x, w)), ""
    except Exception as e:  # noqa: BLE001 - reported as a FAIL
        ok, err = False, f"{type(e).__name__}: {str(e)[:200]}"
    record("torch.compile(fullgraph) fprop == eager", ok, **({"error": err} if err else {}))

    # a whole converted layer, forward and backward, without a bias: torch 2.11 gave its gradient to a
    # duplicate output of the traced autograd function (round 4's lost gradients, docs/benchmarks_history.md)
    from adahop.nn.opaque import set_compiled_layers

    def layer_grads(compiled: bool, recipe: str = "mxfp4-had", mode: str | None = None, steps: int = 1):
        return converted_layer_grads(x, recipe, dev, 384, compiled=compiled, mode=mode, steps=steps)

    # each form of a compiled converted layer (adahop.nn.opaque), and the opaque ops replayed from a CUDA graph
    for form, mode, steps in (("opaque", None, 1), ("traced", None, 1), ("opaque", "reduce-overhead", 4)):
        prev = set_compiled_layers(form)
        try:
            torch.compiler.reset()
            eager, comp = layer_grads(False), layer_grads(True, mode=mode, steps=steps)
            errs = [float((c - e).norm() / e.norm()) if c is not None else float("inf") for e, c in zip(eager, comp)]
            ok, err = max(errs) <= 1e-5 and all(e.norm() > 0 for e in eager), ""
        except Exception as e:  # noqa: BLE001 - reported as a FAIL
            ok, err, errs = False, f"{type(e).__name__}: {str(e)[:200]}", []
        finally:
            set_compiled_layers(prev)
        record(f"torch.compile converted layer (no bias, {form}, mode {mode or 'default'}): y, dX, dW == eager", ok,
               **({"error": err} if err else {"rel_err_y_dx_dw": [f"{v:.1e}" for v in errs]}))
    # a recipe that draws random bits inside the opaque ops, replayed from a CUDA graph: it must capture and
    # give finite, nonzero gradients (its draws differ from eager mode's, so no equality)
    try:
        torch.compiler.reset()
        got = layer_grads(True, recipe="tseng", mode="reduce-overhead", steps=4)
        ok, err = all(bool(torch.isfinite(t).all()) and float(t.norm()) > 0 for t in got), ""
    except Exception as e:  # noqa: BLE001 - reported as a FAIL
        ok, err = False, f"{type(e).__name__}: {str(e)[:200]}"
    record("torch.compile tseng layer (opaque, reduce-overhead): captures, finite nonzero y, dX, dW", ok,
           **({"error": err} if err else {}))


def check_rival_layers(dev, gen):
    """A converted nvfp4 / averis / halo-2 layer (512 features, 512 tokens: the NVFP4 quantizer and GEMM,
    HALO's Kronecker Hadamards) compiled with mode="reduce-overhead", as ``adahop train --compile`` runs
    it (the default form, ``adahop.nn.opaque.layer_form``: the opaque ops replayed from a CUDA graph,
    the NVFP4 quantizer's launches inside them; ``ADAHOP_COMPILED_LAYERS=traced`` checks the traced
    form): it captures, with no
    graph skipped by CUDA graphs (a CPU input, e.g. a constant's master copy, would make Inductor
    skip the whole graph), and gives finite, nonzero y, dX, dW; the deterministic halo-2 equals
    eager, and so does nvfp4's y (its fprop rounds to nearest)."""
    from adahop.compile_modes import dynamo_counts
    from adahop.nn.opaque import layer_form
    from adahop.recipes import get_recipe
    from adahop.recipes.spec import GEMMS

    x = make_input((512, 512), torch.float32, dev, gen)
    for recipe in ("nvfp4", "averis", "halo-2"):
        form = layer_form({g: get_recipe(recipe).gemm(g) for g in GEMMS})
        try:
            torch.compiler.reset()
            skips = dynamo_counts()["cudagraph_skips"]
            got = converted_layer_grads(x, recipe, dev, 512, compiled=True, mode="reduce-overhead", steps=4)
            skips = dynamo_counts()["cudagraph_skips"] - skips
            eager = converted_layer_grads(x, recipe, dev, 512, compiled=False)
            ok, err = skips == 0 and all(bool(torch.isfinite(t).all()) and float(t.norm()) > 0 for t in got), ""
            errs = [float((c - e).norm() / e.norm()) for c, e in zip(got, eager)]
            if recipe == "halo-2":
                ok = ok and max(errs) <= 1e-5
            if recipe == "nvfp4":
                ok = ok and errs[0] <= 1e-5
        except Exception as e:  # noqa: BLE001 - reported as a FAIL
            ok, err, errs, skips = False, f"{type(e).__name__}: {str(e)[:200]}", [], None
        want = {"halo-2": ", == eager", "nvfp4": ", y == eager"}.get(recipe, "")
        record(f"torch.compile {recipe} layer ({form}, reduce-overhead): captures, no cudagraph skip{want}",
               ok, cudagraph_skips=skips, **({"error": err} if err else {"rel_err_y_dx_dw": [f"{v:.1e}" for v in errs]}))


def check_saved_fp8(dev, gen):
    """``@saved-fp8`` (X and W saved as the forward quantizer's FP8 fold, no fold kernel in backward):
    a converted layer's y, dX and dW equal the base recipe's bit for bit, eager and compiled with CUDA
    graphs (the fold is exact; tseng's stochastic rounding draws the same bits either way)."""
    x = make_input((1024, 1024), torch.float32, dev, gen)
    for recipe in ("mxfp4", "mxfp4-had", "tseng"):
        for mode in (None, "reduce-overhead"):
            try:
                torch.compiler.reset()
                base = converted_layer_grads(x, recipe, dev, 2048, compiled=mode is not None, mode=mode, steps=3)
                torch.compiler.reset()
                got = converted_layer_grads(x, f"{recipe}@saved-fp8", dev, 2048, compiled=mode is not None, mode=mode, steps=3)
                ok, detail = all(torch.equal(a, b) for a, b in zip(got, base)), {}
            except Exception as e:  # noqa: BLE001 - reported as a FAIL
                ok, detail = False, {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            record(f"{recipe}@saved-fp8 layer 1024x1024x2048 {mode or 'eager'}: y, dX, dW == {recipe}'s", ok, **detail)


def check_baseline(how, t, k, n, dev, gen):
    """A bench baseline (`adahop.bench.emulated`): y, dX, dW vs the reference quantizer's dequantized
    operands multiplied in FP32, to the BF16 rounding of the GEMM outputs."""
    from adahop.bench.emulated import EmulatedMXLinear
    from adahop.formats import quantize_mxfp4

    lin = torch.nn.Linear(k, n, bias=False, device=dev)
    layer = EmulatedMXLinear(lin, how)
    x = make_input((t, k), torch.bfloat16, dev, gen).requires_grad_(True)
    dy = make_input((t, n), torch.bfloat16, dev, gen)
    layer(x).backward(dy)  # y checked through dX and dW below and directly here
    y = layer(x).detach()
    q = lambda u, axis: quantize_mxfp4(u.detach().float().contiguous(), axis=axis).dequantize(torch.float32)  # noqa: E731
    w = lin.weight.detach().to(torch.bfloat16)
    want = (q(x, 1) @ q(w, 1).t(), q(dy, 1) @ q(w, 0), q(dy, 0).t() @ q(x, 0))
    errs = [float((g.float() - r).norm() / r.norm()) for g, r in zip((y, x.grad, lin.weight.grad), want)]
    record(f"baseline {how} {t}x{k}x{n}: y, dX, dW vs reference", max(errs) < 3e-3,
           rel_err_y_dx_dw=[f"{v:.1e}" for v in errs])


def check_optim_step(name, n, alg, w_dtype, s_dtype, rounding, dev, gen, mul_lr=3e-2):
    """The fused optimizer step (Triton) vs its reference: weights and states bit for bit, under a
    fixed Philox seed for stochastic rounding; then SR fresh across seeds. ``mul_lr`` 3 with cap 2 takes the
    workshop form's exponent steps past one octave (2^y's range reduction, 2026-12-05)."""
    from adahop.kernels.optim_step import STATE_NAMES, bit_mismatches, optim_step, step_scalars

    w0 = (torch.randn(n, device=dev, generator=gen)
          * torch.exp2(torch.randint(-10, 10, (n,), device=dev, generator=gen).float())).to(w_dtype)
    g = torch.randn(n, device=dev, generator=gen).to(torch.bfloat16)
    st0 = [(torch.rand(n, device=dev, generator=gen) * 1e-3).to(s_dtype) for _ in STATE_NAMES[alg]]
    sc = step_scalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7, mul_lr=mul_lr, cap=2.0)
    # stream 1: Triton passes a scalar argument equal to 1 as a constexpr (round 16 failed on it)
    bad_w, bad_s, w_triton = bit_mismatches(alg, w0, g, st0, sc, rounding=rounding, seed=20261201, stream=1)
    bits = lambda t: t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)  # noqa: E731
    detail = dict(w_mismatch=bad_w, state_mismatch=bad_s)
    if rounding == "stochastic":  # another seed moves other elements
        w2 = w0.clone()
        optim_step(alg, w2, g, [t.clone() for t in st0], sc, rounding=rounding, seed=20261202, stream=1, backend="triton")
        detail["differs_across_seeds"] = int((bits(w2) != bits(w_triton)).sum())
        detail["of"] = n  # expect about a third: 2f(1-f) averaged over the dropped fractions f
    record(name, bad_w == 0 and bad_s == 0 and detail.get("differs_across_seeds", 1) > 0, **detail)


def check_optim_multi(name, alg, w_dtype, s_dtype, rounding, dev, gen, small):
    """The multi-tensor launch (adahop.kernels.optim_step.optim_step_multi) vs the reference on each
    tensor: ragged sizes, an empty tensor, one not 16-byte aligned (a view at element 1), streams out
    of order; bit for bit. Under SR: exact ties split between two seeds about half and half."""
    from adahop.kernels.optim_step import STATE_NAMES, bit_mismatches_multi, optim_step_multi, step_scalars

    sizes = [3000, 5, 0, 64, 1100, 77] if small else [(1 << 21) + 5, 4096, 0, 1, 333333, 2048 * 50, 1 << 20]
    ws = [(torch.randn(n + 1, device=dev, generator=gen)
           * torch.exp2(torch.randint(-10, 10, (n + 1,), device=dev, generator=gen).float())).to(w_dtype)
          for n in sizes]
    ws = [w[1:] if i == 1 else w[:-1] for i, w in enumerate(ws)]  # ws[1]: misaligned
    gs = [torch.randn(n, device=dev, generator=gen).to(torch.bfloat16) for n in sizes]
    sts = [[(torch.rand(n, device=dev, generator=gen) * 1e-3).to(s_dtype) for _ in STATE_NAMES[alg]] for n in sizes]
    sc = step_scalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7, mul_lr=3e-2, cap=2.0)
    streams = list(range(len(sizes)))[::-1]
    bad_w, bad_s, _ = bit_mismatches_multi(alg, ws, gs, sts, sc, rounding=rounding, seed=20261202, streams=streams)
    detail = dict(w_mismatch=bad_w, state_mismatch=bad_s)
    ok = bad_w == 0 and bad_s == 0
    if rounding == "stochastic" and alg == "adamw":  # ties: 1 + half an ulp, two seeds
        n = sizes[0]
        tie = step_scalars(lr=2.0**-8, beta1=0.0, beta2=0.0, eps=1e-30, weight_decay=0.0, step=1)
        out = []
        for seed in (11, 12):
            w = [torch.ones(n, device=dev, dtype=torch.bfloat16)]
            moments = [[torch.zeros(n, device=dev), torch.zeros(n, device=dev)]]
            optim_step_multi("adamw", w, [-torch.ones(n, device=dev)], moments, tie, rounding="stochastic", seed=seed,
                             backend="triton")
            out.append(w[0])
        frac = float((out[0] != out[1]).float().mean())
        detail["ties_differing_across_seeds"] = round(frac, 4)
        ok = ok and abs(frac - 0.5) < 0.03
    record(name, ok, **detail)


SECTIONS = ("quantize", "outputs", "sweep", "fold", "sr", "gemm", "nvfp4", "rivals", "compile", "baselines", "optim", "matvec",
            "topk")


def check_topk(name, n, k, dev, gen):
    """OE's index selection on the device: adahop.gemm.top_indices (two passes for 8,192-32,768 values) against
    torch.topk's indices on distinct values, and against its values on many ties; oe_indices (exact and FOID's
    64-element prefix) of a BF16 operand against the same selection from the operand on the CPU (set equality:
    the device's norms may round differently only where two norms tie)."""
    from adahop.gemm import oe_indices, top_indices

    v = torch.randperm(n, device=dev, generator=gen).float()
    same = top_indices(v, k).tolist() == torch.topk(v, k).indices.tolist()
    ties = torch.randint(0, 40, (n,), device=dev, generator=gen).float()
    got = top_indices(ties, k)
    same_ties = got.unique().numel() == k and ties[got].tolist() == torch.topk(ties, k).values.tolist()
    t = make_input((n, 256), torch.bfloat16, dev, gen)
    picks = {}
    for prefix in (None, 64):
        picks[prefix] = set(oe_indices(t, 1, k, prefix).tolist()) == set(oe_indices(t.cpu(), 1, k, prefix).tolist())
    record(name, same and same_ties and all(picks.values()), distinct=same, ties=same_ties, oe_exact=picks[None],
           oe_foid=picks[64])


def check_int_matvec(name, m, n, bits, g, rows, dev, gen, quantizer="int"):
    """adahop.ptq.decode.int_matvec (Triton on CUDA) against its reference: FP32 sums in another order. ``mxfp4``:
    E2M1 codes with E8M0 scales (``element="e2m1"``)."""
    from adahop.ptq.decode import int_matvec, int_matvec_reference
    from adahop.ptq.grids import make_grid
    from adahop.ptq.quantize import pack_bits

    grid = make_grid(quantizer, bits, g)
    el = "e2m1" if quantizer == "mxfp4" else "int"
    w = torch.randn(m, n, device=dev, generator=gen)
    codes, scales, _ = grid.quantize(w)
    packed, st = pack_bits(codes, bits).to(dev), grid.stored_scales(scales)["scales"].to(dev)
    x = torch.randn(rows, n, device=dev, generator=gen).bfloat16()
    y = int_matvec(x, packed, st, m, n, bits, g, backend="triton" if dev == "cuda" else "auto", element=el)
    ref = int_matvec_reference(x, packed, st, m, n, bits, g, element=el)
    rel = float((y - ref).norm() / ref.norm().clamp(min=1e-30))
    record(name, bool(rel < 1e-5), rel_err=rel)


def check_stages(name, d, inverse, dev, gen):
    """adahop.ptq.staged.apply_stages (one Triton launch per merged stage) against its reference: a HARP rotation
    of size d with random Θ and signs folded in, BF16 in, FP32 out."""
    from adahop.ptq.rotation import HARPRotation
    from adahop.ptq.staged import apply_stages, apply_stages_reference, fold_signs, merge_stages, rotation_stages

    r = HARPRotation(d).to(dev)
    with torch.no_grad():
        for th in r.thetas:
            th.copy_(torch.randn(th.shape, device=dev, generator=gen) * 0.3)
        signs = [torch.randint(0, 2, (d,), device=dev, generator=gen).float() * 2 - 1 for _ in range(2)]
        st = fold_signs(merge_stages(rotation_stages(r, inverse=inverse), d), *signs)
    x = torch.randn(2, d, device=dev, generator=gen).bfloat16()
    y = apply_stages(x, st, backend="triton" if dev == "cuda" else "auto")
    ref = apply_stages_reference(x, st)
    rel = float((y - ref).norm() / ref.norm().clamp(min=1e-30))
    record(name, bool(rel < 1e-5), rel_err=rel, stages=[b for _, b, _ in st])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--log", default=None, help="write the results as JSON here")
    ap.add_argument("--only", default=None, help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    if only - set(SECTIONS):
        ap.error(f"--only: unknown section(s) {sorted(only - set(SECTIONS))}; choose from {','.join(SECTIONS)}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(1234)
    t0 = time.time()
    s = 1 if not args.small else 0
    bf, f32 = torch.bfloat16, torch.float32
    big = lambda shape: shape if s else tuple(min(d, 128) if d % 32 == 0 else 72 for d in shape)  # noqa: E731
    mk = lambda shape, dt=bf, special=False: make_input(big(shape), dt, dev, gen, special)  # noqa: E731

    print(f"# device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}; torch {torch.__version__}", flush=True)
    if "quantize" in only:
        # --- quantizer, round to nearest -----------------------------------------------------------
        for shape, dt in (((4096, 4096), bf), ((8192, 2048), bf), ((4096, 4096), f32)):
            for axis in (1, 0):
                check_quantize(f"{shape[0]}x{shape[1]} ax{axis} {str(dt)[6:]} hb32", mk(shape, dt), axis)
        check_quantize("1000x4096 ax1 bf16 hb32 (ragged rows)", mk((1000, 4096)), 1)
        check_quantize("4096x1000 ax0 bf16 hb None (ragged rows)", mk((4096, 1000)), 0, hb=None)
        check_quantize("1000x4096 ax0 bf16 hb None (ragged Kc)", mk((1000, 4096)), 0, hb=None)
        check_quantize("4096x1000 ax1 fp32 hb None (ragged Kc)", mk((4096, 1000), f32), 1, hb=None)
        check_quantize("8192x14336 ax1 bf16 hb32 (one 16384 tile, masked)", mk((8192, 14336)), 1)
        check_quantize("1024x20480 ax1 bf16 hb32 (row loop 10x2048)", mk((1024, 20480)), 1)
        check_quantize("8192x4096 ax1 bf16 hb32 special values", mk((8192, 4096), special=True), 1)
        check_quantize("8192x4096 ax0 bf16 hb32 special values", mk((8192, 4096), special=True), 0)
        check_quantize("16448x768 ax0 bf16 hb32 (129 K-tiles: three steps of the row-max loop)", mk((16448, 768)), 0)
        w = mk((14336, 4096))
        check_quantize("Wt = (14336x4096).t() ax0 (fprop B)", w.t(), 0)
        dy = mk((8192, 1024))
        check_quantize("dYt = (8192x1024).t() ax1 (wgrad A)", dy.t(), 1)
        del w, dy
        g = torch.Generator(device=dev).manual_seed(5)
        for hb in (16, 64):
            signs = (torch.randint(0, 2, (hb,), device=dev, generator=g).float() * 2 - 1)
            for axis in (1, 0):
                check_quantize(f"2048x4096 ax{axis} bf16 hb{hb} signs", mk((2048, 4096)), axis, hb=hb, signs=signs)
        for rule in ("rceil", "adahop", "tseng"):
            check_quantize(f"4096x2048 ax1 bf16 rule={rule}", mk((4096, 2048)), 1, rule=rule)
            check_quantize(f"4096x2048 ax0 bf16 rule={rule}", mk((4096, 2048)), 0, rule=rule)
        check_quantize("4096x4096 ax1 bf16 max_scale_range=None", mk((4096, 4096), special=True), 1, msr=None)
        check_quantize("4096x4096 ax0 bf16 max_scale_range=None", mk((4096, 4096), special=True), 0, msr=None)
    if "outputs" in only:
        # --- what each operand writes (fp8 only / codes only) and OE's zeroed rows ------------------
        check_outputs("X 8192x4096 ax1 (fprop A)", mk((8192, 4096), special=True), 1)
        check_outputs("X 8192x4096 ax0 (saved for wgrad, OE-Right)", mk((8192, 4096), special=True), 0)
        check_outputs("dY 8192x14336 ax1 (16384 tile)", mk((8192, 14336)), 1)
        check_outputs("4096x1000 ax0 (ragged rows)", mk((4096, 1000)), 0)
    if "sweep" in only:
        # --- every tile plan: contracted length × Hadamard block (a [64, 4, 32] tile once compiled wrong) --
        for kc in (32, 64, 96, 128, 160, 256, 512, 1024, 2048):
            for hb in (None, 16, 32, 64, 128, 256):
                if hb is not None and (hb > kc or kc % hb):
                    continue
                signs = None if hb is None else (torch.randint(0, 2, (hb,), device=dev, generator=gen).float() * 2 - 1)
                for axis in (1, 0):
                    rows = 4096 if s else 64  # the contracted length is kept as is, also with --small
                    x = make_input((rows, kc) if axis == 1 else (kc, rows), bf, dev, gen)
                    check_quantize(f"sweep kc={kc} ax{axis} hb{hb} signs", x, axis, hb=hb, signs=signs, rule="tseng")
    if "fold" in only:
        # --- the fold of saved packed MXFP4 (backward) --------------------------------------------------
        check_fold("X 8192x4096 ax0 (saved for wgrad)", mk((8192, 4096)), 0)
        check_fold("W 14336x4096 ax0 (saved for dgrad)", mk((14336, 4096)), 0)
        check_fold("X 8192x14336 ax0 special values", mk((8192, 14336), special=True), 0)
        check_fold("1000x4096 ax1 ragged rows, rule=tseng", mk((1000, 4096)), 1, rule="tseng")
        check_fold("4096x1000 ax1 ragged Kc", mk((4096, 1000)), 1)
        check_saved_fp8(dev, gen)
    if "sr" in only:
        # --- stochastic rounding --------------------------------------------------------------------
        for axis in (1, 0):
            check_stochastic(f"4096x4096 ax{axis} bf16 ceil", mk((4096, 4096)), axis)
    if "gemm" in only:
        # --- GEMM -----------------------------------------------------------------------------------
        for (m, kc, n) in ((4096, 4096, 4096), (8192, 4096, 1024), (8192, 14336, 4096), (1000, 4096, 1000)):
            m, kc, n = big((m, kc, n))
            check_gemm(f"{m}x{kc}x{n} hb32", m, kc, n, dev, gen)
        m, kc, n = big((2048, 4096, 2048))
        check_gemm(f"{m}x{kc}x{n} via fold_to_fp8 (reference quantizer)", m, kc, n, dev, gen, via_fold=True)
        check_gemm(f"{m}x{kc}x{n} no Hadamard", m, kc, n, dev, gen, hb=None)
        check_gemm_unfoldable(f"{m}x{kc}x{n}", m, kc, n, dev, gen)
    if "nvfp4" in only:
        # --- the NVFP4 quantizer (recipes nvfp4, averis): RNE bit for bit, SR statistics, decode, layers ------
        from adahop.recipes.rivals import TE_WGRAD_SIGNS

        te = torch.tensor(TE_WGRAD_SIGNS, dtype=torch.float32, device=dev)
        for shape, dt in (((4096, 4096), bf), ((8192, 2048), f32)):
            for axis in (1, 0):
                check_nvfp4_quantize(f"{shape[0]}x{shape[1]} ax{axis} {str(dt)[6:]}", mk(shape, dt), axis)
        check_nvfp4_quantize("1000x4096 ax1 bf16 (ragged rows)", mk((1000, 4096)), 1)
        check_nvfp4_quantize("4096x1000 ax0 bf16 (ragged rows)", mk((4096, 1000)), 0)
        check_nvfp4_quantize("1000x4104 ax1 fp32 (ragged Kc)", mk((1000, 4104), f32), 1)
        check_nvfp4_quantize("4104x1000 ax0 bf16 (ragged Kc)", mk((4104, 1000)), 0)
        check_nvfp4_quantize("8192x4096 ax1 bf16 special values", mk((8192, 4096), special=True), 1)
        check_nvfp4_quantize("8192x4096 ax0 bf16 special values", mk((8192, 4096), special=True), 0)
        w = mk((14336, 4096))
        check_nvfp4_quantize("W 14336x4096 ax0 16x16 tiles (dgrad B)", w, 0, tile=True)
        check_nvfp4_quantize("Wt = (14336x4096).t() ax0 16x16 tiles (fprop B)", w.t(), 0, tile=True)
        check_nvfp4_quantize("W 1000x4104 ax1 16x16 tiles (ragged)", mk((1000, 4104)), 1, tile=True)
        dy, x = mk((8192, 1024)), mk((8192, 4096))
        check_nvfp4_quantize("dYt = (8192x1024).t() ax1 RHT16 TE signs (wgrad A)", dy.t(), 1, hb=16, signs=te)
        check_nvfp4_quantize("X 8192x4096 ax0 RHT16 TE signs (wgrad B)", x, 0, hb=16, signs=te)
        check_nvfp4_quantize("X 8192x4096 ax1 given tensor scale", x, 1, gs=torch.tensor(0.75, device=dev))
        rows = torch.randperm(x.shape[0], device=dev, generator=gen)[:64]
        check_nvfp4_quantize("X 8192x4096 ax1 OE zero rows", x, 1, zero=rows)
        check_nvfp4_plan("X 8192x4096 ax0 bf16 (transposing)", x, 0)
        check_nvfp4_plan("X 8192x4096 ax0 RHT16 TE signs (wgrad B)", x, 0, hb=16, signs=te)
        check_nvfp4_plan("dYt = (8192x1024).t() ax1 RHT16 (wgrad A)", dy.t(), 1, hb=16, signs=te)
        check_nvfp4_plan("W 14336x4096 ax0 16x16 tiles (dgrad B)", w, 0, tile=True)
        check_nvfp4_plan("X 8192x4096 ax0 fp32", x.float(), 0)
        for axis in (1, 0):
            check_nvfp4_stochastic(f"4096x4096 ax{axis} bf16 1x16", mk((4096, 4096)), axis)
        check_nvfp4_stochastic("W 4096x4096 ax0 16x16 tiles", mk((4096, 4096)), 0, tile=True)
        check_nvfp4_stochastic("dYt (8192x1024).t() ax1 RHT16", dy.t(), 1, hb=16, signs=te)
        check_nvfp4_decode("X 8192x4096 ax0 (saved for wgrad)", x, 0)
        check_nvfp4_decode("W 14336x4096 ax0 tiles (saved for dgrad)", w, 0, tile=True)
        check_nvfp4_decode("1000x4104 ax1 special values", mk((1000, 4104), special=True), 1)
        del w, dy, x
        for recipe in ("nvfp4", "averis", "averis@mean-bf16"):
            t, k, n = big((8192, 4096, 4096))
            check_nvfp4_layer(recipe, t, k, n, dev, gen)
    if "rivals" in only:
        # --- the rival recipes' fast paths: NVFP4 GEMM on BF16 tensor cores, HALO's large Hadamards ---------
        for (m, kc, n) in ((4096, 4096, 4096), (8192, 512, 1344), (1000, 1000, 520), (512, 16384, 512)):
            m, kc, n = big((m, kc, n))
            check_nvfp4_gemm(f"{m}x{kc}x{n} W tiles 16x16", m, kc, n, dev, gen)
        m, kc, n = big((2048, 4096, 2048))
        check_nvfp4_gemm(f"{m}x{kc}x{n} 1x16 blocks, SR A", m, kc, n, dev, gen, tile_b=False, rounding="stochastic")
        for shape, axis in (((16384, 512), 1), ((512, 16384), 0)):  # HALO fprop: X [T, K], Wᵀ [K, N], hb = K
            hb = shape[axis]
            check_large_block_quantize(f"{shape[0]}x{shape[1]} ax{axis} hb{hb} (Hadamard block above 256)",
                                       make_input(shape if s else tuple(min(d, 64) if d != hb else d for d in shape),
                                                  torch.bfloat16, dev, gen), axis, hb)
        for shape, axis in (((16384, 512), 0), ((16384, 512), 1), ((512, 32768), 1), ((4096, 64), 0)):
            shape = shape if s else tuple(min(d, 1024) for d in shape)
            check_kron_hadamard(f"{shape[0]}x{shape[1]} whole axis {axis}", shape, axis, dev, gen)
        check_hadamard_tf32(dev, gen)
        if dev == "cuda":
            check_rival_layers(dev, gen)
    if "compile" in only and dev == "cuda":
        check_compile(dev, gen)
    if "baselines" in only and dev == "cuda":
        for how in ("dequant-bf16", "dot_scaled"):
            check_baseline(how, 2048, 4096, 1024, dev, gen)
            check_baseline(how, 1024, 2048, 512, dev, gen)  # M/128 = 4 row tiles, fewer than a group of 8

    if "optim" in only:
        # --- the fused optimizer step (adahop.kernels.optim_step) -------------------------------------
        from adahop.kernels.optim_step import ALGORITHMS

        for alg in ALGORITHMS:
            for wdt, sdt, rnd in ((bf, bf, "nearest"), (bf, bf, "stochastic"), (bf, f32, "nearest"), (f32, f32, "nearest")):
                n = (1 << 22) + 123 if s else 3000  # a ragged last block
                check_optim_step(f"optim {alg} w={str(wdt)[6:]} states={str(sdt)[6:]} {rnd}", n, alg, wdt, sdt, rnd,
                                 dev, gen)
            if alg == "madam-workshop":
                for wdt, rnd in ((bf, "nearest"), (bf, "stochastic"), (f32, "nearest")):
                    check_optim_step(f"optim {alg} w={str(wdt)[6:]} {rnd}, exponent steps past one octave", 3000, alg,
                                     wdt, f32, rnd, dev, gen, mul_lr=3.0)
            for wdt, sdt, rnd in ((bf, bf, "nearest"), (bf, bf, "stochastic"), (f32, f32, "nearest")):
                check_optim_multi(f"optim multi-tensor {alg} w={str(wdt)[6:]} states={str(sdt)[6:]} {rnd}", alg, wdt,
                                  sdt, rnd, dev, gen, not s)
    if "topk" in only:
        # --- OE's top-k (two passes for 8,192-32,768 values, round 33) and FOID's prefix norms -----------------
        for n in (4096, 8192, 16384, 16384 + 77, 32768, 65536):
            check_topk(f"top_indices n={n} k=64, oe_indices exact/FOID", n if s else min(n, 8192 + 77), 64, dev, gen)
    if "matvec" in only:
        # --- the decode matvec on packed int codes (adahop.ptq.decode, issue 22's inference path) -----------
        for m, n, bits, g, rows in ((4096, 4096, 2, 128, 1), (14336, 4096, 4, 128, 1), (4096, 14336, 2, 128, 1),
                                    (1024, 2752, 2, 128, 4), (2752, 1024, 4, 64, 2), (1000, 208, 2, 64, 3),
                                    (1000, 192, 2, 48, 1), (4096, 4096, 3, 128, 1), (1000, 224, 3, 64, 3)):
            if not s:  # (n whole units of words: multiples of 16, 32, 8 at 2, 3, 4 bits)
                m, n = min(m, 256), min(n, 256)
            check_int_matvec(f"int_matvec {m}x{n} W{bits} g{g} rows={rows}", m, n, bits, g, rows, dev, gen)
        for m, n, rows in ((4096, 14336, 1), (1000, 200, 3)):
            if not s:
                m, n = min(m, 256), min(n, 256)
            check_int_matvec(f"int_matvec {m}x{n} MXFP4 rows={rows}", m, n, 4, 32, rows, dev, gen, quantizer="mxfp4")
        for d in ((4096, 14336, 2752, 1344) if s else (1344, 172)):
            for inverse in (False, True):
                check_stages(f"stages HARP d={d}{' inverse' if inverse else ''}", d, inverse, dev, gen)
    n_fail = sum(not r["ok"] for r in RESULTS)
    print(f"\n{len(RESULTS) - n_fail}/{len(RESULTS)} checks passed in {time.time() - t0:.0f} s")
    if args.log:
        with open(args.log, "w") as f:
            json.dump(dict(results=RESULTS, device=dev, torch=torch.__version__), f, indent=1)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
