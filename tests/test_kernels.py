"""adahop.kernels: fold exactness, GEMM twins, layout checks, backend dispatch, and the Triton
quantizer run in Triton's CPU interpreter (TRITON_INTERPRET=1) against its reference, bit for bit.

GPU parity and timing live in scripts/validate_kernels.py and scripts/bench_kernels.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os

import pytest
import torch

from adahop.formats import quantize_mxfp4
from adahop.hadamard import block_hadamard
from adahop.kernels import (
    fold_to_fp8,
    hadamard_butterfly,
    iht_quantize_mxfp4,
    mx_matmul,
    mx_matmul_reference,
    mx_transpose,
    resolve_backend,
)
from adahop.kernels.mx_matmul import _fp8_rowwise_mm

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _spread_rows(r: int, c: int, seed: int = 0) -> torch.Tensor:
    """Random rows whose scales span 2^-40 … 2^40, plus a row with one huge and one tiny block,
    a zero row and a row holding a zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * torch.exp2(torch.randint(-40, 40, (r, 1), generator=g).float())
    x[0, :] = 1e-30
    x[0, :16] = 1e20  # one huge block; the rest sit ~2^-166 below it
    x[1] = 0.0
    x[2, : min(c, 32)] = 0.0
    return x


def _moved(q, x):
    """q.dequantize() moved and padded like the fold output [rows, kp]."""
    d = q.dequantize().movedim(q.axis, -1)
    kp = q.codes.shape[-1] * 2
    return torch.nn.functional.pad(d, (0, kp - d.shape[-1]))


# ----------------------------------------------------------------------------- fold


@pytest.mark.parametrize("shape,axis", [((33, 64), 1), ((40, 50), 1), ((70, 24), 0), ((8, 32), 0)], ids=str)
@pytest.mark.parametrize("rule", ["floor", "rceil", "adahop", "tseng"])
def test_fold_is_exact(shape, axis, rule):
    x = _spread_rows(*shape) if axis == 1 else _spread_rows(shape[1], shape[0]).t()
    q = quantize_mxfp4(x, axis=axis, scale_rule=rule, max_scale_range=8)
    fp8, rs = fold_to_fp8(q)
    assert fp8.dtype == torch.float8_e4m3fn and rs.dtype == torch.float32
    assert fp8.shape == (q.codes.shape[0], q.codes.shape[1] * 2) and rs.shape == (q.codes.shape[0],)
    torch.testing.assert_close(fp8.float() * rs[:, None], _moved(q, x), atol=0, rtol=0)


def test_fold_nan_block_and_zero_rows():
    x = torch.randn(4, 96)
    x[1, 40] = float("nan")
    x[2] = 0.0
    q = quantize_mxfp4(x, axis=1, max_scale_range=8)
    fp8, rs = fold_to_fp8(q)
    v = fp8.float() * rs[:, None]
    assert torch.isnan(v[1, 32:64]).all() and not torch.isnan(v[1, :32]).any()
    assert (v[2] == 0).all() and rs[2] == 2.0**-127
    torch.testing.assert_close(v, q.dequantize(), atol=0, rtol=0, equal_nan=True)


def test_fold_rejects_wide_exponent_range():
    q = quantize_mxfp4(_spread_rows(6, 64), axis=1)  # no max_scale_range: row 0 spans ~2^66..2^-100
    with pytest.raises(ValueError, match="max_scale_range=8"):
        fold_to_fp8(q)
    z = torch.randn(3, 64)
    z[:, :32] = 0.0  # zero blocks sit at 2^-127 without the limit; they fold to exact zeros anyway
    fp8, rs = fold_to_fp8(quantize_mxfp4(z, axis=1))
    torch.testing.assert_close(fp8.float() * rs[:, None], quantize_mxfp4(z, axis=1).dequantize(), atol=0, rtol=0)


# ----------------------------------------------------------------------------- GEMM


