"""`lowp_matmul` and the GEMM engine: exactness without quantization, parity with a hand-written
reference, OE index selection, and argument errors (`specs/adahop.md` §3, §4, §11)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adahop import lowp_matmul
from adahop.formats import quantize_mxfp4
from adahop.gemm import prepare
from adahop.hadamard import block_hadamard
from adahop.recipes import GemmSpec, OperandSpec
from adahop.recipes.spec import STRATEGIES

SHAPES = [(64, 64, 64), (129, 200, 96), (33, 96, 17), (5, 31, 7)]
QUANT_SHAPES = [(64, 64, 64), (129, 200, 96), (96, 160, 72)]
EMPTY_SHAPES = [(0, 64, 32), (64, 64, 0), (48, 0, 32)]



def _ids(shapes):
    return ["x".join(map(str, s)) for s in shapes]


def _operands(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    a[torch.randperm(m, generator=g)[: max(1, m // 16)]] *= 20  # outlier rows of A
    b[:, torch.randperm(n, generator=g)[: max(1, n // 16)]] *= 20  # outlier columns of B
    a[:, 3] *= 8  # an outlier column of A along K
    return a, b


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


# ---- the slow reference, composed by hand (spec §11) ----------------------------------------


def _q(t: torch.Tensor, axis: int, iht: bool, **qkw) -> torch.Tensor:
    """Zero-pad the contracted ``axis`` to a multiple of 32, block-Hadamard it (IHT), quantize
    to MXFP4 along it and dequantize (padding is zeros, so it leaves the product unchanged)."""
    pad = (-t.shape[axis]) % 32
    t = F.pad(t, (0, pad)) if axis == 1 else F.pad(t, (0, 0, 0, pad))
    if iht:
        t = block_hadamard(t, block_size=32, axis=axis)
    return quantize_mxfp4(t, axis=axis, **qkw).dequantize(torch.float32)


def _lp_gemm(a, b, iht, **qkw):
    return _q(a, 1, iht, **qkw) @ _q(b, 0, iht, **qkw)


def reference_lowp_matmul(a, b, strategy, oe_rank=64, **qkw):
    if strategy == "bf16":
        return a @ b
    if strategy == "none":
        return _lp_gemm(a, b, False, **qkw)
    if strategy == "iht":
        return _lp_gemm(a, b, True, **qkw)
    if strategy == "iht+oe_left":  # top-k rows of A by L2 norm go through the exact path
        idx = torch.topk(a.norm(dim=1), min(oe_rank, a.shape[0])).indices
        a_clean = a.clone()
        a_clean[idx] = 0
        c = _lp_gemm(a_clean, b, True, **qkw)
        c[idx] += a[idx] @ b
        return c
    if strategy == "iht+oe_right":  # top-k columns of B by L2 norm
        idx = torch.topk(b.norm(dim=0), min(oe_rank, b.shape[1])).indices
        b_clean = b.clone()
        b_clean[:, idx] = 0
        c = _lp_gemm(a, b_clean, True, **qkw)
        c[:, idx] += a @ b[:, idx]
        return c
    raise AssertionError(strategy)


# ---- exactness with the quantizer switched off ----------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unquantized_is_exact(strategy, shape):
    a, b = _operands(*shape)
    c = lowp_matmul(a, b, strategy=strategy, oe_rank=4, quantize=False)
    assert c.shape == (shape[0], shape[2]) and c.dtype == torch.float32
    rel = _rel(c, a.double() @ b.double())
    assert rel < 1e-6, f"{strategy} {shape}: rel {rel:.2e}"


# ---- parity with the hand-written reference -------------------------------------------------

QUANT = [dict(), dict(scale_rule="adahop", max_scale_range=8)]


@pytest.mark.parametrize("qkw", QUANT, ids=["floor", "adahop-r8"])
@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=_ids(QUANT_SHAPES))
@pytest.mark.parametrize("strategy", ["none", "iht", "iht+oe_left", "iht+oe_right"])
def test_matches_reference(strategy, shape, qkw):
    a, b = _operands(*shape, seed=1)
    oe_rank = 8
    c = lowp_matmul(a, b, strategy=strategy, oe_rank=oe_rank, **qkw)
    ref = reference_lowp_matmul(a, b, strategy, oe_rank=oe_rank, **qkw)
    rel = _rel(c, ref)
    assert rel < 1e-6, f"{strategy} {shape}: rel {rel:.2e} to the reference"
    # and it is a real low-precision GEMM: far from exact, but not garbage
    err = _rel(c, a.double() @ b.double())
    assert 1e-3 < err < 0.3, f"{strategy} {shape}: error {err:.3f} to the exact product"


def test_iht_and_oe_reduce_error_on_their_patterns(gen):
    """IHT helps inner-dimension outliers; OE-Left helps A-row, OE-Right B-column outliers."""
    a, b = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    exact = lambda x, y: x.double() @ y.double()  # noqa: E731
    a_col = a.clone()
    a_col[:, :8] *= 10
    assert _rel(lowp_matmul(a_col, b, strategy="iht"), exact(a_col, b)) < \
        0.9 * _rel(lowp_matmul(a_col, b, strategy="none"), exact(a_col, b))
    a_row = a.clone()
    a_row[:8] *= 10
    assert _rel(lowp_matmul(a_row, b, strategy="iht+oe_left", oe_rank=8), exact(a_row, b)) < \
        0.6 * _rel(lowp_matmul(a_row, b, strategy="iht"), exact(a_row, b))
    b_col = b.clone()
    b_col[:, :8] *= 10
    assert _rel(lowp_matmul(a, b_col, strategy="iht+oe_right", oe_rank=8), exact(a, b_col)) < \
        0.6 * _rel(lowp_matmul(a, b_col, strategy="iht"), exact(a, b_col))


# ---- OE index selection ---------------------------------------------------------------------


def test_oe_left_extracts_top_rows_by_l2_norm(gen):
    a, b = torch.randn(96, 64, generator=gen), torch.randn(64, 40, generator=gen)
    planted = torch.tensor([7, 30, 31, 80, 95])
    a[planted] *= torch.tensor([3.0, 9.0, 5.0, 4.0, 6.0])[:, None]
    spec = GemmSpec(strategy="iht+oe_left", oe_rank=5)
    p = prepare(a, "a", spec)
    assert sorted(p.oe_idx.tolist()) == planted.tolist()
    assert torch.equal(p.oe_slab, a[p.oe_idx])
    assert torch.all(p.q.dequantize()[planted] == 0)  # the clean operand has those rows zeroed
    # the extracted rows of the output are exact (up to FP32 rounding)
    c = lowp_matmul(a, b, strategy="iht+oe_left", oe_rank=5)
    assert _rel(c[planted], a[planted].double() @ b.double()) < 1e-6
    assert _rel(c, a.double() @ b.double()) > 1e-3


def test_oe_ranks_by_l2_norm_not_abs_max(gen):
    a = torch.randn(64, 64, generator=gen) * 0.1
    a[3, 0] = 50.0  # largest single element, L2 norm ≈ 50
    a[9] = 7.0  # every element moderate, L2 norm = 56
    p = prepare(a, "a", GemmSpec(strategy="iht+oe_left", oe_rank=1))
    assert p.oe_idx.tolist() == [9]


def test_oe_right_extracts_top_columns_by_l2_norm(gen):
    a, b = torch.randn(48, 64, generator=gen), torch.randn(64, 128, generator=gen)
    planted = torch.tensor([0, 17, 64, 127])
    b[:, planted] *= torch.tensor([4.0, 7.0, 3.0, 5.0])
    p = prepare(b, "b", GemmSpec(strategy="iht+oe_right", oe_rank=4))
    assert sorted(p.oe_idx.tolist()) == planted.tolist()
    assert torch.equal(p.oe_slab, b[:, p.oe_idx])
    assert torch.all(p.q.dequantize()[:, planted] == 0)
    c = lowp_matmul(a, b, strategy="iht+oe_right", oe_rank=4)
    assert _rel(c[:, planted], a.double() @ b[:, planted].double()) < 1e-6


@pytest.mark.parametrize("strategy,shape", [("iht+oe_left", (16, 64, 48)), ("iht+oe_right", (48, 64, 16)),
                                            ("iht+oe_left", (64, 96, 32)), ("iht+oe_right", (20, 40, 3))])
def test_oe_rank_at_least_rows_is_exact(strategy, shape, gen):
    """Every row of A (or column of B) extracted: the whole product takes the exact path."""
    m, k, n = shape
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    c = lowp_matmul(a, b, strategy=strategy, oe_rank=64)
    assert c.shape == (m, n)
    assert _rel(c, a.double() @ b.double()) < 1e-6


# ---- dtypes and errors ----------------------------------------------------------------------


def test_output_dtype_follows_a(gen):
    a, b = torch.randn(32, 64, generator=gen).bfloat16(), torch.randn(64, 32, generator=gen).bfloat16()
    assert lowp_matmul(a, b, strategy="iht").dtype == torch.bfloat16
    assert lowp_matmul(a, b, strategy="bf16").dtype == torch.bfloat16


def test_shape_and_argument_errors():
    a, b = torch.randn(8, 32), torch.randn(32, 4)
    with pytest.raises(ValueError, match=r"\(8, 32\) and \(33, 4\)"):
        lowp_matmul(a, torch.randn(33, 4), strategy="iht")
    with pytest.raises(ValueError, match="needs a"):
        lowp_matmul(torch.randn(32), b, strategy="none")
    with pytest.raises(ValueError, match="needs a"):
        lowp_matmul(a, torch.randn(2, 32, 4), strategy="none")
    with pytest.raises(ValueError, match="strategy='fancy'"):
        lowp_matmul(a, b, strategy="fancy")
    with pytest.raises(ValueError, match="fmt='int4'"):
        lowp_matmul(a, b, strategy="iht", fmt="int4")
    with pytest.raises(ValueError, match="oe_rank=0"):
        lowp_matmul(a, b, strategy="iht+oe_left", oe_rank=0)
    with pytest.raises(ValueError, match="side must be"):
        prepare(a, "c", GemmSpec(strategy="iht"))
    with pytest.raises(ValueError, match="'calibrated' must be resolved"):
        prepare(a, "a", GemmSpec(strategy="calibrated", a=OperandSpec(), b=OperandSpec()))


@pytest.mark.parametrize("strategy", ["bf16", "none", "iht", "iht+oe_left", "iht+oe_right"])
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=_ids(EMPTY_SHAPES))
def test_an_empty_product_gives_what_matmul_gives(strategy, shape):
    # an MoE expert that got no tokens calls with M = 0: torch answers zeros of [M, N], and so must every strategy
    m, k, n = shape
    a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
    y = lowp_matmul(a, b, strategy=strategy)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert torch.equal(y, a @ b)


@pytest.mark.parametrize("strategy", ["iht+oe_left", "iht+oe_right"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_oe_writes_slab_products_into_exact_zeros(strategy, out_dtype, gen):
    """OE zeroes its rows of A (columns of B) before quantizing, so the clean product is exactly 0
    there and `multiply` writes the slab products in place: equal, bit for bit, to adding them to an
    FP32 product and casting (the formula of `specs/adahop.md` §4)."""
    from adahop.gemm import multiply
    from adahop.kernels import mx_matmul

    a = (torch.randn(96, 128, generator=gen) * torch.rand(96, 1, generator=gen) * 8).bfloat16()
    b = (torch.randn(128, 80, generator=gen) * torch.rand(1, 80, generator=gen) * 8).bfloat16()
    op = OperandSpec(fmt="mxfp4", max_scale_range=8)
    spec = GemmSpec(strategy=strategy, a=op, b=op, oe_rank=16)
    pa, pb = prepare(a, "a", spec), prepare(b, "b", spec)
    clean = mx_matmul(pa.q, pb.q)  # FP32
    idx = pa.oe_idx if strategy == "iht+oe_left" else pb.oe_idx
    dim = 0 if strategy == "iht+oe_left" else 1
    assert clean.index_select(dim, idx).abs().max() == 0
    slab = pa.oe_slab @ pb.hp if dim == 0 else pa.hp @ pb.oe_slab
    want = clean.index_add(dim, idx, slab.float()).to(out_dtype)
    got = multiply(pa, pb, spec, out_dtype=out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
