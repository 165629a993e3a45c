"""The NVFP4 operand quantizer (`adahop.kernels.iht_quantize_nvfp4`): its reference, its errors, the
values-only operand, and the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)
against the reference: bit for bit under round to nearest (codes, E4M3 block scales, FP32 tensor
scale, BF16 GEMM operand), unbiased under stochastic rounding with the reference's scales.

GPU parity and timing: ``scripts/validate_kernels.py --only nvfp4``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from adahop.formats import NVFP4Tensor, quantize_nvfp4
from adahop.kernels import (
    check_nvfp4_layout,
    hadamard_butterfly,
    iht_quantize_nvfp4,
    iht_quantize_nvfp4_reference,
    nvfp4_block_values,
    nvfp4_matmul,
    nvfp4_matmul_bf16,
    nvfp4_matmul_reference,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _special(r: int, c: int, seed: int = 0) -> torch.Tensor:
    """Rows whose scales span 2^-8 … 2^8 (block scales from E4M3 subnormals to 448 under the tensor
    scale of row 0's large block, whose other blocks round to a zero scale), with a NaN, an Inf, a
    row of -0, tiny negatives that round to -0 and a zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * torch.exp2(torch.randint(-8, 9, (r, 1), generator=g).float())
    x[0, :] = 1e-6
    x[0, :16] = 1e4
    x[1] = -0.0
    x[2, :16] = 0.0
    x[3, 5] = float("nan")
    x[4, 7] = float("inf")
    x[5, 1::3] = -1e-30
    return x


def _same(q: NVFP4Tensor, r: NVFP4Tensor) -> bool:
    return (torch.equal(q.codes, r.codes) and torch.equal(q.scales.view(torch.uint8), r.scales.view(torch.uint8))
            and torch.equal(q.global_scale.view(torch.int32), r.global_scale.view(torch.int32))
            and (q.shape, q.axis, q.tile_2d) == (r.shape, r.axis, r.tile_2d))


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# ----------------------------------------------------------------------------- reference and errors


@pytest.mark.parametrize("axis", [1, 0])
def test_reference_is_the_butterfly_then_quantize_nvfp4(axis, gen):
    x = torch.randn(32, 48, generator=gen)
    signs = torch.randint(0, 2, (16,), generator=gen).float() * 2 - 1
    for hb, s in ((None, None), (16, signs), (16, None)):
        got = iht_quantize_nvfp4_reference(x, axis=axis, hadamard_block=hb, signs=s, tile_2d=axis == 0)
        v = x if hb is None else hadamard_butterfly(x, block_size=hb, axis=axis, signs=s)
        assert _same(got, quantize_nvfp4(v, axis=axis, tile_2d=axis == 0)) and got.values is None
    rows = torch.tensor([0, 7, 31 if axis == 1 else 47])
    got = iht_quantize_nvfp4_reference(x, axis=axis, zero_rows=rows)
    assert _same(got, quantize_nvfp4(x.index_fill(1 - axis, rows, 0), axis=axis))
    gs = torch.tensor(0.5)
    assert _same(iht_quantize_nvfp4(x, axis=axis, global_scale=gs), quantize_nvfp4(x, axis=axis, global_scale=gs))


def test_argument_errors_name_the_fix(monkeypatch):
    x = torch.randn(8, 32)
    with pytest.raises(ValueError, match="2-D"):
        iht_quantize_nvfp4(torch.randn(32), axis=0)
    with pytest.raises(TypeError, match="dtype"):
        iht_quantize_nvfp4(torch.ones(8, 32, dtype=torch.int32), axis=1)
    with pytest.raises(ValueError, match="axis=2"):
        iht_quantize_nvfp4(x, axis=2)
    with pytest.raises(ValueError, match="no elements"):
        iht_quantize_nvfp4(torch.randn(0, 32), axis=1)
    with pytest.raises(ValueError, match="does not divide"):
        iht_quantize_nvfp4(x, axis=0, hadamard_block=16)
    with pytest.raises(ValueError, match="not supported"):
        iht_quantize_nvfp4(x, axis=1, hadamard_block=12)
    with pytest.raises(ValueError, match="need a Hadamard block"):
        iht_quantize_nvfp4(x, axis=1, signs=torch.ones(16))
    with pytest.raises(ValueError, match="length hadamard_block=16"):
        iht_quantize_nvfp4(x, axis=1, hadamard_block=16, signs=torch.ones(32))
    with pytest.raises(ValueError, match="rounding='up'"):
        iht_quantize_nvfp4(x, axis=1, rounding="up")
    with pytest.raises(ValueError, match="outputs='fp8'"):
        iht_quantize_nvfp4(x, axis=1, outputs="fp8")
    with pytest.raises(ValueError, match="zero_rows"):
        iht_quantize_nvfp4(x, axis=1, zero_rows=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="one positive number"):
        iht_quantize_nvfp4(x, axis=1, global_scale=torch.tensor(-1.0))
    with pytest.raises(ValueError, match="one-element"):
        iht_quantize_nvfp4(x, axis=1, global_scale=torch.ones(2))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="backend='reference' or 'auto'"):
        iht_quantize_nvfp4(x, axis=1, backend="triton")
    with pytest.raises(ValueError, match="backend='bogus'"):
        iht_quantize_nvfp4(x, axis=1, backend="bogus")