def _operands(m=48, kc=96, n=40, seed=1, hb=32):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, kc, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g).float())
    b = torch.randn(kc, n, generator=g)
    qa = iht_quantize_mxfp4(a, axis=1, hadamard_block=hb, backend="reference")
    qb = iht_quantize_mxfp4(b, axis=0, hadamard_block=hb, backend="reference")
    return a, b, qa, qb


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def test_mx_matmul_reference_is_dequant_matmul():
    a, b, qa, qb = _operands()
    out = mx_matmul(qa, qb, backend="reference")
    assert out.shape == (48, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, qa.dequantize() @ qb.dequantize(), atol=0, rtol=0)
    assert _rel(out, a @ b) < 0.2  # MXFP4 + IHT of the same product
    assert mx_matmul(qa, qb, backend="reference", out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_fold_emulation_matches_reference():
    _, _, qa, qb = _operands(kc=200, hb=None)  # ragged Kc: padded to 224
    fa, sa = fold_to_fp8(qa)
    fb, sb = fold_to_fp8(qb)
    emu = (fa.double() @ fb.double().t()) * sa.double()[:, None] * sb.double()[None, :]
    assert _rel(emu, mx_matmul_reference(qa, qb)) < 1e-6


def test_fp8_rowwise_mm_op_on_cpu():
    """The GEMM custom op (CPU `_scaled_mm`): matches the reference, N not a multiple of 16."""
    _, _, qa, qb = _operands(n=40)
    fa, sa = fold_to_fp8(qa)
    fb, sb = fold_to_fp8(qb)
    out = _fp8_rowwise_mm(fa, sa, fb, sb, torch.float32)
    assert out.shape == (48, 40)
    assert _rel(out, mx_matmul_reference(qa, qb)) < 1e-5
    torch.library.opcheck(_fp8_rowwise_mm, (fa, sa, fb, sb, torch.float32), test_utils="test_faketensor")


def test_fp32_accumulation_equals_the_reference_to_fp32_rounding():
    """``accumulation="fp32"`` (BF16 tensor cores on CUDA, FP32 here): the FP8 operands are exact,
    so only FP32 summation order differs from the reference; bad names are refused."""
    _, _, qa, qb = _operands(n=40)
    fa, sa = fold_to_fp8(qa)
    fb, sb = fold_to_fp8(qb)
    ref = mx_matmul_reference(qa, qb).double()
    out = _fp8_rowwise_mm(fa, sa, fb, sb, torch.float32, True)
    scale = (qa.dequantize().double().abs() @ qb.dequantize().double().abs()).norm()
    assert out.shape == (48, 40) and ((out.double() - ref).norm() / scale).item() < 1e-6
    assert _fp8_rowwise_mm(fa, sa, fb, sb, torch.bfloat16, True).dtype == torch.bfloat16
    torch.library.opcheck(_fp8_rowwise_mm, (fa, sa, fb, sb, torch.float32, True), test_utils="test_faketensor")
    with pytest.raises(ValueError, match="accumulation='fp16'"):
        mx_matmul(qa, qb, accumulation="fp16")


def test_unfoldable_operands_take_the_exact_bf16_gemm(monkeypatch):
    """``max_scale_range=None`` (the msr-none variant) with a massive activation: rows span more
    than 2⁸, so no FP8 fold exists; the fast path multiplies the BF16-dequantized operands, which are
    exact, and equals the reference to FP32 summation order. Foldable operands keep the FP8 GEMM."""
    mm = importlib.import_module("adahop.kernels.mx_matmul")  # the package's mx_matmul is the function

    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 128, generator=g)
    a[5, 3] = 1e4  # one massive activation: blocks 1-3 of row 5 sit > 2⁸ below block 0
    b = torch.randn(128, 40, generator=g)
    qa = quantize_mxfp4(a, axis=1, max_scale_range=None)
    qb = quantize_mxfp4(b, axis=0, max_scale_range=None)
    with pytest.raises(ValueError, match="cannot hold exactly"):
        fold_to_fp8(qa)
    assert torch.equal(qa.dequantize(torch.bfloat16).float(), qa.dequantize())  # exact in BF16
    ref = mx_matmul_reference(qa, qb).double()
    scale = (qa.dequantize().double().abs() @ qb.dequantize().double().abs()).norm()
    out = mm.mx_matmul_dequant(qa, qb)
    assert out.shape == (48, 40) and out.dtype == torch.float32
    assert ((out.double() - ref).norm() / scale).item() < 1e-6
    assert mm.mx_matmul_dequant(qa, qb, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    routed = []
    monkeypatch.setattr(mm, "resolve_backend", lambda backend, device: "triton")
    monkeypatch.setattr(mm, "mx_matmul_dequant", lambda qa, qb, out_dtype: routed.append("bf16") or ref.float())
    monkeypatch.setattr(mm, "mx_matmul_fp8", lambda qa, qb, **kw: routed.append("fp8") or ref.float())
    mm.mx_matmul(qa, qb, backend="triton")
    mm.mx_matmul(qa, quantize_mxfp4(b, axis=0, max_scale_range=8), backend="triton")
    mm.mx_matmul(quantize_mxfp4(a, axis=1, max_scale_range=8), quantize_mxfp4(b, axis=0, max_scale_range=8), backend="triton")
    assert routed == ["bf16", "bf16", "fp8"]


def test_mx_transpose_shares_storage():
    w = torch.randn(40, 96)
    qw = iht_quantize_mxfp4(w, axis=1, backend="reference")
    qwt = mx_transpose(qw)
    assert qwt.shape == (96, 40) and qwt.axis == 0 and qwt.codes is qw.codes
    torch.testing.assert_close(qwt.dequantize(), qw.dequantize().t(), atol=0, rtol=0)
    x = torch.randn(8, 96)
    qx = iht_quantize_mxfp4(x, axis=1, backend="reference")
    torch.testing.assert_close(mx_matmul(qx, qwt), qx.dequantize() @ qw.dequantize().t(), atol=0, rtol=0)


@pytest.mark.parametrize("fn", [mx_matmul_reference, lambda a, b: mx_matmul(a, b, backend="reference")])
def test_mx_matmul_layout_errors(fn):
    _, _, qa, qb = _operands()
    with pytest.raises(ValueError, match="axis=1"):
        fn(mx_transpose(qa), qb)  # A blocked along its rows
    with pytest.raises(ValueError, match="axis=0"):
        fn(qa, mx_transpose(qb))
    _, _, qa2, _ = _operands(kc=64)
    with pytest.raises(ValueError, match="contracted dims differ"):
        fn(qa2, qb)
    with pytest.raises(ValueError, match="MXTensor"):
        fn(qa.dequantize(), qb)
    bad = dataclasses.replace(qa, codes=qa.codes[:, :-1])
    with pytest.raises(ValueError, match="do not match"):
        fn(bad, qb)


# ----------------------------------------------------------------------------- quantizer reference


@pytest.mark.parametrize("hb", [16, 32, 64])
def test_butterfly_is_block_hadamard(hb):
    x = torch.randn(6, 128, dtype=torch.float64).float()
    s = torch.randint(0, 2, (hb,)).float() * 2 - 1
    for axis, signs in ((1, None), (1, s), (0, None)):
        xx = x if axis == 1 else x.t().contiguous()
        torch.testing.assert_close(hadamard_butterfly(xx, block_size=hb, axis=axis, signs=signs),
                                   block_hadamard(xx, block_size=hb, axis=axis, signs=signs), atol=1e-6, rtol=1e-6)


def test_reference_matches_dense_hadamard_quantizer():
    """Butterfly and dense Hadamard differ in last-bit rounding only: scales equal, codes ≥ 99.99%."""
    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    for axis in (0, 1):
        q = iht_quantize_mxfp4(x, axis=axis, backend="reference")
        d = quantize_mxfp4(block_hadamard(x.float(), block_size=32, axis=axis), axis=axis, max_scale_range=8)
        assert torch.equal(q.scales, d.scales)
        assert (q.codes != d.codes).float().mean().item() <= 1e-4


def test_reference_above_256_is_the_kronecker_hadamard():
    """A block above the kernel's 256 (HALO's whole-dimension Hadamard) is ``block_hadamard``'s
    Kronecker form, bit for bit (two GEMMs, not log2(b) butterfly passes: the speed of HALO-2), with
    -0 made +0; up to 256 the transform is the butterfly the kernel computes. Either way the
    reference's codes are those of quantizing that transform."""
    from adahop.kernels.quantize_mxfp4 import _iht_transform

    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 512, generator=g)
    x[0, :] = 0.0  # an all-zero row: +0 everywhere
    s = torch.randint(0, 2, (512,), generator=g).float() * 2 - 1
    for axis in (0, 1):
        xx = x if axis == 1 else x.t().contiguous()
        kron = block_hadamard(xx, block_size=512, axis=axis, signs=s)
        got = _iht_transform(xx, 512, axis, s)
        assert torch.equal(got, torch.where(kron == 0, 0.0, kron)) and not torch.signbit(got[got == 0]).any()
        assert not torch.equal(got, hadamard_butterfly(xx, block_size=512, axis=axis, signs=s))  # another rounding
        torch.testing.assert_close(got, hadamard_butterfly(xx, block_size=512, axis=axis, signs=s), atol=1e-5, rtol=1e-5)
        assert torch.equal(_iht_transform(xx, 32, axis, s[:32]), hadamard_butterfly(xx, block_size=32, axis=axis, signs=s[:32]))
        q = iht_quantize_mxfp4(xx, axis=axis, hadamard_block=512, signs=s, backend="reference")
        d = quantize_mxfp4(got, axis=axis, max_scale_range=8)
        assert torch.equal(q.codes, d.codes) and torch.equal(q.scales, d.scales)


