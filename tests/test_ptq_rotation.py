"""HARP's rotation and the RHT: orthogonality, exact equivalence, the RHT start, mixed-radix dims
(`specs/related_methods.md` §2.1–§2.2)."""

from __future__ import annotations

import pytest
import torch

from adahop.hadamard import hadamard_matrix
from adahop.ptq.incoherence import RHTRotation, TwoSided, rht_block
from adahop.ptq.rotation import HARPRotation, cayley, mixer_matrix, radix_schedule


def _randomize(r: HARPRotation, gen: torch.Generator, scale: float = 0.5) -> HARPRotation:
    with torch.no_grad():
        for th in r.thetas:
            th.copy_(torch.randn(th.shape, generator=gen) * scale)
    return r


def _orth_err(q: torch.Tensor) -> float:
    q = q.detach()
    return float((q @ q.T - torch.eye(q.shape[0], dtype=q.dtype)).abs().max())


def test_schedules_are_the_specs_greedy_mixed_radix():
    # the [Ours] schedules of specs/related_methods.md §2.2, and our model dims
    assert radix_schedule(2048) == [8, 8, 8, 4]
    assert radix_schedule(3072) == [8, 8, 8, 6]
    assert radix_schedule(5120) == [8, 8, 8, 5, 2]
    assert radix_schedule(11008) == [8, 8, 4, 43]
    assert radix_schedule(13824) == [8, 8, 8, 3, 3, 3]
    assert radix_schedule(14336) == [8, 8, 8, 7, 4]
    assert radix_schedule(1344) == [8, 8, 7, 3]
    assert radix_schedule(2752) == [8, 8, 43]
    # the spec's parameter counts per side: 2048 → 24.6k, 11008 → 325k
    assert HARPRotation(2048).n_params == 2048 * (7 + 7 + 7 + 3) // 2 == 24576
    assert HARPRotation(11008).n_params == 11008 * (7 + 7 + 3 + 42) // 2 == 324736
    with pytest.raises(ValueError, match="d >= 2"):
        radix_schedule(1)
    # a dimension read from numpy or torch is an integer too; a float is named as one
    import numpy as np

    assert HARPRotation(np.int64(2752)).d == 2752 and type(HARPRotation(torch.tensor(64)).d) is int
    with pytest.raises(ValueError, match=r"integer dimension d >= 2, got 64.0 \(float\)"):
        HARPRotation(64.0)


@pytest.mark.parametrize("d", [64, 96, 384])
def test_every_stage_and_the_dense_rotation_are_orthogonal(d, gen):
    r = _randomize(HARPRotation(d, passes=2), gen)
    for k in r.kernels():  # every block of every stage: K = Cayley(S)·M_b
        for blk in k:
            assert _orth_err(blk) <= 1e-5
    assert _orth_err(r.dense()) <= 1e-5
    for b in (6, 7, 8):
        assert _orth_err(mixer_matrix(b)) <= 1e-12
    assert _orth_err(cayley(torch.randn(5, 5, generator=gen, dtype=torch.float64))) <= 1e-12