def test_values_only_operand_dequantizes_and_multiplies_like_its_codes(gen):
    """An operand holding only the BF16 values (codes ``[rows, 0]``, as the kernel writes for a GEMM
    operand consumed at once) dequantizes to the codes' numbers bit for bit (NaN and zero-scale
    blocks included), passes the layout check and gives the same GEMM; without values it refuses."""
    import dataclasses

    a = _special(24, 40, seed=1)
    a[6, 16:32] = 1e-40  # a block whose E4M3 scale rounds to 0
    b = torch.randn(40, 20, generator=gen)
    qa, qb = quantize_nvfp4(a, axis=1), quantize_nvfp4(b, axis=0, tile_2d=True)
    assert (qa.scales.float() == 0).any() and qa.scales.float().isnan().any()
    va = dataclasses.replace(qa, codes=qa.codes[:, :0], values=nvfp4_block_values(qa))
    assert va.codes_dropped and not qa.codes_dropped
    assert _nan_equal(va.dequantize(), qa.dequantize())
    assert va.nbytes == 24 * 48 // 16 + 4 + 2 * 24 * 48
    vb = dataclasses.replace(qb, values=nvfp4_block_values(qb))
    assert check_nvfp4_layout(va, vb) == (24, 40, 20)
    assert _nan_equal(nvfp4_matmul_bf16(va, vb), nvfp4_matmul_bf16(qa, qb))
    assert _nan_equal(nvfp4_matmul_reference(va, vb), nvfp4_matmul_reference(qa, qb))
    with pytest.raises(ValueError, match="neither E2M1 codes nor values"):
        dataclasses.replace(va, values=None).dequantize()
    with pytest.raises(ValueError, match="bfloat16"):
        check_nvfp4_layout(dataclasses.replace(va, values=va.values.float()), vb)
    with pytest.raises(ValueError, match="codes"):
        check_nvfp4_layout(dataclasses.replace(qa, codes=qa.codes[:, :0]), vb)  # dropped codes, no values


def test_engine_routes_nvfp4_operands_through_the_quantizer(monkeypatch, gen):
    """`adahop.gemm` quantizes every NVFP4 operand (recipes nvfp4, averis, Averis's mean vectors too)
    through iht_quantize_nvfp4, asking for the BF16 values for operands multiplied at once."""
    import adahop.kernels as k
    from adahop.gemm import gemm
    from adahop.recipes import get_recipe

    calls = []
    real = k.iht_quantize_nvfp4

    def spy(x, **kw):
        calls.append((tuple(x.shape), kw["axis"], kw.get("hadamard_block"), kw["rounding"], kw["tile_2d"], kw["outputs"]))
        return real(x, **kw)

    monkeypatch.setattr(k, "iht_quantize_nvfp4", spy)
    a, b = torch.randn(32, 48, generator=gen), torch.randn(48, 16, generator=gen)
    gemm(a, b, get_recipe("nvfp4").gemm("wgrad"), generator=gen)
    assert calls == [((32, 48), 1, 16, "stochastic", False, "values"), ((48, 16), 0, 16, "nearest", False, "values")]
    calls.clear()
    gemm(a, b, get_recipe("averis").gemm("wgrad"), generator=gen)
    assert [c[0] for c in calls] == [(32, 48), (1, 32), (48, 16), (1, 16)]  # residuals, then each mean as one row