def test_quantizer_argument_errors():
    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match="2-D"):
        iht_quantize_mxfp4(torch.randn(2, 64, 64), axis=1)
    with pytest.raises(ValueError, match="axis"):
        iht_quantize_mxfp4(x, axis=2)
    with pytest.raises(ValueError, match="hadamard_block=32 does not"):
        iht_quantize_mxfp4(torch.randn(8, 48), axis=1)
    with pytest.raises(ValueError, match="not supported"):
        iht_quantize_mxfp4(x, axis=1, hadamard_block=24)
    with pytest.raises(ValueError, match="rceil"):
        iht_quantize_mxfp4(x, axis=1, rounding="stochastic")
    with pytest.raises(ValueError, match="signs"):
        iht_quantize_mxfp4(x, axis=1, signs=torch.ones(16))
    with pytest.raises(ValueError, match="outputs='bytes' is not one of"):
        iht_quantize_mxfp4(x, axis=1, outputs="bytes")
    with pytest.raises(ValueError, match="outputs='fp8' needs max_scale_range 0…8"):
        iht_quantize_mxfp4(x, axis=1, outputs="fp8", max_scale_range=None)
    with pytest.raises(ValueError, match="zero_rows must be a 1-D int64"):
        iht_quantize_mxfp4(x, axis=1, zero_rows=torch.tensor([[1.0]]))


def test_reference_zero_rows_is_index_fill():
    """``zero_rows`` picks rows of the dim not quantized along (OE's rows of A / columns of B)."""
    x = torch.randn(64, 96)
    idx = torch.tensor([3, 40])
    for axis in (0, 1):
        got = iht_quantize_mxfp4(x, axis=axis, zero_rows=idx, backend="reference")
        want = iht_quantize_mxfp4(x.index_fill(1 - axis, idx, 0), axis=axis, backend="reference")
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
        assert got.dequantize().index_select(1 - axis, idx).abs().sum() == 0


def test_fp8_only_tensor_without_its_fold_is_an_error():
    q = quantize_mxfp4(torch.randn(4, 64), axis=1, max_scale_range=8)
    q = dataclasses.replace(q, codes=q.codes[:, :0])
    assert q.codes_dropped
    with pytest.raises(ValueError, match="neither"):
        q.dequantize()
    with pytest.raises(ValueError, match="neither"):
        fold_to_fp8(q)


def test_resolve_backend_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", "cpu") == "reference"
    assert resolve_backend("reference", "cpu") == "reference"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", "cpu")
    with pytest.raises(RuntimeError, match="backend='triton' needs"):
        resolve_backend("triton", "cpu")
    with pytest.raises(RuntimeError, match="backend='triton' needs"):
        iht_quantize_mxfp4(torch.randn(32, 32), axis=1, backend="triton")
    _, _, qa, qb = _operands()
    with pytest.raises(RuntimeError, match="backend='triton' needs"):
        mx_matmul(qa, qb, backend="triton")


