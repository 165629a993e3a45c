"""Hadamard matrices and block transforms: T-RHT1 (orthogonality) and T-RHT2 (GEMM cancellation)
of `specs/baselines.md` §5, plus the shape guards of T-RHT3."""

from __future__ import annotations

import math

import pytest
import torch

from adahop.hadamard import SUPPORTED_SIZES, _fwht, _sylvester, block_hadamard, hadamard_matrix, kron_factors, random_signs

pytestmark = pytest.mark.usefixtures("single_thread")

DENSE_SIZES = [n for n in SUPPORTED_SIZES if n <= 256]


@pytest.mark.parametrize("n", DENSE_SIZES)
def test_hadamard_is_orthonormal_and_symmetric(n):
    h = hadamard_matrix(n, dtype=torch.float64)
    assert h.shape == (n, n) and h.dtype == torch.float64
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(h, h.T)
    # every entry is ±1/√n, and the first row and column are all +
    assert torch.allclose(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64), rtol=0, atol=1e-15)
    assert (h[0] > 0).all() and (h[:, 0] > 0).all()


def test_small_hadamards_explicit():
    s = 1 / math.sqrt(2)
    assert hadamard_matrix(1).tolist() == [[1.0]]
    h2 = torch.tensor([[s, s], [s, -s]], dtype=torch.float64)
    torch.testing.assert_close(hadamard_matrix(2, dtype=torch.float64), h2, rtol=0, atol=0)
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64) / 2
    assert torch.equal(hadamard_matrix(4, dtype=torch.float64), h4)


def test_hadamard_dtype_device_and_cache_safety():
    assert hadamard_matrix(16).dtype == torch.float32
    assert hadamard_matrix(16, dtype=torch.bfloat16).dtype == torch.bfloat16
    h = hadamard_matrix(8, dtype=torch.float64)
    h.mul_(2)  # the caller owns the result: editing it must not change later calls
    assert hadamard_matrix(8, dtype=torch.float64)[0, 0].item() == pytest.approx(1 / math.sqrt(8), abs=0)


@pytest.mark.parametrize("n", [0, 3, 12, 48, 100, 65536, 2.0, -4])
def test_hadamard_rejects_unsupported_sizes(n):
    with pytest.raises(ValueError, match=r"powers of two 1, 2, 4, \.\.\., 32768") as e:
        hadamard_matrix(n)
    assert repr(n) in str(e.value)


@pytest.mark.parametrize("b", [16, 32, 64, 128, 256, 512, 1024])
def test_block_hadamard_without_signs_is_self_inverse(b, gen):
    x = torch.randn(3, 2048, generator=gen, dtype=torch.float64)
    y = block_hadamard(x, block_size=b)
    assert not torch.allclose(y, x)
    torch.testing.assert_close(block_hadamard(y, block_size=b), x, rtol=0, atol=1e-12)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)  # orthonormal


@pytest.mark.parametrize("b", [512, 1024, 2048])
def test_kronecker_path_equals_dense_product(b, gen):
    x = torch.randn(4, 2 * b, generator=gen, dtype=torch.float64)
    dense = (x.reshape(4, 2, b) @ hadamard_matrix(b, dtype=torch.float64)).reshape(4, 2 * b)
    torch.testing.assert_close(block_hadamard(x, block_size=b), dense, rtol=0, atol=1e-12)
    x32 = x.float()
    torch.testing.assert_close(block_hadamard(x32, block_size=b), dense.float(), rtol=1e-5, atol=1e-5)


def test_kronecker_factors():
    assert [kron_factors(n) for n in (512, 1024, 4096, 16384, 32768)] == [(16, 32), (32, 32), (64, 64), (128, 128),
                                                                          (128, 256)]
    for n in (512, 2048, 32768):  # H_n = H_a ⊗ H_b, the identity the fast path rests on (float64, n ≤ 2048 dense)
        a, b = kron_factors(n)
        if n <= 2048:
            assert torch.equal(torch.kron(hadamard_matrix(a, dtype=torch.float64), hadamard_matrix(b, dtype=torch.float64)),
                               _sylvester(n))


@pytest.mark.parametrize("n, shape, axis", [(512, (3, 512), 1), (512, (512, 3), 0), (4096, (2, 4096), 1),
                                            (4096, (4096, 2), 0), (4096, (2, 4096, 3), 1), (32768, (1, 32768), 1),
                                            (32768, (32768, 2), 0), (1024, (2, 4096), 1), (1024, (4096, 3), 0)])
def test_large_blocks_equal_the_butterfly_and_the_dense_matrix(n, shape, axis, gen):
    """Blocks above 256 (the Kronecker form: HALO's whole-dimension rotations, up to 32768 tokens)
    equal the earlier fast Walsh–Hadamard butterfly and, up to 4096, the dense H_n, to FP32
    rounding, along every axis, also with signs."""
    x = torch.randn(*shape, generator=gen)
    for signs in (None, random_signs(n, generator=gen), random_signs(shape[axis], generator=gen)):
        y = block_hadamard(x, block_size=n, axis=axis, signs=signs)
        xm = x.double().movedim(axis, -1)
        if signs is not None:
            xm = (xm.reshape(*xm.shape[:-1], -1, signs.numel()) * signs.double()).reshape(xm.shape)
        blocks = xm.reshape(*xm.shape[:-1], -1, n)
        ref = (_fwht(blocks) / math.sqrt(n)).reshape(xm.shape).movedim(-1, axis)  # the butterfly, float64
        assert y.shape == x.shape and y.dtype == torch.float32
        assert float((y.double() - ref).abs().max()) <= 2e-6 * float(ref.abs().max())
        old = (_fwht(blocks.float()) / math.sqrt(n)).reshape(xm.shape).movedim(-1, axis)  # the butterfly as it ran, FP32
        assert float((y - old).abs().max()) <= 2e-6 * float(ref.abs().max())
        if n <= 4096:
            dense = (blocks @ _sylvester(n)).reshape(xm.shape).movedim(-1, axis)
            torch.testing.assert_close(ref, dense, rtol=0, atol=1e-12)
    y64 = block_hadamard(x.double(), block_size=n, axis=axis)  # float64 stays float64, near-exact
    assert y64.dtype == torch.float64
    torch.testing.assert_close(block_hadamard(y64, block_size=n, axis=axis), x.double(), rtol=0, atol=1e-12)
    assert block_hadamard(x.bfloat16(), block_size=n, axis=axis).dtype == torch.bfloat16