def test_nvfp4_layers_have_no_unfused_parts():
    """With the quantizer fused, no NVFP4 layer is a long chain of plain ops any more
    (`adahop.nn.opaque.unfused_parts`); Averis in MXFP4 still is (its mean vectors)."""
    from adahop.nn.opaque import unfused_parts
    from adahop.recipes import get_recipe
    from adahop.recipes.spec import GEMMS

    specs = lambda name: {g: get_recipe(name).gemm(g) for g in GEMMS}  # noqa: E731
    assert unfused_parts(specs("nvfp4")) == () and unfused_parts(specs("averis")) == ()
    assert unfused_parts(specs("averis-mxfp4")) == ("wgrad: MXFP4 mean vectors (reference quantizer)",)


# ----------------------------------------------------------------------------- Triton, interpreted

# Triton's interpreter must be chosen before triton is first imported (torch may import it), so
# these tests run in child pytests with TRITON_INTERPRET=1 set from the start, a few at a time.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not (HAS_TRITON and INTERPRET),
                            reason="run by test_nvfp4_kernels_in_interpreter in a TRITON_INTERPRET=1 child")


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton; runs the interp_* tests in a child process")
@pytest.mark.parametrize("group", ["bit_exact and (ax1 or global)", "bit_exact and (ax0 or transposing)", "rounding or ties or outputs or decode",
                                   "stochastic and blocks", "stochastic and not blocks", "op_traces",
                                   "layer and not averis", "layer and averis"])
def test_nvfp4_kernels_in_interpreter(group):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-W", "ignore",
           "-k", f"interp_ and ({group})"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]


CASES = [  # (shape, axis, hadamard_block, dtype, tile_2d, signs, transposed view)
    ((40, 96), 1, None, torch.float32, False, False, False),
    ((40, 96), 0, None, torch.bfloat16, False, False, False),
    ((35, 50), 1, None, torch.float32, True, False, False),  # ragged rows and Kc, 16x16 tiles
    ((50, 35), 0, None, torch.bfloat16, True, False, False),
    ((48, 64), 0, 16, torch.float32, False, True, False),  # the nvfp4 wgrad: RHT-16 along T
    ((64, 48), 1, 16, torch.bfloat16, False, True, True),  # ∇Yᵀ: a transposed view, K not contiguous
    ((33, 64), 1, 32, torch.float32, False, False, False),  # a Hadamard block spanning two scale blocks
    ((70, 33), 0, None, torch.float32, True, False, True),  # Wᵀ: the fprop B, tiles, a ragged Kc
    ((8, 512), 1, 512, torch.float32, False, True, False),  # above the kernel's 256: Kronecker form first
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][0]}x{c[0][1]}-ax{c[1]}-hb{c[2]}-{str(c[3])[6:]}"
                                                       f"{'-tiles' if c[4] else ''}{'-T' if c[6] else ''}")
@interp
def test_interp_bit_exact(case):
    """RNE: codes, E4M3 scales, tensor scale and the BF16 values equal the reference's (values: the
    GEMM's own build from the reference codes), for every ``outputs``; special values included."""
    shape, axis, hb, dtype, tile, with_signs, transposed = case
    x = _special(*shape, seed=shape[0])
    x = (x.t().contiguous().t() if transposed else x).to(dtype)
    signs = torch.randint(0, 2, (hb,)).float() * 2 - 1 if with_signs else None
    kw = dict(axis=axis, hadamard_block=hb, signs=signs, tile_2d=tile)
    qr = iht_quantize_nvfp4(x, backend="reference", **kw)
    qa = iht_quantize_nvfp4(x, backend="triton", **kw)
    assert _same(qa, qr) and qa.values is not None
    assert _nan_equal(qa.values.float(), nvfp4_block_values(qr).float())
    qc = iht_quantize_nvfp4(x, backend="triton", outputs="codes", **kw)
    assert _same(qc, qr) and qc.values is None
    qv = iht_quantize_nvfp4(x, backend="triton", outputs="values", **kw)
    assert qv.codes_dropped and torch.equal(qv.values.view(torch.int16), qa.values.view(torch.int16))
    assert _nan_equal(qv.dequantize(), qr.dequantize())