def test_apply_is_x_times_dense_and_apply_inverse_its_transpose(gen):
    r = _randomize(HARPRotation(96), gen)
    x = torch.randn(5, 96, generator=gen)
    q = r.dense()
    torch.testing.assert_close(r.apply(x), x @ q, rtol=0, atol=1e-5)
    torch.testing.assert_close(r.apply_inverse(x), x @ q.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(r.apply_inverse(r.apply(x)), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rot", ["harp", "rht"])
def test_the_two_sided_transform_is_exact(rot, gen):
    m, n = 48, 64
    w = torch.randn(m, n, generator=gen)
    if rot == "harp":
        u, v = _randomize(HARPRotation(m), gen), _randomize(HARPRotation(n), gen)
    else:
        u, v = RHTRotation(m), RHTRotation(n)
    t = TwoSided.random_signs(u, v, generator=gen)
    with torch.no_grad():
        _check_exact(t, u, v, w, gen)


def _check_exact(t, u, v, w, gen):
    n = w.shape[1]
    wt = t.weight(w)
    su, sv = torch.diag(t.s_out), torch.diag(t.s_in)
    uu, vv = u.dense(), v.dense()
    torch.testing.assert_close(wt, uu.T @ su @ w @ sv @ vv, rtol=0, atol=1e-5)  # W̃ = Uᵀ(S W S)V
    torch.testing.assert_close(t.weight_inverse(wt), w, rtol=0, atol=1e-5)  # U W̃ Vᵀ (with the signs) = W
    x = torch.randn(200, n, generator=gen)
    h = x.T @ x / 200
    torch.testing.assert_close(t.hessian(h), vv.T @ sv @ h @ sv @ vv, rtol=0, atol=1e-5)
    # the proxy output error is invariant: tr(W H Wᵀ) = tr(W̃ H̃ W̃ᵀ)
    assert float(torch.einsum("ij,jk,ik->", wt, t.hessian(h), wt)) == pytest.approx(float(torch.einsum("ij,jk,ik->", w, h, w)), rel=1e-5)


def test_theta_zero_is_the_rht_up_to_a_permutation():
    for d in (64, 256, 512):
        q = HARPRotation(d).dense()
        h = hadamard_matrix(d)
        # each row of the HARP start is one row of H_d, and no row twice: a row permutation of H_d
        match = (q @ h.T).abs() > 1 - 1e-5  # orthonormal rows: |<q_i, h_j>| = 1 iff equal up to sign
        assert match.sum(1).eq(1).all() and match.sum(0).eq(1).all()
        perm = match.float().argmax(1)
        torch.testing.assert_close(q, h[perm], rtol=0, atol=1e-6)  # same rows, same signs
        assert RHTRotation(d).block == d
    # with the signs, Θ = 0 transforms a weight exactly as the RHT does (H_d is symmetric)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g)
    s_out, s_in = torch.randn(64, generator=g).sign(), torch.randn(128, generator=g).sign()
    harp = TwoSided(HARPRotation(64), HARPRotation(128), s_out, s_in).weight(w)
    rht = TwoSided(RHTRotation(64), RHTRotation(128), s_out, s_in).weight(w)
    torch.testing.assert_close(harp, rht, rtol=0, atol=1e-5)


@pytest.mark.parametrize("d", [1344, 2752])
def test_non_power_of_two_dims_work(d, gen):
    r = HARPRotation(d)
    with torch.no_grad():  # a few random blocks are enough to leave Θ = 0 behind
        for th in r.thetas:
            th.copy_(torch.randn(th.shape, generator=gen) * 0.1)
    q = r.dense()
    assert q.shape == (d, d) and _orth_err(q) <= 1e-5
    x = torch.randn(3, d, generator=gen)
    torch.testing.assert_close(r.apply_inverse(r.apply(x)), x, rtol=0, atol=1e-5)
    b = rht_block(d)  # the RHT takes a block Hadamard: 1344 = 21·64, 2752 = 43·64
    assert b == 64
    torch.testing.assert_close(RHTRotation(d).apply(x), x @ RHTRotation(d).dense(), rtol=0, atol=1e-5)


def test_a_dim_with_no_hadamard_block_names_the_fix():
    with pytest.raises(ValueError, match=r"dimension 129 .*harp-\* method"):
        rht_block(129)
    with pytest.raises(ValueError, match="dimension 100"):
        RHTRotation(100)  # 4·25: the largest power-of-two block, 4, is below 8


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_stored_params_round_trip_exactly(fmt, gen):
    r = _randomize(HARPRotation(96, theta_format=fmt), gen)
    before = r.dense()
    r.round_params()
    q = r.dense()
    r2 = HARPRotation(96, theta_format=fmt)
    r2.load_packed_params(r.packed_params())
    assert torch.equal(r2.dense(), q)  # the artifact rebuilds exactly the rotation the weights were quantized with
    r.round_params()
    assert torch.equal(r.dense(), q)  # rounding is idempotent
    packed = r.packed_params()
    codes = [v for k, v in packed.items() if not k.endswith(".scale")]
    assert sum(p.numel() for p in codes) == r.n_params
    eye = torch.eye(96)
    assert torch.linalg.matrix_norm(q @ q.T - eye) <= 1e-5  # still orthogonal: any Θ is
    gap = float((q - before).abs().max().detach())
    if fmt == "fp16":
        assert all(p.dtype == torch.float16 for p in packed.values()) and gap < 1e-3
    else:  # int8: one FP16 scale per block, amax/127; half the bits, a coarser rotation
        # radix 8 and 6 as int8 with a scale a block; radix 2 (one parameter a block) stays FP16
        assert [p.dtype for p in codes] == [torch.int8, torch.int8, torch.float16]
        assert all(int(p.abs().max()) == 127 for p in codes[:2])
        scales = [v for k, v in packed.items() if k.endswith(".scale")]
        assert [s.numel() for s in scales] == [12, 16] and all(s.dtype == torch.float16 for s in scales)
        bits = sum(8 * p.numel() * p.element_size() for p in packed.values())
        assert bits < 0.6 * 16 * r.n_params and 1e-4 < gap < 0.05


def test_stored_params_of_another_format_or_schedule_are_refused(gen):
    r = _randomize(HARPRotation(96, theta_format="int8"), gen)
    with pytest.raises(ValueError, match="do not match a fp16 rotation"):
        HARPRotation(96).load_packed_params(r.packed_params())
    with pytest.raises(ValueError, match="do not match a int8 rotation of 3 stages"):
        HARPRotation(96, theta_format="int8").load_packed_params({"0": torch.zeros(12, 28, dtype=torch.int8)})
    with pytest.raises(ValueError, match="theta_format='int4': must be one of fp16, int8"):
        HARPRotation(96, theta_format="int4")
