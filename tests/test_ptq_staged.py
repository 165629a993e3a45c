"""Rotations as merged block stages for decoding (`adahop.ptq.staged`): the same product as the rotation, blocks
that stay orthogonal, signs folded exactly, and the stage kernel against its reference in Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from adahop.ptq.incoherence import RHTRotation
from adahop.ptq.rotation import HARPRotation
from adahop.ptq.staged import apply_stages, apply_stages_reference, fold_signs, merge_stages, rotation_stages

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _harp(d: int, seed: int = 0) -> HARPRotation:
    r = HARPRotation(d)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for th in r.thetas:
            th.copy_(torch.randn(th.shape, generator=g) * 0.3)
    return r


def _signs(d: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (d,), generator=g).float() * 2 - 1


# 4096 = 8^4; 1344 = 8·8·7·3; 172 = 4·43 (a prime stage); 96 = 8·6·2
@pytest.mark.parametrize("d", [4096, 1344, 172, 96])
@pytest.mark.parametrize("inverse", [False, True])
def test_merged_stages_with_folded_signs_equal_the_rotation(d, inverse, gen):
    r = _harp(d)
    s_in, s_out = _signs(d, gen), _signs(d, gen)
    stages = fold_signs(merge_stages(rotation_stages(r, inverse=inverse), d), s_in, s_out)
    x = torch.randn(3, d, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        ref = (r.apply_inverse if inverse else r.apply)((x * s_in).float()).double() * s_out
    y = apply_stages_reference(x, stages).double()
    assert float((y - ref).norm() / ref.norm()) < 1e-6
    for k, b, _ in stages:  # every merged block is still orthogonal
        eye = torch.eye(b).expand_as(k)
        assert float((k @ k.transpose(1, 2) - eye).abs().max()) < 1e-5


def test_merging_takes_radix_8_stages_two_at_a_time_on_adjacent_digits():
    st = rotation_stages(_harp(4096))
    assert [(b, s) for _, b, s in st] == [(8, 1), (8, 8), (8, 64), (8, 512)]
    assert [(b, s) for _, b, s in merge_stages(st, 4096)] == [(64, 1), (64, 64)]
    inv = rotation_stages(_harp(4096), inverse=True)
    assert [(b, s) for _, b, s in merge_stages(inv, 4096)] == [(64, 64), (64, 1)]
    # a prime stage past 64 stays alone; two passes never merge across the pass boundary
    assert [(b, s) for _, b, s in merge_stages(rotation_stages(HARPRotation(2752)), 2752)] == [(64, 1), (43, 64)]
    two = rotation_stages(HARPRotation(64, passes=2))
    assert [(b, s) for _, b, s in merge_stages(two, 64, max_radix=512)] == [(64, 1), (64, 1)]


@pytest.mark.parametrize("d", [4096, 512, 2752])
def test_rht_stages_are_the_block_hadamard(d, gen):
    r = RHTRotation(d)
    x = torch.randn(2, d, generator=gen)
    st = rotation_stages(r)
    assert all(b <= 64 for _, b, _ in st)
    torch.testing.assert_close(apply_stages_reference(x, st), r.apply(x), rtol=0, atol=2e-6)
    torch.testing.assert_close(apply_stages_reference(x, rotation_stages(r, inverse=True)), r.apply(x), rtol=0, atol=2e-6)


def test_bad_input_is_refused(gen):
    st = merge_stages(rotation_stages(_harp(96)), 96)
    with pytest.raises(ValueError, match=r"x must be a float \[rows, 96\] \(or \[parts, rows, 96\] of partial sums\), got torch.float32 \(2, 95\)"):
        apply_stages(torch.randn(2, 95), st)
    with pytest.raises(ValueError, match="backend 'cuda'"):
        apply_stages(torch.randn(2, 96), st, backend="cuda")
    with pytest.raises(TypeError, match="neither a HARPRotation nor an RHTRotation"):
        rotation_stages(torch.eye(4))
    # stages a kernel would trust: a stride that does not fit d wrote out of bounds, a bf16 K was read as is
    for bad, msg in (([(torch.randn(8, 8, 8), 8, 3)], "radix 8 and stride 3; their product must divide d = 64"),
                     ([(torch.randn(8, 8, 8).bfloat16(), 8, 1)], "float32 K of shape \\[8, 8, 8\\], got torch.bfloat16"),
                     ([(torch.randn(8, 8, 8), 8, 1), (torch.randn(4, 8, 8), 8, 8)],
                      "stage 1 \\(radix 8\\) must hold a float32 K of shape \\[8, 8, 8\\], got torch.float32 \\(4, 8, 8\\)")):
        with pytest.raises(ValueError, match=msg):
            apply_stages(torch.randn(2, 64), bad)
    with pytest.raises(ValueError, match="max_radix=1 must be an int >= 2"):
        merge_stages(st, 96, max_radix=1)
    with pytest.raises(ValueError, match="must divide d = 100"):
        merge_stages(st, 100)
    with pytest.raises(ValueError, match=r"s_in must be \[96\] of ±1"):
        fold_signs(st, torch.ones(95))
    with pytest.raises(ValueError, match=r"s_out must be \[96\] of ±1"):
        fold_signs(st, s_out=torch.full((96,), 0.5))


def test_a_non_contiguous_k_gives_the_same_product(gen):
    """A stage's K may be a transposed view; the kernel reads it contiguous (it gave relative error 1.3)."""
    st = rotation_stages(_harp(64))
    views = [(k.transpose(1, 2).contiguous().transpose(1, 2), b, s) for k, b, s in st]
    x = torch.randn(2, 64, generator=gen)
    torch.testing.assert_close(apply_stages(x, views), apply_stages_reference(x, st), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the kernel, interpreted

interp = pytest.mark.skipif(not (HAS_TRITON and INTERPRET),
                            reason="run by test_stage_kernel_in_interpreter in a TRITON_INTERPRET=1 child")


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; runs the interp_ tests in a child process")
def test_stage_kernel_in_interpreter(interp_child):
    interp_child(__file__)


@pytest.mark.parametrize("d", [1344, 172, 96])
@pytest.mark.parametrize("inverse", [False, True])
@interp
def test_interp_stage_kernel_matches_its_reference(d, inverse):
    g = torch.Generator().manual_seed(d)
    st = fold_signs(merge_stages(rotation_stages(_harp(d), inverse=inverse), d), _signs(d, g), _signs(d, g))
    x = torch.randn(3, d, generator=g).bfloat16()
    ref = apply_stages_reference(x, st)
    torch.testing.assert_close(apply_stages(x, st, backend="triton"), ref, rtol=1e-5, atol=1e-5)
    parts = torch.randn(3, 3, d, generator=g)  # partial sums, added as the first stage reads them
    torch.testing.assert_close(apply_stages(parts, st, backend="triton"), apply_stages_reference(parts.sum(0), st),
                               rtol=1e-5, atol=1e-5)
    y = apply_stages(x, st, torch.bfloat16, backend="triton")  # the last stage writes the layer's dtype
    assert y.dtype == torch.bfloat16
    # within one BF16 step (the interpreter rounds its FP32 -> BF16 stores its own way)
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-6)