@interp
def test_interp_bit_exact_global_scale_and_zero_rows():
    """A given tensor scale (pass 1 skipped) and OE's zeroed rows, against the reference."""
    x = _special(48, 64, seed=2)
    for gs in (torch.tensor(0.25), torch.tensor([3e-3])):
        for axis in (1, 0):
            qr = iht_quantize_nvfp4(x, axis=axis, global_scale=gs, backend="reference")
            qt = iht_quantize_nvfp4(x, axis=axis, global_scale=gs, backend="triton")
            assert _same(qt, qr) and float(qt.global_scale) == float(gs.reshape(()))
    rows = torch.tensor([0, 3, 17])
    for axis in (1, 0):
        r = rows if axis == 1 else rows + 40  # rows of the dim not quantized along
        qr = iht_quantize_nvfp4(x, axis=axis, hadamard_block=16, zero_rows=r, backend="reference")
        qt = iht_quantize_nvfp4(x, axis=axis, hadamard_block=16, zero_rows=r, backend="triton")
        assert _same(qt, qr)
    zero = torch.zeros(16, 32)  # an all-zero tensor: tensor scale 1, every code 0
    q = iht_quantize_nvfp4(zero, axis=1, backend="triton")
    assert _same(q, quantize_nvfp4(zero, axis=1)) and float(q.global_scale) == 1.0


@interp
def test_interp_bit_exact_transposing_plan():
    """The K-major LAYOUT-1 tile (`transposing_plan`, the default for rows contiguous since round 15)
    gives the row tile's bytes (`row_tile_plan`, the LAYOUT-0 default before it): codes, scales,
    tensor scale and values; RNE and SR under one seed, RHT-16 with signs, a 32-block Hadamard,
    16×16 tiles, OE rows, ragged rows and Kc."""
    from adahop.kernels import _triton_quantize_nvfp4 as nq

    signs = torch.randint(0, 2, (16,)).float() * 2 - 1
    for shape, hb, tile, dtype, stoch, keep in (((96, 80), 16, False, torch.bfloat16, False, False),
                                                ((96, 80), 16, False, torch.float32, True, False),
                                                ((70, 50), 0, True, torch.bfloat16, False, False),
                                                ((64, 200), 0, False, torch.bfloat16, False, True),
                                                ((64, 70), 32, False, torch.float32, False, False)):
        x = _special(*shape, seed=shape[1]).to(dtype)  # axis 0 of a row-major x: rows contiguous
        keep_t = None
        if keep:
            keep_t = torch.ones(shape[1], dtype=torch.uint8)
            keep_t[[0, 5, 63]] = 0
        seed = torch.tensor([1234], dtype=torch.int64) if stoch else None
        args = (x, 0, hb, signs if hb == 16 else None, stoch, tile, seed, None, True, True, keep_t)
        plan = nq.transposing_plan(x.element_size(), hb, tile)
        default = nq.default_plan(shape[1], 0, 1, shape[1], hb, tile, x.element_size())
        assert default == (plan if hb <= 16 else nq.row_tile_plan(hb, tile))  # blocks above 16: not timed yet
        want, got = nq.nv_quantize(*args, plan=nq.row_tile_plan(hb, tile)), nq.nv_quantize(*args, plan=plan)
        assert plan["LAYOUT"] == 1 and plan["VEC"] == (2 if dtype == torch.bfloat16 else 1)
        for a, b in zip(want, got):
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (shape, hb, tile)
    with pytest.raises(ValueError, match="LAYOUT 0 or 1"):
        nq.nv_quantize(*args, plan=dict(plan, LAYOUT=2))