def test_block_hadamard_acts_within_blocks_only(gen):
    x = torch.zeros(1, 96, dtype=torch.float64)
    x[0, 40] = 1.0  # block 1 of 3
    y = block_hadamard(x, block_size=32)
    assert (y[0, :32] == 0).all() and (y[0, 64:] == 0).all()
    # a unit vector maps onto a row of H: ±1/√32 on the whole block
    torch.testing.assert_close(y[0, 32:64], hadamard_matrix(32, dtype=torch.float64)[8], rtol=0, atol=0)


@pytest.mark.parametrize("b", [16, 32, 64, 128])
@pytest.mark.parametrize("per_axis_signs", [False, True])
def test_rht_cancels_in_a_gemm(b, per_axis_signs, gen):
    """T-RHT2: (A·D·H)(H·D·B) = A·B with the transform applied to both operands along K."""
    m, k, n = 48, 256, 40
    a = torch.randn(m, k, generator=gen)
    bm = torch.randn(k, n, generator=gen)
    s = random_signs(k if per_axis_signs else b, generator=gen)
    a_r = block_hadamard(a, block_size=b, axis=1, signs=s)
    b_r = block_hadamard(bm, block_size=b, axis=0, signs=s)
    assert not torch.allclose(a_r, a, atol=1e-3)
    ref = a.double() @ bm.double()
    torch.testing.assert_close((a_r @ b_r).double(), ref, rtol=1e-5, atol=1e-4)
    # the signs matter: a mismatch breaks the cancellation
    b_wrong = block_hadamard(bm, block_size=b, axis=0, signs=-s if per_axis_signs else s.flip(0))
    assert not torch.allclose((a_r @ b_wrong).double(), ref, rtol=1e-2, atol=1e-2)


def test_signs_are_applied_before_h(gen):
    x = torch.randn(5, 64, generator=gen, dtype=torch.float64)
    s = random_signs(32, generator=gen)
    y = block_hadamard(x, block_size=32, signs=s)
    want = ((x.reshape(5, 2, 32) * s.double()) @ hadamard_matrix(32, dtype=torch.float64)).reshape(5, 64)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    # inverse: H again, then the signs again
    back = block_hadamard(y, block_size=32) * s.double().repeat(2)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_block_hadamard_any_axis(axis, gen):
    x = torch.randn(32, 64, 16, generator=gen, dtype=torch.float64)
    y = block_hadamard(x, block_size=16, axis=axis)
    ref = block_hadamard(x.movedim(axis, -1), block_size=16).movedim(-1, axis)
    assert y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_block_hadamard_preserves_dtype(dtype, gen):
    x = torch.randn(8, 128, generator=gen).to(dtype)
    y = block_hadamard(x, block_size=32)
    assert y.dtype == dtype and y.shape == x.shape
    ref = block_hadamard(x.double(), block_size=32)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-6)
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


def test_random_signs(gen):
    s = random_signs(4096, generator=gen)
    assert s.dtype == torch.float32 and s.shape == (4096,)
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert abs(s.mean().item()) < 4 / math.sqrt(4096)  # Rademacher: mean 0
    a = random_signs(64, generator=torch.Generator().manual_seed(5))
    b = random_signs(64, generator=torch.Generator().manual_seed(5))
    c = random_signs(64, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert random_signs(1).shape == (1,)
    with pytest.raises(ValueError, match="n >= 1"):
        random_signs(0)


def test_block_hadamard_shape_guards():
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match="dimension 1 has length 48") as e:
        block_hadamard(x, block_size=32)
    assert "block_size=32" in str(e.value)
    with pytest.raises(ValueError, match="dimension 0 has length 4"):
        block_hadamard(x, block_size=16, axis=0)  # dim < b
    with pytest.raises(ValueError, match="block_size 48"):
        block_hadamard(torch.randn(4, 96), block_size=48)
    for bad in (torch.ones(16), torch.ones(64), torch.ones(2, 32)):
        with pytest.raises(ValueError, match="signs"):
            block_hadamard(torch.randn(4, 96), block_size=32, signs=bad)
    with pytest.raises(TypeError, match="torch.int64"):
        block_hadamard(torch.arange(32), block_size=32)


def test_a_block_size_that_does_not_divide_names_the_sizes_that_do():
    """The message listed the first nine supported sizes, whatever the axis (fresh-user pass)."""
    with pytest.raises(ValueError, match=r"length 96, which block_size=64 .* \[1, 2, 4, 8, 16, 32\]"):
        block_hadamard(torch.randn(4, 96), block_size=64)