def test_magic_number_rounding_matches_e2m1_table():
    """The kernel's round-to-nearest-even (``_triton_quantize._e2m1_round``), in numpy float32,
    equals the reference interval table on random floats in [0, 8) and on every tie ± 1 ulp."""
    np = pytest.importorskip("numpy")
    from adahop.formats.e2m1 import E2M1_VALUES, encode_e2m1

    a = np.random.default_rng(0).integers(0, 0x41000000, size=1_000_000).astype(np.int32).view(np.float32)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0, 0.5, 1, 1.5, 2, 3, 4, 6, 7, 7.999], np.float32)
    a = np.concatenate([a, ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(9))])
    ef = np.maximum(a.view(np.int32) >> 23, 127)
    mbits = ((ef + 22) << 23) | 0x400000
    t = (a + mbits.view(np.float32)).astype(np.float32)
    val = np.minimum((t - mbits.view(np.float32)).astype(np.float32), np.float32(6))
    code = np.minimum(t.view(np.int32) - mbits + 2 * (ef - 127), 7)
    ref = encode_e2m1(torch.from_numpy(a)).numpy()
    assert (code == ref).all()
    assert (val == E2M1_VALUES.numpy()[ref]).all()


# ----------------------------------------------------------------------------- Triton, interpreted


# Triton's interpreter must be chosen before triton is first imported (torch may import it), so
# these tests run in child pytests with TRITON_INTERPRET=1 set from the start, in groups of ~40 s (the
# interpreter takes ~2 min for all of them; one child would be the CI's slowest test by 70 s).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not (HAS_TRITON and INTERPRET),
                            reason="run by test_triton_kernels_in_interpreter in a TRITON_INTERPRET=1 child")


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; runs the interp_* tests in a child process")
@pytest.mark.parametrize("group", [_A := "inductor or custom_op or fast_layer or path_end",
                                   _B := "saved_fp8 or emulated or stochastic or transposing",
                                   f"not ({_A}) and not ({_B})"], ids=["compile", "fp8-and-sr", "rest"])
def test_triton_kernels_in_interpreter(interp_child, group):
    interp_child(__file__, group)


CASES = [  # (shape, axis, hadamard_block, dtype, scale_rule, max_scale_range, signs)
    ((64, 64), 1, 32, torch.bfloat16, "floor", 8, False),
    ((64, 64), 0, 32, torch.bfloat16, "floor", 8, False),
    ((40, 96), 1, None, torch.float32, "rceil", 8, False),
    ((80, 48), 0, 16, torch.float32, "adahop", 8, False),
    ((24, 128), 1, 64, torch.float32, "tseng", 8, True),
    ((50, 40), 0, None, torch.bfloat16, "floor", None, False),
    ((64, 96), 0, 32, torch.float32, "floor", 4, True),
    ((4, 9024), 1, 32, torch.bfloat16, "floor", 8, False),  # one masked 16384 tile (8192 < kp <= 16384)
    ((4, 17024), 1, 32, torch.bfloat16, "adahop", 8, False),  # the row loop (kp > 16384), read twice
    ((8, 512), 1, 512, torch.float32, "floor", 8, True),  # blocks above 256 (HALO): the Kronecker form, then the kernel
    ((512, 8), 0, 512, torch.bfloat16, "floor", 8, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][0]}x{c[0][1]}-ax{c[1]}-hb{c[2]}-{str(c[3])[6:]}-{c[4]}-r{c[5]}")
@interp
def test_interp_quantizer_bit_exact(case):
    shape, axis, hb, dtype, rule, msr, with_signs = case
    x = _spread_rows(*shape, seed=shape[0]).to(dtype)
    x[3, 5] = float("nan") if shape[0] > 3 else 0.0
    signs = (torch.randint(0, 2, (hb,)).float() * 2 - 1) if with_signs else None
    kw = dict(axis=axis, hadamard_block=hb, signs=signs, scale_rule=rule, max_scale_range=msr)
    qt = iht_quantize_mxfp4(x, backend="triton", **kw)
    qr = iht_quantize_mxfp4(x, backend="reference", **kw)
    torch.testing.assert_close(qt.codes, qr.codes, atol=0, rtol=0)
    torch.testing.assert_close(qt.scales, qr.scales, atol=0, rtol=0)
    assert (qt.shape, qt.axis, qt.elem_scale) == (qr.shape, qr.axis, qr.elem_scale)
    if msr is not None and msr <= 8:
        fp8, rs = fold_to_fp8(qr)
        assert torch.equal(qt.fp8[0].view(torch.uint8), fp8.view(torch.uint8))
        torch.testing.assert_close(qt.fp8[1], rs, atol=0, rtol=0)
    else:
        assert qt.fp8 is None


@interp
def test_interp_transposing_row_max_loop_takes_two_steps():
    """The transposing quantizer reads pass 1's amaxes PAMAX_CHUNK (64) K-tiles per loop step: 65 K-tiles of 32
    (the plan's smallest BK; the default 128 needs 8320 rows, 3x slower in the interpreter) take two steps, and the
    codes, scales and FP8 fold equal the reference's."""
    from adahop.kernels._triton_quantize import PAMAX_CHUNK, mx_quantize

    x = _spread_rows(65 * 32, 8, seed=2080).to(torch.bfloat16)
    x[3, 5] = float("nan")
    assert 65 > PAMAX_CHUNK.value
    plan = dict(mode="tiles", BR=64, BK=32, NCHUNK=1, LAYOUT=1, VEC=2, num_warps=1)
    codes, scales, fp8, row_scale = mx_quantize(x, 0, 32, None, False, "floor", 8, None, plan=plan)
    qr = iht_quantize_mxfp4(x, axis=0, hadamard_block=32, signs=None, scale_rule="floor", max_scale_range=8,
                            backend="reference")
    assert torch.equal(codes, qr.codes) and torch.equal(scales, qr.scales)
    ref_fp8, ref_rs = fold_to_fp8(qr)
    assert torch.equal(fp8.view(torch.uint8), ref_fp8.view(torch.uint8))
    torch.testing.assert_close(row_scale, ref_rs, atol=0, rtol=0)