if HAS_TRITON and INTERPRET:  # a probe of the kernels' E4M3 rounding (the names it calls must be module globals)
    import triton
    import triton.language as tl

    from adahop.kernels._triton_quantize_nvfp4 import _e4m3_bits, _e4m3_round

    @triton.jit
    def _e4m3_probe(s_ptr, out_ptr, byte_ptr, n, UP: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        s = tl.load(s_ptr + i, mask=i < n, other=0.0)
        v = _e4m3_round(s, UP)
        tl.store(out_ptr + i, v, mask=i < n)
        tl.store(byte_ptr + i, _e4m3_bits(v).to(tl.uint8), mask=i < n)


@interp
def test_interp_e4m3_rounding_of_block_scales():
    """The kernel's E4M3 scale rounding on every E4M3 value, the midpoints between neighbours and
    their float32 neighbours, and random values in [0, 448], subnormals included: nearest-even
    equals torch's float8_e4m3fn cast, up equals the reference's round-up; bytes as torch's."""
    from adahop.formats.nvfp4 import _e4m3_round_up

    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & ~torch.signbit(grid)].sort().values  # a block amax is never -0
    mids = (grid[1:] + grid[:-1]) / 2
    s = torch.cat((grid, mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 500.0)),
                   torch.rand(4000, generator=torch.Generator().manual_seed(0)) ** 6 * 448, torch.tensor([1e-40, 2e-3])))
    s = s.clamp(max=448.0)
    block = 1 << (s.numel() - 1).bit_length()
    for up, want in ((False, s.to(torch.float8_e4m3fn).float()), (True, _e4m3_round_up(s))):
        out, byte = torch.empty_like(s), torch.empty(s.shape, dtype=torch.uint8)
        _e4m3_probe[(1,)](s, out, byte, s.numel(), UP=up, BLOCK=block)
        assert torch.equal(out, want), (up, s[out != want][:5], out[out != want][:5], want[out != want][:5])
        assert torch.equal(byte, want.to(torch.float8_e4m3fn).view(torch.uint8))


@interp
def test_interp_round_to_nearest_ties_and_signed_zeros():
    """Every E2M1 midpoint and its float neighbours at block scale 1 (block amax 6/256, tensor scale
    2^-8, so the scaled values are exact): codes equal the interval table's; -0 and tiny negatives
    give code 8."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 1e-30])
    vals = torch.cat((mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 9.0))))
    vals = torch.cat((vals, -vals, torch.tensor([-0.0])))  # 55 values
    x = torch.cat((vals, torch.zeros(80 - vals.numel()))).reshape(5, 16)
    x[:, 0] = 6.0
    x = x / 256
    gs = torch.tensor(2.0**-8)
    for axis, xx in ((1, x), (0, x.t().contiguous())):
        qt = iht_quantize_nvfp4(xx, axis=axis, global_scale=gs, backend="triton")
        qr = iht_quantize_nvfp4(xx, axis=axis, global_scale=gs, backend="reference")
        assert torch.equal(qr.scales.float(), torch.ones(5, 1)) and _same(qt, qr)
        nibbles = torch.cat((qr.codes & 15, qr.codes >> 4))
        assert (nibbles == 8).any() and (nibbles == 7).any()


@interp
def test_interp_outputs_are_fully_written():
    """Poisoned output buffers: two different poisons give the same, reference, result."""
    from adahop.kernels import _triton_quantize_nvfp4 as nq

    x = _special(24, 40, seed=4)  # axis=0: 40 rows of kc=24 (padded to 32)
    results = []
    for poison in (0x00, 0xFF):
        out = (torch.full((40, 16), poison, dtype=torch.uint8), torch.full((40, 2), poison, dtype=torch.uint8),
               torch.full((), float("nan")), torch.full((40, 64), poison, dtype=torch.uint8).view(torch.bfloat16))
        results.append(nq.nv_quantize(x, 0, 0, None, False, True, None, None, True, True, out=out))
    for a, b in zip(*results):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    qr = iht_quantize_nvfp4(x, axis=0, tile_2d=True, backend="reference")
    assert torch.equal(results[0][0], qr.codes) and torch.equal(results[0][1].view(torch.uint8), qr.scales.view(torch.uint8))
    assert torch.equal(results[0][2], qr.global_scale)


@interp
def test_interp_decode_of_saved_operands_is_the_table_build():
    """The backward's decode of saved packed NVFP4 (Triton) equals the gather build bit for bit: every
    code under every finite E4M3 scale and a NaN scale, and quantized operands of ragged shapes."""
    from adahop.formats.e2m1 import pack_e2m1

    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    s = s[torch.isfinite(s.float())].float()
    s = torch.cat((s, torch.tensor([float("nan")])))
    codes = torch.arange(16, dtype=torch.uint8).repeat(s.numel(), 2)  # two blocks per row, every code
    q = NVFP4Tensor(codes=pack_e2m1(codes), scales=s.to(torch.float8_e4m3fn)[:, None].repeat(1, 2),
                    global_scale=torch.tensor(1.0), shape=(s.numel(), 32), axis=1)
    qs = [q, quantize_nvfp4(_special(37, 40), axis=1), quantize_nvfp4(_special(40, 70, seed=3), axis=0, tile_2d=True)]
    for q in qs:
        got, want = nvfp4_block_values(q, backend="triton"), nvfp4_block_values(q, backend="reference")
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))  # signs of 0 too


def _neighbours(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E2M1 grid points below and above |v| (v scaled, in [0, 6]), signed like v."""
    from adahop.formats.e2m1 import E2M1_VALUES

    a = v.abs().clamp(max=6.0)
    lo = (torch.bucketize(a, E2M1_VALUES, right=True) - 1).clamp(0, 7)
    hi = torch.where(E2M1_VALUES[lo] < a, lo + 1, lo).clamp(max=7)
    return E2M1_VALUES[lo] * v.sign(), E2M1_VALUES[hi] * v.sign()


