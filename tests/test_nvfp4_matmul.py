"""The NVFP4 GEMM (`adahop.kernels.nvfp4_matmul`): the BF16-exactness claim its fast path rests on,
the fast path's CPU emulation against the FP32 reference, layouts and errors, and the GEMM engine
using it for the nvfp4 / averis specs (`specs/baselines.md` §1.7)."""

from __future__ import annotations

import pytest
import torch

from adahop.formats import NVFP4Tensor, quantize_mxfp4, quantize_nvfp4
from adahop.formats.e2m1 import decode_e2m1, pack_e2m1
from adahop.gemm import gemm
from adahop.kernels import (
    check_nvfp4_layout,
    nvfp4_block_values,
    nvfp4_kc_sums,
    nvfp4_matmul,
    nvfp4_matmul_bf16,
    nvfp4_matmul_reference,
)
from adahop.recipes import get_recipe


def _finite_e4m3() -> torch.Tensor:
    """All 254 finite E4M3 values (every byte but the two NaNs 0x7F, 0xFF), float32."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v)]
    assert v.numel() == 254
    return v


def test_every_e2m1_value_times_every_e4m3_scale_is_exact_in_bf16():
    """The claim of the fast path: q·s has at most 6 significant bits and |q·s| in [2^-10, 2688]
    (or 0), so BF16 holds it exactly; and BF16 × BF16 (one rounding of the product) gives it."""
    q = decode_e2m1(torch.arange(16, dtype=torch.uint8))  # all 16 codes, -0 included
    s = _finite_e4m3()
    exact = q[:, None] * s[None, :]  # float32: exact (6 bits)
    assert torch.equal(exact.to(torch.bfloat16).float().view(torch.int32), exact.view(torch.int32))  # bit for bit, signs of 0 too
    bf = q.to(torch.bfloat16)[:, None] * s.to(torch.bfloat16)[None, :]
    assert torch.equal(bf.float().view(torch.int32), exact.view(torch.int32))
    nz = exact[exact != 0].abs()
    assert nz.min() == 2.0**-10 and nz.max() == 2688.0
    m, _ = torch.frexp(nz)  # significand in [0.5, 1): 6 bits means m·2^6 is an integer
    assert torch.equal(m * 64, torch.round(m * 64))


def test_block_values_are_q_times_block_scale_bit_for_bit():
    """nvfp4_block_values of a tensor holding every code in every block, one block per finite E4M3
    scale (and a NaN scale): the FP32 product q·s exactly, NaN blocks NaN."""
    s = torch.cat((_finite_e4m3(), torch.tensor([float("nan")])))
    rows = s.numel()
    codes = torch.arange(16, dtype=torch.uint8).repeat(rows, 1)  # [rows, 16]: one block per row
    q = NVFP4Tensor(codes=pack_e2m1(codes), scales=s.to(torch.float8_e4m3fn)[:, None], global_scale=torch.tensor(1.0),
                    shape=(rows, 16), axis=1)
    v = nvfp4_block_values(q)
    assert v.dtype == torch.bfloat16 and v.shape == (rows, 16)
    want = decode_e2m1(codes) * s[:, None]
    assert torch.equal(v[:-1].float().view(torch.int32), want[:-1].view(torch.int32))
    assert torch.isnan(v[-1]).all()


def _operands(m, kc, n, gen, tile_b=False, spread=True):
    a = torch.randn(m, kc, generator=gen)
    b = torch.randn(kc, n, generator=gen)
    if spread:  # block scales over a wide range, a few outlier channels
        a *= torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen).float())
        b[:, : max(1, n // 8)] *= 30.0
    return quantize_nvfp4(a, axis=1), quantize_nvfp4(b, axis=0, tile_2d=tile_b)


def _rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("m, kc, n, tile_b", [(64, 128, 48, False), (33, 200, 17, True), (5, 7, 3, False),
                                              (96, 1024, 40, True)])
def test_fast_path_emulation_equals_the_reference(m, kc, n, tile_b, gen):
    """The fast path on the CPU (BF16 values multiplied in FP32, tensor scales after the sum) equals
    the FP32 dequantized reference to FP32 rounding, for ragged Kc and 16×16 weight tiles."""
    qa, qb = _operands(m, kc, n, gen, tile_b)
    exact = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64)
    ref = nvfp4_matmul_reference(qa, qb)
    fast = nvfp4_matmul_bf16(qa, qb)
    assert fast.shape == ref.shape == (m, n) and fast.dtype == torch.float32
    assert _rel(fast, ref) < 1e-6 and _rel(fast, exact) < 1e-6 and _rel(ref, exact) < 1e-6
    fast16 = nvfp4_matmul_bf16(qa, qb, out_dtype=torch.bfloat16)
    assert fast16.dtype == torch.bfloat16 and torch.equal(fast16, fast.to(torch.bfloat16))


def test_dispatch_and_nan_blocks(gen):
    qa, qb = _operands(16, 64, 8, gen)
    assert torch.equal(nvfp4_matmul(qa, qb), nvfp4_matmul_reference(qa, qb))  # auto on the CPU: the reference
    with pytest.raises(ValueError, match="backend"):
        nvfp4_matmul(qa, qb, backend="cublas")
    x = torch.randn(4, 32, generator=gen)
    x[1, 3] = float("nan")
    qx = quantize_nvfp4(x, axis=1)
    out = nvfp4_matmul_bf16(qx, quantize_nvfp4(torch.randn(32, 8, generator=gen), axis=0))
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3]]).all()


def test_layout_errors_name_the_problem(gen):
    qa, qb = _operands(16, 64, 8, gen)
    with pytest.raises(ValueError, match="qa is blocked along axis=0.*not prepared for the same GEMM"):
        nvfp4_matmul(quantize_nvfp4(torch.randn(16, 64), axis=0), qb)
    with pytest.raises(ValueError, match="qb is blocked along axis=1"):
        nvfp4_matmul(qa, quantize_nvfp4(torch.randn(64, 8), axis=1))
    with pytest.raises(ValueError, match="contracted dims differ"):
        nvfp4_matmul(qa, quantize_nvfp4(torch.randn(48, 8), axis=0))
    with pytest.raises(ValueError, match="must be an NVFP4Tensor, got MXTensor"):
        nvfp4_matmul(qa, quantize_mxfp4(torch.randn(64, 8), axis=0))
    assert check_nvfp4_layout(qa, qb) == (16, 64, 8)


def test_block_values_and_kc_sums_refuse_what_is_not_a_2d_nvfp4_operand(gen):
    """nvfp4_block_values / nvfp4_kc_sums are public: an MXTensor (uint8 E8M0 scale codes, blocks
    of 32) went through nvfp4_block_values with no error and came out as wrong numbers (the codes
    read as 16-element blocks times the scale bytes as integers), and a 3-D or 1-D operand failed
    with "too many values to unpack" (fresh-user pass)."""
    with pytest.raises(ValueError, match="nvfp4_block_values: q must be an NVFP4Tensor, got MXTensor"):
        nvfp4_block_values(quantize_mxfp4(torch.randn(4, 64, generator=gen), axis=1))
    with pytest.raises(ValueError, match="nvfp4_kc_sums: q must be an NVFP4Tensor, got Tensor"):
        nvfp4_kc_sums(torch.randn(4, 64, generator=gen))
    for shape, axis in (((2, 4, 32), -1), ((32,), 0)):
        with pytest.raises(ValueError, match=r"nvfp4_block_values: q must be 2-D"):
            nvfp4_block_values(quantize_nvfp4(torch.randn(shape, generator=gen), axis=axis))
        with pytest.raises(ValueError, match=r"nvfp4_kc_sums: q must be 2-D"):
            nvfp4_kc_sums(quantize_nvfp4(torch.randn(shape, generator=gen), axis=axis))


@pytest.mark.parametrize("axis", [1, 0])
def test_kc_sums_equal_the_dequantized_sums(axis, gen):
    x = torch.randn(40, 72, generator=gen) * torch.exp2(torch.randint(-5, 6, (40, 1), generator=gen).float())
    q = quantize_nvfp4(x, axis=axis, rounding="stochastic", generator=gen)
    want = q.dequantize(torch.float64).sum(dim=axis)
    got = nvfp4_kc_sums(q)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("recipe, gemm_name", [("nvfp4", "fprop"), ("nvfp4", "dgrad"), ("nvfp4", "wgrad"),
                                               ("averis", "fprop"), ("averis", "wgrad")])
def test_engine_fast_path_equals_reference_for_the_nvfp4_recipes(recipe, gemm_name, gen, monkeypatch):
    """`adahop.gemm` with backend "triton" (run on the CPU under TRITON_INTERPRET=1, where the NVFP4
    product is the emulation) equals the reference backend to FP32 rounding, Averis's mean split and
    cross terms included; the same draws on both sides (the generator reseeded, and the quantizer's
    reference twin standing in for its Triton kernel, which tests/test_nvfp4_quantize.py checks)."""
    import adahop.kernels.quantize_nvfp4 as qn

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(qn, "iht_quantize_nvfp4_triton", qn.iht_quantize_nvfp4_reference)
    spec = get_recipe(recipe).gemm(gemm_name)
    a = torch.randn(64, 96, generator=gen) + 0.5  # a token mean for Averis to split off
    b = torch.randn(96, 48, generator=gen)
    outs = [gemm(a, b, spec, generator=torch.Generator().manual_seed(3), backend=be, out_dtype=torch.float32)
            for be in ("reference", "triton")]
    exact = a.double() @ b.double()
    assert _rel(outs[0], exact) < 0.3  # it is an FP4 GEMM of the right product
    assert _rel(outs[1], outs[0]) < 1e-6