FOLD_CASES = [  # (rows, cols, axis, scale_rule): one tile, masked rows/K, the chunk loop (kp > 2048), ragged Kc
    (33, 64, 1, "floor"), (40, 50, 1, "tseng"), (7, 4160, 1, "rceil"), (96, 24, 0, "adahop"), (5, 2048, 1, "floor"),
]


@pytest.mark.parametrize("case", FOLD_CASES, ids=lambda c: f"{c[0]}x{c[1]}-ax{c[2]}-{c[3]}")
@interp
def test_interp_fold_bit_exact(case):
    """The Triton fold of saved packed MXFP4 equals the reference byte for byte: huge/tiny/zero
    blocks, a NaN block, a negative-zero code, the tseng row scale."""
    r, c, axis, rule = case
    x = _spread_rows(r, c, seed=c) if axis == 1 else _spread_rows(c, r, seed=c).t()
    x[4 % x.shape[0], 3 % x.shape[1]] = float("nan")
    q = quantize_mxfp4(x, axis=axis, scale_rule=rule, max_scale_range=8)
    q = dataclasses.replace(q, codes=q.codes.clone())
    q.codes.view(-1)[-1] |= 0x80  # a -0 code in the last element (0x8 decodes to -0.0; both folds write FP8 +0)
    ft, st = fold_to_fp8(q, backend="triton")
    fr, sr = fold_to_fp8(q, backend="reference")
    assert ft.dtype == torch.float8_e4m3fn and ft.shape == fr.shape and st.shape == sr.shape
    assert torch.equal(ft.view(torch.uint8), fr.view(torch.uint8))
    assert torch.equal(st, sr)
    torch.testing.assert_close(ft.float() * st[:, None], _moved(q, x), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("config", [dict(BR=2, BK=256, NCHUNK=1, num_warps=1), dict(BR=4, BK=512, NCHUNK=3, num_warps=2),
                                    dict(BR=1, BK=64, NCHUNK=5, num_warps=1)], ids=lambda c: "x".join(map(str, c.values())))
@interp
def test_interp_fold_split_over_programs_writes_the_default_configs_bytes(config):
    """A row folded by several programs (each reads the row's scales whole for its exponent) gives the
    bytes and row scales of the default config and of the reference: ragged rows and K, a NaN block."""
    from adahop.kernels._triton_fold import fold

    x = _spread_rows(7, 4160, seed=3)
    x[2, 100] = float("nan")
    q = quantize_mxfp4(x, axis=1, max_scale_range=8)
    f0, s0 = fold(q.codes, q.scales, 1.0)
    f1, s1 = fold(q.codes, q.scales, 1.0, config=config)
    fr, sr = fold_to_fp8(q, backend="reference")
    assert torch.equal(f1.view(torch.uint8), f0.view(torch.uint8)) and torch.equal(s1, s0)
    assert torch.equal(f1.view(torch.uint8), fr.view(torch.uint8)) and torch.equal(s1, sr)


@interp
def test_interp_fold_checks_the_range_unless_the_quantizer_did():
    q = quantize_mxfp4(_spread_rows(6, 64), axis=1)  # no limit: row 0 spans ~2^66..2^-100
    with pytest.raises(ValueError, match="max_scale_range=8"):
        fold_to_fp8(q, backend="triton")
    q8 = quantize_mxfp4(_spread_rows(6, 64), axis=1, max_scale_range=8)
    assert q8.scale_range == 8  # the fold trusts this and skips its device sync
    assert torch.equal(fold_to_fp8(q8, backend="triton")[0].view(torch.uint8),
                       fold_to_fp8(q8, backend="reference")[0].view(torch.uint8))
    from adahop.kernels._triton_fold import fold_op  # the triton_op

    torch.library.opcheck(fold_op, (q8.codes, q8.scales, 1.0), test_utils=("test_schema", "test_faketensor"))


@interp
@pytest.mark.parametrize("recipe", ["mxfp4-had", "adahop-lv1", "tseng", "mxfp4@saved-fp8"])
def test_interp_fast_layer_compiles_without_graph_break(recipe):
    """A converted linear on the Triton path under torch.compile(fullgraph=True): dynamo must trace
    the autograd.Function's backward (quantize, fold of the saved operands, FP8 GEMM) in one graph.
    (A host-side float() in the fold once broke it, silently, on the GPU.)"""
    from adahop.nn import convert_model, get_controller
    from adahop.patterns import Plan

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    convert_model(lin, recipe, backend="triton")
    if recipe.startswith("adahop"):  # a plan with OE on both backward GEMMs (X Row-wise, ∇Y Column-wise)
        get_controller(lin).set_plan(Plan.from_patterns({"0": {"x": "R", "w": "N", "dy": "C"}}))
    x = torch.randn(64, 64, requires_grad=True)
    out = torch.compile(lin, fullgraph=True, backend="aot_eager")(x)
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin[0].weight.grad).all()