@interp
@pytest.mark.parametrize("axis, tile, hb", [(1, False, None), (0, True, None), (0, False, 16)],
                         ids=["blocks_ax1", "tiles_ax0", "rht16_ax0"])
def test_interp_stochastic(axis, tile, hb):
    """SR: the reference's block and tensor scales (the block scale rounded up, so nothing clips);
    every code one of the two grid neighbours of the scaled value; unbiased (the mean of 64 draws well
    under RNE's error, no overall bias); fresh across calls, reproducible under a seed. The 64 draws
    are 64 copies of 16 rows in one tensor (their bits come from other Philox offsets)."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(16, 48, generator=g) * torch.exp2(torch.randint(-6, 6, (16, 1), generator=g).float())
    rows = x0.repeat(64, 1)  # X' [rows, kc]: 64 copies of x0, each a whole 16-row tile group
    x = rows if axis == 1 else rows.t().contiguous()
    signs = torch.randint(0, 2, (16,), generator=g).float() * 2 - 1 if hb else None
    kw = dict(axis=axis, hadamard_block=hb, signs=signs, tile_2d=tile, rounding="stochastic")
    qr = iht_quantize_nvfp4(x, backend="reference", **kw)
    q = iht_quantize_nvfp4(x, generator=torch.Generator().manual_seed(1), backend="triton", **kw)
    assert torch.equal(q.scales.view(torch.uint8), qr.scales.view(torch.uint8))
    assert torch.equal(q.global_scale, qr.global_scale)
    v = rows if hb is None else hadamard_butterfly(rows, block_size=hb, axis=1, signs=signs)  # [1024, 48]
    denom = (qr.scales.float() * qr.global_scale).repeat_interleave(16, dim=-1)  # as the reference divides
    sb = qr.scales.float().repeat_interleave(16, dim=-1)
    lo, hi = _neighbours(v / denom)
    got = q.values.float()  # q · s_block
    assert bool(((got == lo * sb) | (got == hi * sb)).all())
    deq = q.dequantize() if axis == 1 else q.dequantize().t()
    mean = deq.reshape(64, 16, 48).double().mean(0)
    v0 = v[:16].double()
    rne = iht_quantize_nvfp4(x0 if axis == 1 else x0.t().contiguous(), axis=axis, hadamard_block=hb, signs=signs,
                             tile_2d=tile, global_scale=qr.global_scale).dequantize().double()
    rne = rne if axis == 1 else rne.t()
    err_mean, err_rne = (mean - v0).pow(2).mean().sqrt(), (rne - v0).pow(2).mean().sqrt()
    assert err_mean < 0.3 * err_rne, f"mean of 64 SR draws {err_mean:.4g} vs RNE {err_rne:.4g}"
    assert float((mean - v0).mean().abs() / v0.abs().mean()) < 3e-3
    assert not torch.equal(deq[:16], deq[16:32])  # other bits for each copy
    x16 = x0 if axis == 1 else x0.t().contiguous()  # the first 16 rows of X', the same Philox offsets
    again = [iht_quantize_nvfp4(x16, generator=torch.Generator().manual_seed(7), backend="triton",
                                global_scale=qr.global_scale, **kw) for _ in range(2)]
    assert torch.equal(again[0].codes, again[1].codes) and not torch.equal(again[0].codes, q.codes[:16])


@interp
def test_interp_op_traces_and_compiles():
    """The triton_op's fake impl (shapes, dtypes) and a compiled quantize + NVFP4 GEMM equal eager."""
    from adahop.kernels._triton_quantize_nvfp4 import quantize_op

    x = torch.randn(48, 32)
    torch.library.opcheck(quantize_op, (x, 0, 16, None, False, False, None, None, True, True, None),
                          test_utils="test_faketensor")

    def f(a, b):
        qa = iht_quantize_nvfp4(a, axis=1, backend="triton", outputs="values")
        qb = iht_quantize_nvfp4(b, axis=0, tile_2d=True, backend="triton", outputs="values")
        return nvfp4_matmul(qa, qb, backend="triton")

    b = torch.randn(32, 24)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x, b), f(x, b), rtol=0, atol=0)


