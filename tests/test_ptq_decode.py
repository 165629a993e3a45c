"""Decoding from the packed artifact (`adahop.ptq.decode`): the int matvec against the decoded weight, the
Triton kernel against its reference in Triton's CPU interpreter, and PackedLinear against the rebuilt weight."""

from __future__ import annotations

import importlib.util
import io
import os

import pytest
import torch

from adahop.ptq.decode import PackedLinear, _kernel_runs, int_matvec, int_matvec_reference
from adahop.ptq.fit import FitOptions
from adahop.ptq.grids import make_grid
from adahop.ptq.incoherence import RHTRotation, TwoSided
from adahop.ptq.quantize import pack_bits
from adahop.ptq.rotation import HARPRotation

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _packed(m: int, n: int, bits: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    grid = make_grid("int", bits, g)
    w = torch.randn(m, n, generator=gen) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen).float())
    codes, scales, _ = grid.quantize(w)
    st = grid.stored_scales(scales)
    return grid, codes, st, pack_bits(codes, bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_reference_matvec_is_the_decoded_weights_product(bits, gen):
    grid, codes, st, packed = _packed(40, 200, bits, 64)  # 200 = 3·64 + 8: a shorter last group
    x = torch.randn(3, 200, generator=gen)
    y = int_matvec_reference(x, packed, st["scales"], 40, 200, bits, 64)
    torch.testing.assert_close(y, x @ grid.decode(codes, st).T, rtol=0, atol=0)
    assert y.dtype == torch.float32 and y.shape == (3, 40)
    # auto on the CPU is the reference itself, unless Triton's interpreter runs the kernel (sums in another order)
    assert torch.equal(int_matvec(x, packed, st["scales"], 40, 200, bits, 64, backend="reference"), y)
    assert torch.equal(int_matvec(x, packed, st["scales"], 40, 200, bits, 64, backend="reference", sum_splits=False), y[None])
    if not _kernel_runs(bits, 200, 64, x.device):
        assert torch.equal(int_matvec(x, packed, st["scales"], 40, 200, bits, 64), y)


def test_bad_matvec_input_is_refused_naming_what_fits(gen):
    _, _, st, packed = _packed(40, 200, 2, 64)
    x = torch.randn(3, 200, generator=gen)
    with pytest.raises(ValueError, match=r"x must be \[rows, 200\]"):
        int_matvec(x[:, :100], packed, st["scales"], 40, 200, 2, 64)
    with pytest.raises(ValueError, match="2000 bytes"):
        int_matvec(x, packed[:-1], st["scales"], 40, 200, 2, 64)
    with pytest.raises(ValueError, match=r"scales must be float \[40, 4\]"):
        int_matvec(x, packed, st["scales"][:, :3], 40, 200, 2, 64)
    with pytest.raises(ValueError, match=r"scales must be float \[40, 4\].*got torch.int64"):
        int_matvec(x, packed, st["scales"].long(), 40, 200, 2, 64)
    with pytest.raises(ValueError, match="must be the 1-D uint8 stream"):  # the reference raised a broadcast error
        int_matvec(x, packed.reshape(40, -1), st["scales"], 40, 200, 2, 64)
    with pytest.raises(ValueError, match="bits=9: codes of at most 8 bits"):  # uint8 codes: 9 bits came out wrong
        int_matvec(x, torch.zeros(-(-40 * 200 * 9 // 8), dtype=torch.uint8), st["scales"], 40, 200, 9, 64)
    with pytest.raises(ValueError, match=r"bits=5 \(it reads \(2, 3, 4\)\)"):
        int_matvec(x, pack_bits(torch.zeros(40, 200, dtype=torch.uint8), 5), st["scales"], 40, 200, 5, 64, backend="triton")
    # rows of W that are not whole 32-bit words (200·2 bits) or groups that are not (24 at 2 bits: 1.5 words)
    # take the reference under auto, and the kernel refuses them
    for n, g in ((200, 64), (192, 24)):  # (at 3 bits: 32 codes in 3 words, so n and g multiples of 32)
        _, _, st2, packed2 = _packed(40, n, 2, g)
        x2 = torch.randn(1, n, generator=gen)
        assert not _kernel_runs(2, n, g, torch.device("cuda"))
        assert torch.equal(int_matvec(x2, packed2, st2["scales"], 40, n, 2, g),
                           int_matvec_reference(x2, packed2, st2["scales"], 40, n, 2, g))
        with pytest.raises(ValueError, match=f"cannot read these codes: {'n=200: rows' if n == 200 else 'group_size=24'}"):
            int_matvec(x2, packed2, st2["scales"], 40, n, 2, g, backend="triton")


@pytest.mark.parametrize("rot", ["rht", "harp"])
def test_packed_linear_equals_the_rebuilt_weight(rot, gen):
    """y = ((x ⊙ s_n)·V·Qᵀ)·Uᵀ ⊙ s_m equals x·Wᵀ with W = S U Q Vᵀ S (TwoSided.weight_inverse)."""
    _check_packed_linear(rot, gen)


def _check_packed_linear(rot, gen):
    m, n = 64, 96  # 96 = 8·6·2: HARP's mixed radix; the RHT's block 32
    grid, codes, st, packed = _packed(m, n, 2, 32)
    if rot == "rht":
        u, v = RHTRotation(m), RHTRotation(n)
    else:
        u, v = HARPRotation(m), HARPRotation(n)
        with torch.no_grad():
            for th in [*u.thetas, *v.thetas]:
                th.copy_(torch.randn(th.shape, generator=gen) * 0.3)
    t = TwoSided.random_signs(u, v, generator=gen)
    layer = PackedLinear(grid, {"codes": packed, **st}, t, (m, n))
    with torch.no_grad():
        w = t.weight_inverse(grid.decode(codes, st))
    for lead in ((2, 3), (4, 5)):  # 6 rows: the matvec; 20 rows (a prompt): the weight decoded for the call
        x = torch.randn(*lead, n, generator=gen, dtype=torch.float64).float()
        y = layer(x)
        assert y.shape == (*lead, m) and y.dtype == torch.float32
        ref = x.double() @ w.double().T  # the rows' scales span 2^±6: compare to the whole output's size
        assert float((y.double() - ref).norm() / ref.norm()) < 1e-6
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"takes a float tensor \[..., 96\], got torch.float32 \(4, 5, 95\)"):
        layer(x[..., :95])
    with pytest.raises(ValueError, match="takes a float tensor .* got torch.int64"):  # it returned truncated integers
        layer(torch.ones(3, n, dtype=torch.long))
    with pytest.raises(ValueError, match=r"stored lacks \['scales'\]"):
        PackedLinear(grid, {"codes": packed}, t, (m, n))


def test_packed_linear_decodes_fp4_grids_once(gen):
    grid = make_grid("mxfp4", 4, None)
    w = torch.randn(32, 64, generator=gen)
    codes, scales, q = grid.quantize(w)
    st = grid.stored_scales(scales)
    layer = PackedLinear(grid, {"codes": pack_bits(codes, 4), **st}, None, (32, 64))
    x = torch.randn(4, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ grid.decode(codes, st).T, rtol=0, atol=0)


# --------------------------------------------------------------------------- the kernel, interpreted

interp = pytest.mark.skipif(not (HAS_TRITON and INTERPRET),
                            reason="run by test_matvec_kernel_in_interpreter in a TRITON_INTERPRET=1 child")


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; runs the interp_ tests in a child process")
def test_matvec_kernel_in_interpreter(interp_child):
    interp_child(__file__)


# a short last group; a group size of no power of two (48, 96); groups of one word (g 8, W4); several output
# blocks, each input dimension split over programs (split-K), the last tile and split running past n; at 3 bits
# the codes that straddle two words
@pytest.mark.parametrize("m,n,bits,g,rows", [(40, 208, 2, 64, 3), (33, 136, 4, 128, 1), (64, 256, 2, 128, 2),
                                             (130, 96, 2, 48, 1), (17, 64, 4, 8, 2), (300, 1008, 2, 128, 1),
                                             (40, 224, 3, 64, 3), (33, 160, 3, 128, 1), (70, 96, 3, 96, 2)])
@interp
def test_interp_matvec_kernel_matches_its_reference(m, n, bits, g, rows):
    _, _, st, packed = _packed(m, n, bits, g, seed=m)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n)).bfloat16()
    y = int_matvec(x, packed, st["scales"], m, n, bits, g, backend="triton")
    torch.testing.assert_close(y, int_matvec_reference(x, packed, st["scales"], m, n, bits, g), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rot", ["rht", "harp"])
@interp
def test_interp_packed_linear_through_the_kernels_equals_the_rebuilt_weight(rot):
    """The same with the stage kernels and the matvec kernel doing the work (W2, group 32: the kernel reads it)."""
    assert _kernel_runs(2, 96, 32, torch.device("cpu"))
    _check_packed_linear(rot, torch.Generator().manual_seed(3))


@interp
def test_interp_matvec_tuning_changes_the_schedule_not_the_result():
    _, _, st, packed = _packed(300, 1008, 2, 128, seed=5)
    x = torch.randn(2, 1008, generator=torch.Generator().manual_seed(5))
    ref = int_matvec_reference(x, packed, st["scales"], 300, 1008, 2, 128)
    for block_m, per_sm in ((16, 1), (128, 16), (256, 2)):
        y = int_matvec(x, packed, st["scales"], 300, 1008, 2, 128, backend="triton", block_m=block_m, per_sm=per_sm)
        assert float((y - ref).norm() / ref.norm()) < 1e-6  # rows' scales span 2^±6: relative to the whole output


def test_matvec_tuning_knobs_are_checked():
    _, _, st, packed = _packed(8, 64, 4, 64)
    x = torch.randn(1, 64)
    for kw, msg in (({"block_m": 48}, "block_m=48 must be a power of two"), ({"per_sm": 0}, "per_sm=0 must be"),
                    ({"per_sm": True}, "per_sm=True must be"), ({"block_m": 16.0}, "block_m=16.0 must be"),
                    ({"block_m": torch.tensor(32)}, r"block_m=tensor\(32\) must be")):  # both passed `in` (==)
        with pytest.raises(ValueError, match=msg):
            int_matvec(x, packed, st["scales"], 8, 64, 4, 64, **kw)


def test_packed_linear_keeps_its_scales_through_dtype_casts_and_builds_its_stages_on_the_device(gen):
    """`model.to(torch.bfloat16)` rounded the FP16 scales (float buffers), and a cast after the first call was
    ignored (the decoded weight cached per device); the RHT's stages were built on the CPU whatever the device."""
    grid, codes, st, packed = _packed(32, 64, 4, 64)
    layer = PackedLinear(grid, {"codes": packed, **st}, None, (32, 64))
    x = torch.randn(3, 64, generator=gen)
    y = layer(x)
    for d in (torch.bfloat16, torch.float16, torch.float32):
        layer.to(d)
        assert layer.scales()["scales"].dtype == torch.float16 and torch.equal(layer.scales()["scales"], st["scales"])
    assert torch.equal(layer(x), y)
    t = TwoSided.random_signs(RHTRotation(32), RHTRotation(64), generator=gen)
    rht = PackedLinear(grid, {"codes": packed, **st}, t, (32, 64))
    stages = rht._consts(torch.device("meta"))  # a device of its own: every stage tensor must land there
    assert {k.device.type for side in ("u", "v") for k, _, _ in stages[side]} == {"meta"}


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_decode_kernels_compile_for_hopper():
    """The interpreter runs what real compilation may refuse: both kernels compiled for sm_90 at llama-tiny's
    shapes, every specialization (scripts/compile_decode.py; a child process, as it loads Triton its own way)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    r = subprocess.run([sys.executable, str(root / "scripts" / "compile_decode.py"), "--model", "llama-tiny"], env=env,
                       capture_output=True, text=True, timeout=600)
    if "No module named 'triton.backends.nvidia'" in r.stderr:
        pytest.skip("this Triton has no NVIDIA backend")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "int_matvec" in r.stdout and "stage d=" in r.stdout and " 0 failed" in r.stdout


# --------------------------------------------------------------------------- MXFP4 weights (E2M1 codes, E8M0 scales)

def _packed_mx(m: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    grid = make_grid("mxfp4", 4)
    w = torch.randn(m, n, generator=gen) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen).float())
    codes, scales, _ = grid.quantize(w)
    st = grid.stored_scales(scales)
    return grid, codes, st, pack_bits(codes, 4)


def test_reference_matvec_reads_mxfp4_codes_and_refuses_mixed_up_scales(gen):
    grid, codes, st, packed = _packed_mx(24, 100)  # 100 = 3·32 + 4: a short last block
    x = torch.randn(3, 100, generator=gen)
    y = int_matvec_reference(x, packed, st["scales"], 24, 100, 4, 32, element="e2m1")
    torch.testing.assert_close(y, x @ grid.decode(codes, st).T, rtol=0, atol=0)
    with pytest.raises(ValueError, match="scales must be uint8 E8M0"):
        int_matvec(x, packed, st["scales"].half(), 24, 100, 4, 32, element="e2m1")
    with pytest.raises(ValueError, match="E2M1 codes are 4 bits, got bits=2"):
        int_matvec(x, packed[:600], st["scales"], 24, 100, 2, 32, element="e2m1")
    with pytest.raises(ValueError, match="element='fp8'"):
        int_matvec(x, packed, st["scales"], 24, 100, 4, 32, element="fp8")


@interp
def test_interp_matvec_kernel_reads_mxfp4_codes():
    """A short last block (104 = 3·32 + 8), both signs, E2M1 subnormal 0.5 (read through FP16's subnormal)."""
    _, _, st, packed = _packed_mx(70, 104, seed=2)
    x = torch.randn(2, 104, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = int_matvec(x, packed, st["scales"], 70, 104, 4, 32, backend="triton", element="e2m1")
    ref = int_matvec_reference(x, packed, st["scales"], 70, 104, 4, 32, element="e2m1")
    assert float((y - ref).norm() / ref.norm()) < 1e-6


@interp
def test_interp_packed_linear_on_mxfp4_codes_equals_the_rebuilt_weight():
    gen = torch.Generator().manual_seed(4)
    grid, codes, st, packed = _packed_mx(64, 96, seed=4)
    t = TwoSided.random_signs(RHTRotation(64), RHTRotation(96), generator=gen)
    layer = PackedLinear(grid, {"codes": packed, **st}, t, (64, 96))
    assert layer._reads_codes(torch.device("cpu"))  # the kernel, not a weight decoded once
    with torch.no_grad():
        w = t.weight_inverse(grid.decode(codes, st))
    x = torch.randn(3, 96, generator=gen)
    ref = x.double() @ w.double().T
    assert float((layer(x).double() - ref).norm() / ref.norm()) < 1e-6


@interp
def test_interp_matvec_kernel_at_the_edges_of_its_range(monkeypatch):
    """Found by a probe (session 21): levels of ±½ against an x with a large common part (the kernel once took
    the offset off as offset·Σx, 10× the reference's error); an x of 5e31 (once scaled by 2^23 into inf); MXFP4
    with a tiny x (once a subnormal product) and E8M0 bytes 0 (2^-127, once read as 0) and 255 (NaN); more rows
    than a launch grid takes go to the reference."""
    gen = torch.Generator().manual_seed(7)
    for bits in (2, 3, 4):
        m, n, half = 8, 256, 2 ** (bits - 1)
        codes = torch.tensor([half - 1, half] * (m * n // 2), dtype=torch.uint8).reshape(m, n)  # levels −½, +½
        packed, scales = pack_bits(codes, bits), torch.ones(m, n // 128, dtype=torch.float16)
        x = 1 + 1e-3 * torch.randn(1, n, generator=gen)
        truth = x.double() @ (codes.double() - (half - 0.5)).T
        y = int_matvec(x, packed, scales, m, n, bits, 128, backend="triton")
        ref = int_matvec_reference(x, packed, scales, m, n, bits, 128)
        err, ref_err = (float((v.double() - truth).norm() / truth.norm()) for v in (y, ref))
        assert err <= ref_err, (bits, err, ref_err)  # FP32 sums of ±½·x that cancel: no worse than the reference
        big = torch.zeros(1, n)
        big[0, 0] = 5e31
        torch.testing.assert_close(int_matvec(big, packed, scales, m, n, bits, 128, backend="triton"),
                                   int_matvec_reference(big, packed, scales, m, n, bits, 128))
    _, _, st, packed = _packed_mx(4, 64, seed=7)
    for sb in (0, 255):
        st2 = st["scales"].clone()
        st2[:, 0] = sb
        x = torch.randn(1, 64, generator=gen) * 1e30
        y = int_matvec(x, packed, st2, 4, 64, 4, 32, backend="triton", element="e2m1")
        ref = int_matvec_reference(x, packed, st2, 4, 64, 4, 32, element="e2m1")
        assert torch.equal(y.isnan(), ref.isnan()) and (sb == 255 or torch.allclose(y, ref, rtol=1e-5)), (sb, y, ref)
    tiny = torch.randn(2, 64, generator=gen) * 1e-37
    ref = int_matvec_reference(tiny, packed, st["scales"], 4, 64, 4, 32, element="e2m1")
    y = int_matvec(tiny, packed, st["scales"], 4, 64, 4, 32, backend="triton", element="e2m1")
    assert float((y.double() - ref.double()).norm() / ref.double().norm()) < 1e-6  # (FP32 squares would underflow)
    monkeypatch.setattr("adahop.ptq.decode.MAX_KERNEL_ROWS", 1)
    assert torch.equal(int_matvec(tiny, packed, st["scales"], 4, 64, 4, 32, element="e2m1"), ref)
    with pytest.raises(ValueError, match=r"cannot read these codes: 2 rows \(the kernel takes at most 1"):
        int_matvec(tiny, packed, st["scales"], 4, 64, 4, 32, backend="triton", element="e2m1")


def test_packed_linear_state_dict_carries_its_rotations_and_drops_stale_caches(gen):
    """load_state_dict from another layer of the same shape gives that layer's outputs: its signs and HARP Θ come
    with its codes (they were left behind, so the outputs mixed two layers silently), and a weight decoded once
    before the load (the CPU path) is not reused. A layer with other rotations is refused by name."""
    def layer(seed, rot="harp"):
        g = torch.Generator().manual_seed(seed)
        grid, codes, st, packed = _packed(32, 64, 2, 32, seed=seed)
        if rot == "harp":
            u, v = HARPRotation(32), HARPRotation(64)
            with torch.no_grad():
                for th in [*u.thetas, *v.thetas]:
                    th.copy_(torch.randn(th.shape, generator=g) * 0.3)
        else:
            u, v = RHTRotation(32), RHTRotation(64)
        return PackedLinear(grid, {"codes": packed, **st}, TwoSided.random_signs(u, v, generator=g), (32, 64))

    a, b = layer(1), layer(2)
    x = torch.randn(3, 64, generator=gen)
    ya, yb = a(x), b(x)  # b's weight is decoded and cached here (the CPU path)
    assert not torch.allclose(ya, yb)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b(x), ya)
    b.to(torch.bfloat16)  # the rotations stay FP32: .to casts no extra state
    assert b.transform.u.thetas[0].dtype == torch.float32 and torch.equal(b(x), ya)
    with pytest.raises(ValueError, match=r"the state's u rotation .*\(harp\) is not this layer's .*\(RHTRotation\)"):
        layer(3, "rht").load_state_dict(a.state_dict())
    state = a.state_dict()
    state["_extra_state"]["signs_in"] = state["_extra_state"]["signs_in"] * 2
    with pytest.raises(ValueError, match="signs must be ±1 vectors of 64"):
        b.load_state_dict(state)


def test_packed_linear_refuses_the_state_of_another_grid_before_copying(gen):
    """An MXFP4 layer and an int W4 g32 layer store codes and scales of the same shapes (uint8 E8M0 against int16
    FP16 bits): load_state_dict accepted either's state, copy_ converted the scale values, and the logits moved by
    10 (helper 64). Now the scale dtype and the extra state's grid are checked before anything is copied."""
    w = torch.randn(32, 64, generator=gen)
    layers = {}
    for name, grid in (("int", make_grid("int", 4, 32)), ("mxfp4", make_grid("mxfp4", 4))):
        codes, scales, _ = grid.quantize(w)
        layers[name] = PackedLinear(grid, {"codes": pack_bits(codes, 4), **grid.stored_scales(scales)}, None, (32, 64))
    a, m = layers["int"], layers["mxfp4"]
    assert a.codes.shape == m.codes.shape and a.q_scales.shape == m.q_scales.shape  # what load_state_dict compares
    x = torch.randn(3, 64, generator=gen)
    ya = a(x)
    with pytest.raises(ValueError, match=r"the state's q_scales is torch.uint8, this int layer's torch.int16"):
        a.load_state_dict(m.state_dict())
    assert torch.equal(a(x), ya)  # left as it was
    state = m.state_dict()
    state["q_scales"] = a.q_scales.clone()  # the dtypes made to agree: the extra state's grid still differs
    with pytest.raises(ValueError, match=r"the state's grid \{'name': 'mxfp4'.*is not this layer's \{'name': 'int'"):
        a.load_state_dict(state)
    with pytest.raises(ValueError, match="not a PackedLinear's"):  # e.g. the None a layer without rotations gave
        a.set_extra_state(None)
    b = PackedLinear(a.grid, {"codes": a.codes.clone(), "scales": a.scales()["scales"].clone()}, None, (32, 64))
    b.load_state_dict(a.state_dict())  # same grid: accepted, and a torch.save round trip keeps it loadable
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(b(x), ya)