@interp
@pytest.mark.parametrize("recipe", ["mxfp4", "tseng", "adahop-lv1"])
def test_interp_saved_fp8_runs_the_same_numbers_and_saves_the_fold(recipe, fwd_bwd):
    """``@saved-fp8`` (issue 18): X and W wait for backward as the FP8 fold the forward quantizer
    writes, so y, dX and dW are the packed-MXFP4 run's bit for bit (the fold is exact; tseng's
    4/3 rides in the row scale), and the saved bytes are the fold's: 1 byte an element plus a
    float32 row scale, against half a byte an element."""
    from adahop.nn import convert_model, get_controller
    from adahop.patterns import Plan

    t, k, n = 64, 64, 128  # multiples of tseng's 64-element Hadamard: nothing padded
    x0, dy = torch.randn(t, k), torch.randn(t, n)
    out, saved = {}, {}
    for name in (recipe, f"{recipe}@saved-fp8"):
        torch.manual_seed(0)
        lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
        convert_model(lin, name, backend="triton")
        if recipe.startswith("adahop"):  # IHT on both backward GEMMs: both saved operands quantized
            get_controller(lin).set_plan(Plan.from_patterns({"0": {"x": "N", "w": "N", "dy": "N"}}))
        out[name] = fwd_bwd(lin, lin[0], x0, dy)
        saved[name] = lin[0].saved_bytes
    for what, a, b in zip(("y", "dX", "dW"), *out.values()):
        assert torch.equal(a, b), what
    # the fold's byte an element for the codes' half byte, and a float32 row scale per row of Xᵀ and of
    # W along N (K rows each); scales (and tseng's saved sign vectors) the same
    assert saved[f"{recipe}@saved-fp8"] - saved[recipe] == (k * t + n * k) // 2 + 4 * (k + k)