@interp
@pytest.mark.parametrize("recipe", ["nvfp4", "averis"])
def test_interp_layer_matches_the_reference_backend(recipe):
    """A converted layer on the Triton path: y of nvfp4 (RNE fprop) equals the reference backend's to
    FP32 rounding; every gradient is as close to the BF16 one as the reference backend's (its SR
    draws differ); and it compiles in one graph (fullgraph), as the opaque layer ops of the default
    form and (nvfp4) traced, with the quantizer's triton_op in the graph."""
    from adahop.nn import convert_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))
    x = torch.randn(64, 64) + 0.3
    x.requires_grad_(True)
    exact = base(x)
    exact.square().sum().backward()
    ref_grads = (x.grad.clone(), base[0].weight.grad.clone())
    got = {}
    for be in ("reference", "triton"):
        torch.manual_seed(0)  # the same weights as base
        lin = convert_model(torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)), recipe, backend=be, exclude=())
        x.grad = None
        y = lin(x)
        y.square().sum().backward()
        got[be] = (y.detach(), x.grad.clone(), lin[0].weight.grad.clone())
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    if recipe == "nvfp4":
        assert rel(got["triton"][0], got["reference"][0]) < 1e-6
    for i, want in enumerate((exact.detach(), *ref_grads)):
        e_t, e_r = rel(got["triton"][i], want), rel(got["reference"][i], want)
        assert e_t < 0.35 and e_t < 1.5 * e_r + 0.02, (recipe, i, e_t, e_r)
    from adahop.nn.opaque import layer_form, set_compiled_layers

    assert layer_form(lin[0].current_specs()) == "opaque"  # "auto": its quantizers are fused kernels
    for form in ("opaque", "traced") if recipe == "nvfp4" else ("opaque",):
        prev = set_compiled_layers(form)
        try:
            torch.compiler.reset()
            x.grad = None
            y = torch.compile(lin, fullgraph=True, backend="aot_eager")(x)
            y.square().sum().backward()
        finally:
            set_compiled_layers(prev)
        assert torch.isfinite(x.grad).all() and float(x.grad.norm()) > 0, form
        if recipe == "nvfp4":  # an RNE fprop: the compiled y is eager mode's
            torch.testing.assert_close(y.detach(), got["triton"][0], rtol=1e-6, atol=1e-6)
    torch.compiler.reset()