@interp
def test_interp_inductor_inlines_the_triton_ops_and_matches_eager(fwd_bwd):
    """Issue 18 item 1: under Inductor (fullgraph, CPU, the interpreter), with the layer's GEMMs
    traced (``set_compiled_layers("traced")``), the quantizer and the fold are decomposed ``triton_op`` s: the generated code launches their kernels itself (here through
    the interpreter's launch op), allocates their outputs, and never calls the opaque ops; and a
    converted layer's y, dX and dW equal eager mode's. The recipe's plan puts OE on both backward
    GEMMs, so the quantizer's zero-row path, the fold of saved operands and top-k are all in it."""
    from torch._inductor.utils import run_and_get_code

    from adahop.nn import convert_model, get_controller
    from adahop.patterns import Plan

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False))
    convert_model(lin, "adahop-lv1", backend="triton")
    get_controller(lin).set_plan(Plan.from_patterns({"0": {"x": "R", "w": "N", "dy": "C"}}))
    x0, dy = torch.randn(32, 32), torch.randn(32, 64)

    def step(fn):
        return fwd_bwd(fn, lin[0], x0, dy)

    from adahop.nn.opaque import set_compiled_layers

    eager = step(lin)
    prev = set_compiled_layers("traced")  # the layer's GEMMs traced, so that Inductor sees the ops
    try:
        got, codes = run_and_get_code(step, torch.compile(lin, fullgraph=True))
    finally:
        set_compiled_layers(prev)
    code = "\n".join(codes)
    assert code.count("_mx_quantize_kernel") >= 4 and "_fold_kernel" in code, "the launches are not in the generated code"
    assert "torch.ops.adahop.iht_quantize_mxfp4" not in code and "torch.ops.adahop.fold_mxfp4_to_fp8" not in code
    assert "_scaled_mm" in code  # the FP8 GEMM is traced as the aten op, not hidden in a custom op
    for what, a, b in zip(("y", "dX", "dW"), got, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{what}: compiled != eager")
    # the default form (adahop.nn.opaque): the layer is two ops that run the same kernels from their bodies
    torch.compiler.reset()
    got, codes = run_and_get_code(step, torch.compile(lin, fullgraph=True))
    code = "\n".join(codes)
    assert "torch.ops.adahop.lp_linear_fwd" in code and "torch.ops.adahop.lp_linear_bwd" in code
    assert "_mx_quantize_kernel" not in code
    for what, a, b in zip(("y", "dX", "dW"), got, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{what}: compiled (opaque) != eager")
    torch.compiler.reset()


@interp
def test_interp_round_to_nearest_ties():
    """Every E2M1 midpoint, its float neighbours, saturation and signed zeros, at scale 1."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 7.9, 0.0, 1e-30])
    vals = torch.cat((mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 9.0))))
    vals = torch.cat((vals, -vals, torch.tensor([-0.0])))  # 73 values
    x = torch.cat((vals, torch.zeros(96 - vals.numel()))).reshape(3, 32)
    x[:, 0] = 7.99  # block amax in [4, 8): floor exponent 0, so the values are encoded as they are
    for axis, xx in ((1, x), (0, x.t().contiguous())):
        qt = iht_quantize_mxfp4(xx, axis=axis, hadamard_block=None, backend="triton")
        qr = iht_quantize_mxfp4(xx, axis=axis, hadamard_block=None, backend="reference")
        assert torch.equal(qr.scales, torch.full_like(qr.scales, 127))
        torch.testing.assert_close(qt.codes, qr.codes, atol=0, rtol=0)
        assert torch.equal(qt.fp8[0].view(torch.uint8), fold_to_fp8(qr)[0].view(torch.uint8))


@interp
@pytest.mark.parametrize("rule", ["floor", "adahop", "rceil"])
def test_interp_signed_zeros_and_zero_blocks_match_the_reference(rule):
    """The official encoder's byte conventions in the kernel: a negative value that rounds to zero
    and an input -0 are code 8 (no Hadamard); an exact zero out of the Hadamard is +0; an all-zero
    block has scale code 1 under the adahop rule, 0 under the others."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g)
    x[:, 1::7] *= -1e-4  # tiny values, half of them negative: they round to ±0
    x[5] = -0.0  # a row of -0: zero blocks (and zero Hadamard groups)
    x[9, :32] = -0.0
    x[11, 32:64] = 0.0
    x[13, 3:40] = -0.0
    for hb, axis in ((None, 1), (32, 1), (None, 0), (16, 0)):
        xx = x if axis == 1 else x.t().contiguous()
        kw = dict(axis=axis, hadamard_block=hb, scale_rule=rule, max_scale_range=8)
        qt = iht_quantize_mxfp4(xx, backend="triton", **kw)
        qr = iht_quantize_mxfp4(xx, backend="reference", **kw)
        assert torch.equal(qt.codes, qr.codes) and torch.equal(qt.scales, qr.scales), (hb, axis)
        assert torch.equal(qt.fp8[0].view(torch.uint8), fold_to_fp8(qr)[0].view(torch.uint8)), (hb, axis)
        nibbles = torch.cat((qr.codes & 15, qr.codes >> 4))
        assert (nibbles == 8).any(), (hb, axis)  # -0 codes occur
        if hb is None and axis == 1:
            assert qr.codes[5].tolist() == [0x88] * 48 and qr.scales[5].tolist() == [1 if rule == "adahop" else 0] * 3
        if hb is not None and axis == 1:
            assert qr.codes[5].tolist() == [0] * 48  # the Hadamard of a -0 row is +0


@interp
def test_interp_quantizer_writes_every_output():
    """Poisoned output buffers: two different poisons give the same, reference, result."""
    from adahop.kernels import _triton_quantize

    x = torch.randn(40, 64)  # axis=0: 64 rows of kc=40 (padded to 64), no Hadamard
    results = []
    for poison in (0x00, 0xFF):
        out = (torch.full((64, 32), poison, dtype=torch.uint8), torch.full((64, 2), poison, dtype=torch.uint8),
               torch.full((64, 64), poison, dtype=torch.uint8).view(torch.float8_e4m3fn),
               torch.full((64,), float("nan")))
        results.append(_triton_quantize.mx_quantize(x, 0, 0, None, False, "floor", 8, None, out=out))
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    qr = iht_quantize_mxfp4(x, axis=0, hadamard_block=None, backend="reference")
    assert torch.equal(results[0][0], qr.codes) and torch.equal(results[0][1], qr.scales)


@interp
def test_interp_stochastic_rounding_is_unbiased():
    x = torch.randn(32, 64)
    v = hadamard_butterfly(x, block_size=32, axis=1)
    kw = dict(axis=1, rounding="stochastic", scale_rule="rceil")
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([iht_quantize_mxfp4(x, generator=g, backend="triton", **kw).dequantize() for _ in range(16)])
    rne = iht_quantize_mxfp4(x, axis=1, scale_rule="rceil", backend="reference").dequantize()
    assert not torch.equal(draws[0], draws[1])  # fresh bits per call
    err_mean = (draws.mean(0) - v).pow(2).mean().sqrt()
    err_rne = (rne - v).pow(2).mean().sqrt()
    assert err_mean < 0.5 * err_rne, f"mean of 16 SR draws {err_mean:.4g} vs RNE {err_rne:.4g}"
    bias = (draws - v).mean().abs() / v.abs().mean()
    assert bias < 5e-3, f"relative bias {bias:.3g}"
    a = iht_quantize_mxfp4(x, generator=torch.Generator().manual_seed(7), backend="triton", **kw)
    b = iht_quantize_mxfp4(x, generator=torch.Generator().manual_seed(7), backend="triton", **kw)
    assert torch.equal(a.codes, b.codes)  # reproducible under a seed


@interp
def test_interp_path_end_to_end():
    """Quantize both operands with the kernel, then the FP8 GEMM op (CPU `_scaled_mm`)."""
    a, b = torch.randn(40, 128), torch.randn(128, 24)
    qa = iht_quantize_mxfp4(a, axis=1, backend="triton")
    qb = iht_quantize_mxfp4(b, axis=0, backend="triton")
    assert qa.fp8 is not None and qb.fp8 is not None
    assert _rel(mx_matmul(qa, qb, backend="triton"), mx_matmul_reference(qa, qb)) < 1e-5
    assert _rel(mx_matmul(qa, qb, backend="triton", accumulation="fp32"), mx_matmul_reference(qa, qb)) < 1e-6


@interp
def test_interp_custom_op_traces():
    x = torch.randn(64, 64)
    from adahop.kernels._triton_quantize import quantize_op  # the triton_op

    torch.library.opcheck(quantize_op, (x, 0, 32, None, False, "floor", 8, None),
                          test_utils="test_faketensor")

    def f(x, w):
        qx = iht_quantize_mxfp4(x, axis=1, backend="triton")
        qw = mx_transpose(iht_quantize_mxfp4(w, axis=1, backend="triton"))
        return mx_matmul(qx, qw, backend="triton")

    w = torch.randn(32, 64)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x, w), f(x, w))


@interp
@pytest.mark.parametrize("axis", [1, 0])
def test_interp_outputs_and_zero_rows_match_the_reference(axis):
    """``outputs="fp8"`` writes the same fold without codes, ``"codes"`` the same codes without the
    fold; ``zero_rows`` equals quantizing ``x.index_fill(1 - axis, rows, 0)``, NaN rows included."""
    x = _spread_rows(48, 96, seed=3) if axis == 1 else _spread_rows(96, 48, seed=3)
    rows = torch.tensor([0, 5, 17, 47])  # rows of the dim not quantized along (48 of them)
    if axis == 1:
        x[5, 9] = float("nan")  # an extracted row holding a NaN quantizes as zeros too
    else:
        x[9, 5] = float("nan")
    kw = dict(axis=axis, hadamard_block=32, max_scale_range=8)
    ref = iht_quantize_mxfp4(x.index_fill(1 - axis, rows, 0), backend="reference", **kw)
    fp8, rs = fold_to_fp8(ref)
    assert torch.isfinite(ref.dequantize()).all()
    full = iht_quantize_mxfp4(x, backend="triton", zero_rows=rows, **kw)
    only_fp8 = iht_quantize_mxfp4(x, backend="triton", zero_rows=rows, outputs="fp8", **kw)
    only_codes = iht_quantize_mxfp4(x, backend="triton", zero_rows=rows, outputs="codes", **kw)
    for q in (full, only_codes):
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
    assert only_codes.fp8 is None and only_fp8.codes_dropped and only_fp8.codes.shape == (48, 0)
    for q in (full, only_fp8):
        assert torch.equal(q.fp8[0].view(torch.uint8), fp8.view(torch.uint8)) and torch.equal(q.fp8[1], rs)
    torch.testing.assert_close(only_fp8.dequantize(), ref.dequantize(), atol=0, rtol=0)
    assert torch.equal(fold_to_fp8(only_fp8)[0].view(torch.uint8), fp8.view(torch.uint8))
    assert only_fp8.nbytes == 48 * 96 // 32 + 48 * 96 + 4 * 48  # scales + fold + row scales
    assert only_codes.nbytes == 48 * 96 // 2 + 48 * 96 // 32
    b = iht_quantize_mxfp4(torch.randn(96, 24) if axis == 1 else torch.randn(24, 96).t(), axis=0, backend="triton")
    a = only_fp8 if axis == 1 else iht_quantize_mxfp4(torch.randn(24, 96), axis=1, backend="triton", outputs="fp8")
    if axis == 1:  # an FP8-only operand goes through both GEMM twins
        assert _rel(mx_matmul(a, b, backend="triton"), mx_matmul_reference(a, b)) < 1e-5


def test_folds_exactly_is_the_fold_range():
    from adahop.kernels import FOLD_RANGE, folds_exactly

    assert [folds_exactly(r) for r in (None, -1, 0, FOLD_RANGE, FOLD_RANGE + 1)] == [False, False, True, True, False]


@interp
def test_interp_emulated_mx_linear_matches_the_reference(how="dequant-bf16"):
    """The torchao-style bench baseline computes MXFP4 GEMMs: y, dX and dW equal the reference
    quantizer's dequantized operands multiplied in FP32 (floor rule, no range limit), to BF16 output
    rounding. (The ``dot_scaled`` baseline is checked the same way on the GPU by
    ``scripts/validate_kernels.py``: Triton 3.6's interpreter cannot run ``tl.dot_scaled``.)"""
    from adahop.bench.emulated import EmulatedMXLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 256, bias=False)
    layer = EmulatedMXLinear(lin, how)
    x = (torch.randn(128, 128) * 3).requires_grad_(True)
    dy = torch.randn(128, 256)
    y = layer(x)
    y.backward(dy)
    q = lambda t, axis: quantize_mxfp4(t.contiguous(), axis=axis).dequantize(torch.float32)  # noqa: E731
    w = lin.weight.detach()
    want = (q(x.detach(), 1) @ q(w, 1).t(), q(dy, 1) @ q(w, 0), q(dy, 0).t() @ q(x.detach(), 0))
    for got, ref in zip((y.detach(), x.grad, lin.weight.grad), want):
        assert got.shape == ref.shape
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 3e-3, err  # the GEMMs round their outputs to BF16 (dequant-bf16 always)
    assert layer.saved_bytes == (128 * 64 + 128 * 4) + (128 * 128 + 128 * 8)  # X along T, W along N: codes + scales
    with torch.no_grad():  # the fprop alone: the same output, nothing saved
        layer.saved_bytes = -1
        assert torch.equal(layer(x), y.detach()) and layer.saved_bytes == -1


def test_fold_writes_a_negative_zero_code_as_positive_zero():
    """Code 8 (-0, which the official encoder writes for a negative value that rounds to zero) folds
    to FP8 +0 (0x00) in the reference table, the byte the Triton quantizer and fold write on the H200;
    -0.5 (code 9) keeps its sign."""
    from adahop.formats import MXTensor

    codes = torch.tensor([[0x98] + [0] * 15], dtype=torch.uint8)  # elements: code 8, code 9, then +0
    q = MXTensor(codes=codes, scales=torch.tensor([[127]], dtype=torch.uint8), shape=(1, 32), axis=1, scale_range=8)
    f8, rs = fold_to_fp8(q, backend="reference")
    assert f8.view(torch.uint8)[0, :2].tolist() == [0x00, torch.tensor(-0.5).to(torch.float8_e4m3fn).view(torch.uint8).item()]
    assert rs.tolist() == [1.0]
