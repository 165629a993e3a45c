"""Numerics of the format layer: E2M1/E8M0 tables, MXFP4 scale rules, special blocks, layout,
stochastic rounding, NVFP4.

Conformance tests of `specs/baselines.md` §5: T-FMT1, T-SCALE1, T-SCALE2, T-SR1, T-SR2, T-SR3,
T-SHAPE. Reference values are hand-computed from `specs/baselines.md` §1; none is read back from
the code under test. "rceil" is the spec's RCEIL, the smallest power of two with amax/scale ≤ 6 (torchao
RCEIL); the spec's CEIL column, 2^(⌈log2 a⌉−2), is not a rule of the library.
"""

from __future__ import annotations

import math

import pytest
import torch

from adahop.formats import (
    E2M1_VALUES,
    FORMATS,
    SCALE_RULES,
    MXTensor,
    decode_e2m1,
    decode_e8m0,
    encode_e2m1,
    fake_quantize,
    pack_e2m1,
    quantize,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_e2m1,
)
from adahop.formats.e2m1 import encode_e8m0
from adahop.formats.mxfp4 import block_exponents

pytestmark = pytest.mark.usefixtures("single_thread")

F32 = torch.float32
NAN = float("nan")
INF = float("inf")

# ---------------------------------------------------------------------------------------------
# helpers (independent of the code under test: plain arithmetic on the public fields)
# ---------------------------------------------------------------------------------------------


def mx_element_scales(q: MXTensor) -> torch.Tensor:
    """Decode scale of every element of ``q`` (E8M0 scale × elem_scale), in the original shape."""
    s = torch.tensor([2.0 ** (int(c) - 127) if c != 255 else NAN for c in q.scales.flatten().tolist()])
    s = s.reshape(q.scales.shape).repeat_interleave(q.block_size, dim=-1)
    s = s[..., : q.shape[q.axis]].movedim(-1, q.axis)
    return s.double() * q.elem_scale


def half_step(a: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing at magnitude ``a`` (in grid units): the RNE error bound."""
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0)).double()


def on_e2m1_grid(r: torch.Tensor, rtol: float = 0.0) -> torch.Tensor:
    """Whether each value of ``r`` (float64) is ± an E2M1 value (within ``rtol``)."""
    grid = E2M1_VALUES.double()
    d = (r.abs().unsqueeze(-1) - grid).abs().amin(dim=-1)
    return d <= rtol * r.abs().clamp(min=1.0)


def one_block(*vals: float, n: int = 32) -> torch.Tensor:
    """A [1, n] float32 row holding ``vals`` then zeros."""
    x = torch.zeros(1, n)
    x[0, : len(vals)] = torch.tensor(vals)
    return x


# ---------------------------------------------------------------------------------------------
# T-FMT1: E2M1 and E8M0 tables, exhaustively
# ---------------------------------------------------------------------------------------------

E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_decode_e2m1_all_16_codes():
    got = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert got.dtype == F32
    assert got.tolist() == E2M1_TABLE
    # code 8 is -0: equal to 0 but with the sign bit set
    assert got[8].item() == 0.0 and torch.signbit(got[8]).item()
    assert not torch.signbit(got[0]).item()


def test_encode_decode_round_trip_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    back = encode_e2m1(decode_e2m1(codes))
    assert back.tolist() == codes.tolist()  # -0 (code 8) included


def test_e2m1_keeps_the_sign_of_values_that_round_to_zero():
    """The official AdaHOP encoder (and torchao, ml_dtypes, the hardware conversion) keeps the sign
    bit: a negative value that rounds to zero, and -0, are code 8. NaN is +0 (its block is marked
    through the scale)."""
    v = torch.tensor([-0.0, 0.0, -0.1, -0.25, 0.25, -1e-30, NAN, -NAN, -0.26])
    assert encode_e2m1(v).tolist() == [8, 0, 8, 8, 0, 8, 0, 0, 9]
    g = torch.Generator().manual_seed(0)
    sr = encode_e2m1(torch.full((1000,), -0.2), rounding="stochastic", generator=g)
    assert set(sr.tolist()) == {8, 9}  # rounded down to -0 or up to -0.5, never +0


def test_decode_e8m0_all_256_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = decode_e8m0(codes)
    assert got.dtype == F32
    for c in range(255):
        assert got[c].item() == 2.0 ** (c - 127), c  # python float: exact power of two
    assert math.isnan(got[255].item())
    assert got[127].item() == 1.0
    assert got[254].item() == 2.0**127
    # code 0 is 2^-127, an FP32 subnormal (bits 0x00400000), not 0 (TE#3262)
    assert got[0].item() == 2.0**-127 > 0
    assert got[0:1].view(torch.int32).item() == 0x00400000


def test_encode_e8m0_round_trip():
    e = torch.arange(-127, 128, dtype=torch.int32)
    codes = encode_e8m0(e)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == list(range(255))
    assert torch.equal(decode_e8m0(codes), torch.ldexp(torch.ones(255), e.float()))


def test_decoders_reject_non_uint8():
    with pytest.raises(TypeError, match="uint8"):
        decode_e2m1(torch.arange(4))
    with pytest.raises(TypeError, match="uint8"):
        decode_e8m0(torch.arange(4))


def test_pack_even_index_in_low_nibble():
    packed = pack_e2m1(torch.tensor([1, 2], dtype=torch.uint8))
    assert packed.tolist() == [0x21]
    packed = pack_e2m1(torch.tensor([[15, 0, 7, 8]], dtype=torch.uint8))
    assert packed.tolist() == [[0x0F, 0x87]]


def test_pack_unpack_round_trip(gen):
    codes = torch.randint(0, 16, (3, 5, 64), generator=gen).to(torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_e2m1(packed), codes)
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_e2m1(unpack_e2m1(all_bytes)), all_bytes)


def test_packed_bytes_follow_the_official_encoder():
    """Byte-level reference vector (`specs/adahop.md` §6.1): the sign of a value that rounds to
    zero is kept (code 8), and under the adahop rule an all-zero block has scale code 1."""
    x = torch.zeros(3, 32)
    x[0, :5] = torch.tensor([4.0, -0.1, -0.0, 0.1, 6.0])  # amax 6: exponent 0 under both rules
    x[2] = -0.0
    want = [0x86, 0x08, 0x07] + [0] * 13 + [0] * 16 + [0x88] * 16
    for rule, zero_code in (("adahop", 1), ("floor", 0)):
        q = quantize_mxfp4(x.reshape(1, 96), scale_rule=rule)
        assert q.codes.flatten().tolist() == want, rule
        assert q.scales.tolist() == [[127, zero_code, zero_code]], rule
        dq = q.dequantize()[0]
        assert torch.signbit(dq[[1, 2, 64]]).all() and not torch.signbit(dq[[3, 32]]).any()


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


# Round-half-to-even at all 7 midpoints (baselines §1.1, RNE column), as in torchao test_kernels.py.
RNE_TIES = [
    (0.25, 0.0),  # tie to even (code 0 over code 1)
    (0.75, 1.0),  # tie to even (code 2 over code 1)
    (1.25, 1.0),  # tie to even (code 2 over code 3)
    (1.75, 2.0),  # tie to even (code 4 over code 3)
    (2.5, 2.0),  # tie to even (code 4 over code 5)
    (3.5, 4.0),  # tie to even (code 6 over code 5)
    (5.0, 4.0),  # tie to even (code 6 over code 7)
]
RNE_CASES = RNE_TIES + [(-v, -r) for v, r in RNE_TIES] + [
    (0.0, 0.0),
    (0.2, 0.0),
    (0.3, 0.5),
    (2.9, 3.0),
    (4.9, 4.0),
    (5.1, 6.0),
    (6.0, 6.0),
    (6.5, 6.0),  # saturates
    (7.0, 6.0),  # saturates
    (-7.0, -6.0),  # saturates
    (1e30, 6.0),  # saturates
    (INF, 6.0),  # saturates
]


@pytest.mark.parametrize("v, expected", RNE_CASES, ids=[f"{v:g}" for v, _ in RNE_CASES])
def test_encode_rne_table(v, expected):
    got = decode_e2m1(encode_e2m1(torch.tensor([v]))).item()
    assert got == expected


def test_rne_neighbours_of_midpoints_round_away_from_the_tie():
    """One float32 ulp either side of a midpoint rounds to the nearer grid value, not the even one."""
    grid = E2M1_VALUES.tolist()
    for lo, hi in zip(grid[:-1], grid[1:]):
        mid = torch.tensor([(lo + hi) / 2])
        above = torch.nextafter(mid, torch.tensor([INF]))
        below = torch.nextafter(mid, torch.tensor([-INF]))
        assert decode_e2m1(encode_e2m1(above)).item() == hi
        assert decode_e2m1(encode_e2m1(below)).item() == lo


def test_encode_rejects_unknown_rounding():
    with pytest.raises(ValueError, match="nearest.*stochastic"):
        encode_e2m1(torch.zeros(2), rounding="up")


def test_encode_matches_ml_dtypes_oracle(gen):
    """ml_dtypes' float4_e2m1fn is RNE with saturation: an independent oracle for our encoder."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np = pytest.importorskip("numpy")
    v = torch.rand(20000, generator=gen) * 16 - 8
    # add the exact midpoints, grid values and their float32 neighbours
    special = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + E2M1_VALUES.tolist())
    special = torch.cat((special, torch.nextafter(special, special + 1), torch.nextafter(special, special - 1)))
    v = torch.cat((v, special, -special))
    v = torch.cat((v, torch.tensor([-0.0, -0.1, -0.25, 0.1])))
    codes = encode_e2m1(v)
    oracle = v.numpy().astype(ml_dtypes.float4_e2m1fn)
    assert torch.equal(codes, torch.from_numpy(oracle.view(np.uint8)))  # the codes, signed zeros included
    assert torch.equal(decode_e2m1(codes), torch.from_numpy(oracle.astype(np.float32)))


# ---------------------------------------------------------------------------------------------
# T-SCALE1: scale rules
# ---------------------------------------------------------------------------------------------

# (amax, rule, block exponent, value the block max decodes to). baselines §1.4 table; "rceil" is
# RCEIL there; "adahop" rounds amax to one mantissa bit then floors; "tseng" stores the floor
# exponent and quantizes 0.75·amax/X, decoding with an extra 4/3.
SCALE_VECTORS = [
    (1.5, "floor", -2, 1.5),  # 6.0 -> 6
    (1.6, "floor", -2, 1.5),  # 6.4 -> 6 (clip)
    (1.75, "floor", -2, 1.5),  # 7.0 -> 6 (clip)
    (3.9, "floor", -1, 3.0),  # 7.8 -> 6 (clip)
    (6.0, "floor", 0, 6.0),  # 6 -> 6
    (7.0, "floor", 0, 6.0),  # 7 -> 6 (clip)
    (1.5, "rceil", -2, 1.5),  # 6.0 -> 6
    (1.6, "rceil", -1, 1.5),  # 3.2 -> 3
    (1.75, "rceil", -1, 2.0),  # 3.5 -> 4 (tie to even)
    (3.9, "rceil", 0, 4.0),  # 3.9 -> 4
    (6.0, "rceil", 0, 6.0),  # 6 -> 6
    (7.0, "rceil", 1, 8.0),  # 3.5 -> 4 (tie to even)
    (1.5, "adahop", -2, 1.5),  # 6.0 -> 6
    (1.6, "adahop", -2, 1.5),  # 6.4 -> 6 (clip: mantissa in (1.5, 1.75))
    (1.75, "adahop", -1, 2.0),  # 3.5 -> 4
    (3.9, "adahop", 0, 4.0),  # 3.9 -> 4
    (6.0, "adahop", 0, 6.0),  # 6 -> 6
    (7.0, "adahop", 1, 8.0),  # 3.5 -> 4
    (1.5, "tseng", -2, 4 / 3),  # 0.75·6 = 4.5 -> 4, ·2^-2·4/3
    (1.6, "tseng", -2, 4 / 3),  # 4.8 -> 4
    (1.75, "tseng", -2, 2.0),  # 5.25 -> 6
    (3.9, "tseng", -1, 4.0),  # 5.85 -> 6
    (6.0, "tseng", 0, 16 / 3),  # 4.5 -> 4
    (7.0, "tseng", 0, 8.0),  # 5.25 -> 6
]


@pytest.mark.parametrize(
    "amax, rule, exponent, decoded", SCALE_VECTORS, ids=[f"{r}-{a}" for a, r, _, _ in SCALE_VECTORS]
)
def test_scale_rule_vectors(amax, rule, exponent, decoded):
    assert block_exponents(torch.tensor([amax]), rule).tolist() == [exponent]
    q = quantize_mxfp4(one_block(amax, -amax, amax / 8), scale_rule=rule)
    assert q.exponents.tolist() == [[exponent]]
    dq = q.dequantize()
    torch.testing.assert_close(dq[0, :2], torch.tensor([decoded, -decoded]), rtol=1e-7, atol=0)


def test_issue_acceptance_vector_amax_7():
    x = one_block(7.0, 1.0, -2.0, 0.5)
    assert quantize_mxfp4(x, scale_rule="floor").dequantize()[0, 0].item() == 6.0
    assert quantize_mxfp4(x, scale_rule="rceil").dequantize()[0, 0].item() == 8.0


def test_block_exponents_zero_and_range():
    amax = torch.tensor([0.0, 2.0**-149, 1e-38, 2.0**-126, 3.0e38, torch.finfo(F32).max])
    for rule in SCALE_RULES:
        e = block_exponents(amax, rule)
        assert e.dtype == torch.int32
        assert e[0].item() == (-126 if rule == "adahop" else -127)  # zero block -> code 0 (adahop: 1)
        assert (e >= -127).all() and (e <= 127).all()
    assert block_exponents(amax[-1:], "floor").item() == 125  # 2^127·1.99.. -> 127 - 2
    assert block_exponents(amax[-1:], "rceil").item() == 126
    assert block_exponents(torch.tensor([2.0**-130]), "adahop").item() == -126  # adahop floor
    with pytest.raises(ValueError, match="floor"):
        block_exponents(amax, "even")


# Fractions of N(0,1) 32-blocks that clip, and RTN relative MSE (baselines §1.4 [sim]; adahop is
# the EVEN rule there).
GAUSSIAN_REGRESSION = {
    "floor": (0.296, 0.0132),
    "rceil": (0.0, 0.0133),
    "adahop": (0.127, 0.0125),
    "tseng": (0.0, None),
}


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_clipping_fraction_and_mse_regression(rule, gen):
    x = torch.randn(20000, 32, generator=gen)
    q = quantize_mxfp4(x, scale_rule=rule)
    amax = x.abs().amax(dim=-1).double()
    ratio = amax / torch.exp2(q.exponents[:, 0].double()) * (0.75 if rule == "tseng" else 1.0)
    clip_frac = (ratio > 6).double().mean().item()
    want_clip, want_mse = GAUSSIAN_REGRESSION[rule]
    if want_clip == 0.0:
        assert clip_frac == 0.0 and ratio.max().item() <= 6.0
        # nothing clips, so the block max decodes within half a grid step of itself
        dq_max = quantize_mxfp4(x, scale_rule=rule).dequantize().abs().amax(dim=-1).double()
        assert ((dq_max - amax).abs() <= torch.exp2(q.exponents[:, 0].double()) * q.elem_scale + 1e-12).all()
    else:
        assert abs(clip_frac - want_clip) < 0.015, f"{rule}: {clip_frac:.4f} of blocks clip"
    if want_mse is not None:
        mse = ((q.dequantize() - x).double().pow(2).sum() / x.double().pow(2).sum()).item()
        assert abs(mse / want_mse - 1) < 0.04, f"{rule}: relative MSE {mse:.5f}"


# ---------------------------------------------------------------------------------------------
# T-SCALE2: special blocks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_all_zero_block(rule):
    """Scale code 0 (OCP, torchao), except under the adahop rule: code 1, as the official encoder
    (it clamps every scale code to >= 1)."""
    x = torch.zeros(2, 64)
    q = quantize_mxfp4(x, scale_rule=rule)
    c = 1 if rule == "adahop" else 0
    assert q.scales.tolist() == [[c, c], [c, c]]
    dq = q.dequantize()
    assert torch.isfinite(dq).all() and (dq == 0).all()
    assert math.isfinite(decode_e8m0(q.scales).min().item())


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("value", [1e-40, -1e-40, 1e-45, 2.0**-149])
def test_fp32_subnormal_block_is_finite(rule, value):
    x = torch.full((1, 32), value)
    x[0, 3] = -value / 2
    q = quantize_mxfp4(x, scale_rule=rule)
    dq = q.dequantize()
    assert torch.isfinite(dq).all()
    # a subnormal amax gets the smallest exponent: 2^-127 (code 0); adahop stops at 2^-126
    assert q.scales.item() == (1 if rule == "adahop" else 0)
    # the best a block at 2^-127 can do: |x| ≤ 6·2^-127 and the error is at most half a step
    assert ((dq.double() - x.double()).abs() <= 2.0**-127).all()


@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_tiny_normal_blocks_keep_their_value(rule):
    # 1e-38 = 1.70·2^-127: scale 2^-127 (code 0), 1.70 -> 1.5
    dq = quantize_mxfp4(torch.full((1, 32), 1e-38), scale_rule=rule).dequantize()
    assert (dq == 1.5 * 2.0**-127).all()
    # 2^-126 = 2·2^-127 is exact
    dq = quantize_mxfp4(torch.full((1, 32), 2.0**-126), scale_rule=rule).dequantize()
    assert (dq == 2.0**-126).all()


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
def test_nonfinite_block_is_nan_and_isolated(rule, bad, gen):
    x = torch.randn(3, 100, generator=gen)
    x[1, 40] = bad  # block 1 of row 1
    q = quantize_mxfp4(x, scale_rule=rule)
    assert q.scales[1, 1].item() == 255
    assert q.exponents[1, 1].item() == 128
    dq = q.dequantize()
    assert torch.isnan(dq[1, 32:64]).all()  # the whole block, not just the bad element
    # its element codes are zeros, so twin kernels can match codes bit for bit
    assert (unpack_e2m1(q.codes)[1, 32:64] == 0).all()
    mask = torch.ones_like(dq, dtype=torch.bool)
    mask[1, 32:64] = False
    assert torch.isfinite(dq[mask]).all()
    # every other block is exactly what it would be without the bad element
    clean = x.clone()
    clean[1, 40] = 0.0
    ref = quantize_mxfp4(clean, scale_rule=rule)
    assert torch.equal(dq[mask], ref.dequantize()[mask])
    other = torch.ones_like(q.scales, dtype=torch.bool)
    other[1, 1] = False
    assert torch.equal(q.scales[other], ref.scales[other])


def test_all_nan_block_and_huge_float64():
    x = torch.full((1, 64), NAN, dtype=torch.float64)
    x[0, 32:] = 1.0
    x[0, 40] = 1e39  # amax >= 2^128: not an FP32 number, so the block is NaN
    q = quantize_mxfp4(x)
    assert q.scales.tolist() == [[255, 255]]
    assert torch.isnan(q.dequantize()).all()


def test_nvfp4_special_blocks(gen):
    x = torch.randn(2, 64, generator=gen)
    x[0, 20] = NAN
    x[1, 60] = INF
    q = quantize_nvfp4(x)
    dq = q.dequantize()
    assert torch.isnan(dq[0, 16:32]).all() and torch.isnan(dq[1, 48:64]).all()
    mask = torch.ones_like(dq, dtype=torch.bool)
    mask[0, 16:32] = False
    mask[1, 48:64] = False
    assert torch.isfinite(dq[mask]).all()
    # the tensor scale comes from the finite values only
    finite_amax = x[mask].abs().max()
    assert q.global_scale.item() == (finite_amax / (448.0 * 6.0)).item()

    z = quantize_nvfp4(torch.zeros(4, 48))
    assert z.global_scale.item() == 1.0
    assert (z.dequantize() == 0).all()

    # FP32-subnormal and tiny tensors: amax / 2688 underflows, which once made 0/0 = NaN scales
    for tiny in (1e-40, 1e-42, 1e-44, 1e-45, 1e-38):
        x = torch.full((2, 32), tiny)
        x[1, 16:] = 0.0  # a zero block next to them
        for rounding in ("nearest", "stochastic"):
            dq = quantize_nvfp4(x, rounding=rounding).dequantize()
            assert torch.isfinite(dq).all(), (tiny, rounding)
            assert (dq[1, 16:] == 0).all()
            assert ((dq.double() - x.double()).abs() <= x.double().abs()).all()  # never worse than 0


# ---------------------------------------------------------------------------------------------
# Layout: padding, rows, axes, dtypes (T-SHAPE)
# ---------------------------------------------------------------------------------------------


def test_padding_row_of_48(gen):
    x = torch.randn(3, 48, generator=gen)
    q = quantize_mxfp4(x, block_size=32)
    assert q.scales.shape == (3, 2)
    assert q.codes.shape == (3, 32)  # 64 padded elements, two per byte
    assert (unpack_e2m1(q.codes)[:, 48:] == 0).all()  # padding encodes as zeros
    assert q.dequantize().shape == (3, 48)
    assert q.nbytes == 3 * 32 + 3 * 2
    # the padding is zeros, so it never sets a scale: a tiny partial block equals itself zero-padded
    x[2, 32:] = torch.randn(16, generator=gen) * 1e-6
    tail = quantize_mxfp4(torch.cat((x[2, 32:], torch.zeros(16)))).dequantize()[:16]
    assert torch.equal(quantize_mxfp4(x).dequantize()[2, 32:], tail)


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_never_spans_two_rows(fmt, gen):
    x = torch.randn(2, 48, generator=gen) * 1e-2
    x[0, 47] = 1e4  # last block of row 0; a flattened layout would share it with row 1's start
    dq = quantize(x, fmt).dequantize()
    row1 = quantize(x[1:], fmt).dequantize()
    if fmt == "mxfp4":  # NVFP4's tensor scale legitimately couples rows
        assert torch.equal(dq[1:], row1)
    rel = ((dq[1] - x[1]).norm() / x[1].norm()).item()
    assert rel < 0.2, f"row 1 lost its precision: relative error {rel:.3f}"


def assert_within_half_step(x: torch.Tensor, q: MXTensor) -> None:
    """RNE error bound: every element (that does not clip) is within half a grid step."""
    s = mx_element_scales(q)
    xd = x.double()
    a = xd.abs() / s
    ok = a <= 6
    err = (q.dequantize().double() - xd).abs()
    bound = half_step(a) * s * (1 + 2.0**-22 if q.elem_scale != 1.0 else 1.0)  # FP32-rounded 4/3
    bad = ok & (err > bound)
    assert not bad.any(), f"{int(bad.sum())} elements beyond half a step, e.g. x={xd[bad][:3].tolist()}"


SIZES = (16, 48, 60, 144, 200)
SHAPES_2D = [(m, k) for m in SIZES for k in SIZES]


@pytest.mark.parametrize("m, k", SHAPES_2D, ids=[f"{m}x{k}" for m, k in SHAPES_2D])
def test_shape_sweep(m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g)
    q = quantize_mxfp4(x, scale_rule="rceil")
    assert q.scales.shape == (m, -(-k // 32)) and q.codes.shape == (m, 16 * -(-k // 32))
    assert_within_half_step(x, q)
    # axis 0 is axis 1 of the transpose
    q0 = quantize_mxfp4(x, axis=0, scale_rule="rceil")
    assert q0.scales.shape == (k, -(-m // 32)) and q0.axis == 0
    assert torch.equal(q0.dequantize(), quantize_mxfp4(x.t().contiguous(), scale_rule="rceil").dequantize().t())
    n = quantize_nvfp4(x)
    assert n.scales.shape == (m, -(-k // 16))
    assert n.dequantize().shape == (m, k)
    assert torch.equal(quantize_nvfp4(x, axis=0).dequantize(), quantize_nvfp4(x.t().contiguous()).dequantize().t())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
def test_every_axis_of_a_3d_tensor(fmt, axis, gen):
    x = torch.randn(5, 40, 33, generator=gen)
    q = quantize(x, fmt, axis=axis)
    assert q.axis == axis % 3
    dq = q.dequantize()
    assert dq.shape == x.shape
    ref = quantize(x.movedim(axis, -1).contiguous(), fmt).dequantize().movedim(-1, axis)
    assert torch.equal(dq, ref)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(fmt, dtype, gen):
    x = torch.randn(6, 80, generator=gen).to(dtype)
    q = quantize(x, fmt)
    ref = quantize(x.float(), fmt)  # float16/bfloat16 -> float32 is exact; float64 is rounded (documented)
    assert torch.equal(q.codes, ref.codes)
    assert torch.equal(q.scales.view(torch.uint8), ref.scales.view(torch.uint8))
    out = q.dequantize(dtype)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, q.dequantize().to(dtype))
    assert torch.equal(fake_quantize(x, fmt), out)
    if fmt == "mxfp4":
        assert_within_half_step(x.float(), quantize_mxfp4(x, scale_rule="rceil"))


def test_float64_is_rounded_to_float32_before_the_format():
    # values float32 cannot hold: the documented rule takes amax and ties from their float32 roundings
    xd = torch.tensor([[4.0, 0.25 + 1e-12, 0.75 - 1e-12, 2.5 + 1e-9] + [0.0] * 28], dtype=torch.float64)
    q = quantize_mxfp4(xd)
    assert q.dequantize(torch.float64)[0, :4].tolist() == [4.0, 0.0, 1.0, 2.0]  # ties of the float32 values, to even
    x8 = torch.tensor([[8 - 1e-10] + [1.0] * 31], dtype=torch.float64)  # 8.0 in float32: the next binade's scale
    assert quantize_mxfp4(x8).dequantize(torch.float64)[0, 0].item() == 8.0


@pytest.mark.parametrize("rule, edge, exp", [("rceil", 1.75, 126), ("adahop", 1.75, 126), ("tseng", 1.6667, 125)])
def test_amax_near_float32_max_rounds_to_2_pow_128(rule, edge, exp):
    # documented in quantize_mxfp4: 2^126 x 4 (tseng: 2^125 x 6 x 4/3) is an MXFP4 value float32 cannot hold
    below, at = torch.zeros(2, 32), torch.zeros(2, 32)
    below[0, 0], at[0, 0] = 0.99 * edge * 2.0**127, edge * 2.0**127
    assert torch.isfinite(quantize_mxfp4(below, scale_rule=rule).dequantize()).all()
    q = quantize_mxfp4(at, scale_rule=rule)
    assert int(q.scales[0, 0]) == exp + 127 and torch.isinf(q.dequantize()[0, 0])
    big = torch.zeros(1, 32)
    big[0, 0] = torch.finfo(torch.float32).max
    assert torch.isfinite(quantize_mxfp4(big, scale_rule="floor").dequantize()).all()  # floor clips instead


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_input(fmt, gen):
    x = torch.randn(96, 64, generator=gen).t()  # strided view
    assert not x.is_contiguous()
    assert torch.equal(quantize(x, fmt).dequantize(), quantize(x.contiguous(), fmt).dequantize())
    sl = torch.randn(8, 200, generator=gen)[:, ::3]
    assert torch.equal(quantize(sl, fmt).dequantize(), quantize(sl.contiguous(), fmt).dequantize())


def test_one_dimensional_and_block_sizes(gen):
    x = torch.randn(70, generator=gen)
    for bs in (2, 16, 32, 64):
        q = quantize_mxfp4(x, block_size=bs, scale_rule="rceil")
        assert q.scales.shape == (-(-70 // bs),)
        assert q.dequantize().shape == (70,)
        assert_within_half_step(x, q)


def test_fake_quantize_matches_quantize(gen):
    x = torch.randn(4, 64, generator=gen, dtype=torch.bfloat16)
    for rule in SCALE_RULES:
        assert torch.equal(
            fake_quantize(x, "mxfp4", scale_rule=rule), quantize_mxfp4(x, scale_rule=rule).dequantize(torch.bfloat16)
        )


# ---------------------------------------------------------------------------------------------
# max_scale_range and the FP8 fold (DESIGN.md §3)
# ---------------------------------------------------------------------------------------------


def rows_with_spread(gen: torch.Generator, rows: int = 16, blocks: int = 8, spread: int = 14) -> torch.Tensor:
    """Gaussian rows whose blocks are scaled by 2^k, k in [-spread, spread]."""
    x = torch.randn(rows, blocks, 32, generator=gen)
    k = torch.randint(-spread, spread + 1, (rows, blocks, 1), generator=gen).float()
    return (x * torch.exp2(k)).reshape(rows, blocks * 32)


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_max_scale_range_bounds_the_exponent_spread(rule, gen):
    x = rows_with_spread(gen)
    free = quantize_mxfp4(x, scale_rule=rule).exponents
    e = quantize_mxfp4(x, scale_rule=rule, max_scale_range=8).exponents
    row_max = free.amax(dim=-1, keepdim=True)
    assert (e >= row_max - 8).all()
    assert torch.equal(e, torch.maximum(free, row_max - 8))  # only raised, and only as far as needed
    assert (free < row_max - 8).any()  # the input does exercise the clamp


def test_max_scale_range_raises_tiny_block():
    x = torch.zeros(1, 64)
    x[0, 0] = 1e4  # floor exponent: 13 - 2 = 11
    x[0, 32:] = 1e-6  # floor exponent: -20 - 2 = -22
    assert quantize_mxfp4(x).exponents.tolist() == [[11, -22]]
    q = quantize_mxfp4(x, max_scale_range=8)
    assert q.exponents.tolist() == [[11, 3]]
    assert (q.dequantize()[0, 32:] == 0).all()  # 1e-6 / 2^3 underflows the E2M1 grid


@pytest.mark.parametrize("bad", [NAN, INF])
def test_max_scale_range_ignores_nonfinite_blocks(bad):
    x = torch.zeros(1, 96)
    x[0, 0] = bad
    x[0, 32:64] = 1.0  # exponent -2
    x[0, 64:] = 1e-3  # exponent -10 - 2 = -12, raised to -2 - 8 = -10
    q = quantize_mxfp4(x, max_scale_range=8)
    assert q.exponents.tolist() == [[128, -2, -10]]


@pytest.mark.parametrize("rule", ["floor", "rceil", "adahop"])
def test_fp8_fold_is_exact_with_range_8(rule, gen):
    """q·2^(e−E_row) is an E4M3 value for every element when max_scale_range=8: one FP32 scale
    per row plus FP8 E4M3 data represent the MXFP4 tensor exactly."""
    x = rows_with_spread(gen, spread=20)
    for r, should_fold in ((8, True), (None, False)):
        q = quantize_mxfp4(x, scale_rule=rule, max_scale_range=r)
        e_row = q.exponents.amax(dim=-1, keepdim=True)  # [rows, 1]
        folded = torch.ldexp(q.dequantize(), -e_row.float())  # q·2^(e−E): exact in fp32
        back = folded.to(torch.float8_e4m3fn).float()
        assert torch.equal(back, folded) == should_fold


def test_max_scale_range_validation():
    for r in (-1, 2.5, "8"):
        with pytest.raises(ValueError, match="max_scale_range"):
            quantize_mxfp4(torch.ones(32), max_scale_range=r)


# ---------------------------------------------------------------------------------------------
# Stochastic rounding: T-SR1, T-SR2, T-SR3
# ---------------------------------------------------------------------------------------------

N_DRAWS = 256


def sr_draws(x: torch.Tensor, fmt: str, gen: torch.Generator, **kw) -> torch.Tensor:
    """N_DRAWS stochastic fake-quantizations of ``x`` [rows, k] in one call (rows are independent)."""
    xs = x.unsqueeze(0).expand(N_DRAWS, *x.shape).contiguous()
    if fmt == "nvfp4":  # the tensor scale couples rows: keep each draw a separate tensor
        draws = [quantize_nvfp4(x, rounding="stochastic", generator=gen).dequantize() for _ in range(N_DRAWS)]
        return torch.stack(draws)
    return quantize_mxfp4(xs, rounding="stochastic", generator=gen, **kw).dequantize()


def element_step(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 grid spacing around each element, in the element's units."""
    a = x.double().abs() / scale
    return 2 * half_step(a) * scale


@pytest.mark.parametrize("fmt, rule", [("mxfp4", "rceil"), ("mxfp4", "tseng"), ("nvfp4", None)])
def test_sr_unbiased_and_beats_rtn(fmt, rule, gen):
    x = torch.randn(8, 64, generator=gen) * torch.exp2(torch.randint(-6, 7, (8, 1), generator=gen).float())
    kw = {"scale_rule": rule} if rule else {}
    draws = sr_draws(x, fmt, gen, **kw)
    rtn = quantize(x, fmt, **kw)
    if fmt == "mxfp4":
        scale = mx_element_scales(rtn)
    else:  # NVFP4's SR scales are rounded up, so they are not RTN's: read them from an SR result
        sr = quantize_nvfp4(x, rounding="stochastic", generator=gen)
        scale = (sr.scales.float() * sr.global_scale).double().repeat_interleave(16, dim=-1)
    # σ of one draw is at most half the grid step; the mean of 256 draws is within 4σ/√256
    sigma = element_step(x, scale) / 2
    mean = draws.double().mean(dim=0)
    err = (mean - x.double()).abs()
    assert (err <= 4 * sigma / math.sqrt(N_DRAWS)).all(), f"worst {(err / sigma).max().item():.3f}σ"
    rmse_mean = err.pow(2).mean().sqrt().item()
    rmse_rtn = (rtn.dequantize().double() - x.double()).pow(2).mean().sqrt().item()
    assert rmse_mean < rmse_rtn, f"mean of SR draws {rmse_mean:.3g} vs RTN {rmse_rtn:.3g}"
    assert not torch.equal(draws[0], draws[1])  # two draws differ
    # pooled over all elements the error is far tighter: a bias of 1% of a step shows up. The error
    # is signed along x, so a pull toward zero does not cancel between positive and negative x.
    pooled = ((draws.double() - x.double()) * x.sign().double() / (2 * sigma).clamp(min=1e-300)).mean().item()
    assert abs(pooled) < 4 * 0.5 / math.sqrt(draws.numel()), f"pooled bias {pooled:.2e} steps"
    # every draw lands on one of the two grid neighbours of x
    assert ((draws.double() - x.double()).abs() <= element_step(x, scale) * (1 + 1e-6)).all()


@pytest.mark.parametrize("rule", ["floor", "adahop"])
def test_sr_refuses_clipping_rules(rule):
    with pytest.raises(ValueError, match="rceil"):
        quantize_mxfp4(torch.ones(32), scale_rule=rule, rounding="stochastic")


@pytest.mark.parametrize("rule", ["rceil", "tseng"])
def test_sr_never_clips(rule, gen):
    x = torch.randn(512, 32, generator=gen)
    q = quantize_mxfp4(x, scale_rule=rule, rounding="stochastic", generator=gen)
    s = mx_element_scales(q)
    # before rounding |x|·pre/2^e ≤ 6, where pre is 1 (ceil) or 3/4 (tseng): checked from the inputs
    amax = x.abs().amax(dim=-1).double()
    pre = 0.75 if rule == "tseng" else 1.0
    assert (amax * pre / torch.exp2(q.exponents[:, 0].double()) <= 6).all()
    # and from the decode: |dequant| ≤ 6 · scale · elem_scale
    assert (q.dequantize().double().abs() <= 6 * s).all()


@pytest.mark.parametrize("rule", ["rceil", "tseng"])
def test_sr_block_max_is_unbiased(rule, gen):
    """A block of 7s: floor would always give 6; a non-clipping rule averages to 7."""
    x = torch.full((N_DRAWS, 32), 7.0)
    dq = quantize_mxfp4(x, scale_rule=rule, rounding="stochastic", generator=gen).dequantize().double()
    assert abs(dq.mean().item() - 7.0) < 4 * 1.0 / math.sqrt(dq.numel())  # step 2 -> σ ≤ 1


def test_sr_generator_hygiene():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))

    def codes(seed):
        g = torch.Generator().manual_seed(seed)
        return quantize_mxfp4(x, scale_rule="rceil", rounding="stochastic", generator=g).codes

    assert torch.equal(codes(7), codes(7))
    assert not torch.equal(codes(7), codes(8))
    g = torch.Generator().manual_seed(7)
    a = quantize_mxfp4(x, scale_rule="rceil", rounding="stochastic", generator=g).codes
    b = quantize_mxfp4(x, scale_rule="rceil", rounding="stochastic", generator=g).codes
    assert not torch.equal(a, b)  # fresh bits across calls on one generator
    # generator=None draws from the global RNG
    c = quantize_mxfp4(x, scale_rule="rceil", rounding="stochastic").codes
    d = quantize_mxfp4(x, scale_rule="rceil", rounding="stochastic").codes
    assert c.shape == a.shape and not torch.equal(c, d)
    # NVFP4 too
    n1 = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(3)).codes
    n2 = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(3)).codes
    n3 = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(4)).codes
    assert torch.equal(n1, n2) and not torch.equal(n1, n3)
    assert quantize_nvfp4(x, rounding="stochastic").dequantize().shape == x.shape


def test_sr_on_grid_values_is_deterministic(gen):
    """A value already on the grid has P(up) = 0: SR returns it exactly."""
    sign = torch.where(torch.rand(64, 32, generator=gen) < 0.5, -1.0, 1.0)
    x = E2M1_VALUES[torch.randint(0, 8, (64, 32), generator=gen)] * sign
    x[:, 0] = 6.0  # ceil exponent 0 for every block
    dq = quantize_mxfp4(x, scale_rule="rceil", rounding="stochastic", generator=gen).dequantize()
    assert torch.equal(dq, x)


# ---------------------------------------------------------------------------------------------
# The Tseng 3/4 pre-scale
# ---------------------------------------------------------------------------------------------


def test_tseng_values_are_q_times_scale_times_4_3(gen):
    x = torch.randn(64, 96, generator=gen)
    q = quantize_mxfp4(x, scale_rule="tseng")
    assert q.elem_scale == pytest.approx(4 / 3, abs=0)
    floor = quantize_mxfp4(x, scale_rule="floor")
    assert torch.equal(q.scales, floor.scales)  # tseng stores the floor exponent
    s = torch.exp2(q.exponents.double()).repeat_interleave(32, dim=-1)
    r = q.dequantize().double() / (s * 4 / 3)
    assert on_e2m1_grid(r, rtol=1e-6).all()
    assert_within_half_step(x, q)  # nothing clips


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [quantize_mxfp4, quantize_nvfp4])
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64, torch.uint8])
def test_rejects_non_float_dtypes(fn, dtype):
    x = torch.ones(4, 32).to(dtype)
    with pytest.raises(TypeError, match=str(dtype)):
        fn(x)


@pytest.mark.parametrize("fn", [quantize_mxfp4, quantize_nvfp4])
def test_rejects_bad_shapes(fn):
    with pytest.raises(ValueError, match="empty"):
        fn(torch.zeros(4, 0))
    with pytest.raises(ValueError, match="empty"):
        fn(torch.zeros(0, 4), axis=0)
    with pytest.raises(ValueError, match="scalar"):
        fn(torch.tensor(1.0))
    with pytest.raises(ValueError, match="out of range"):
        fn(torch.zeros(4, 32), axis=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        fn([1.0, 2.0])


@pytest.mark.parametrize("bs", [0, 1, 3, 31, -32, 32.0])
def test_rejects_bad_block_size(bs):
    with pytest.raises(ValueError, match="block_size"):
        quantize_mxfp4(torch.ones(4, 64), block_size=bs)


def test_rejects_unknown_rule_and_rounding():
    with pytest.raises(ValueError) as e:
        quantize_mxfp4(torch.ones(32), scale_rule="even")
    assert all(r in str(e.value) for r in SCALE_RULES)
    for fn in (quantize_mxfp4, quantize_nvfp4):
        with pytest.raises(ValueError, match="'nearest' or 'stochastic'"):
            fn(torch.ones(32), rounding="up")
    with pytest.raises(ValueError, match="mxfp4.*nvfp4"):
        quantize(torch.ones(32), "mxfp8")


# ---------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 128), (48, 80), (40, 50)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_nvfp4_2d_tiles_make_w_and_wt_identical(shape, gen):
    w = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-4, 5, (shape[0], 1), generator=gen).float())
    row = quantize_nvfp4(w, axis=1, tile_2d=True).dequantize()
    col = quantize_nvfp4(w.t().contiguous(), axis=1, tile_2d=True).dequantize().t()
    assert torch.equal(row, col)
    # the property is the point of 2-D tiles: 1-D blocks do not have it
    row1d = quantize_nvfp4(w, axis=1).dequantize()
    col1d = quantize_nvfp4(w.t().contiguous(), axis=1).dequantize().t()
    assert not torch.equal(row1d, col1d)


def test_nvfp4_tile_scales_repeat_per_tile(gen):
    w = torch.randn(40, 64, generator=gen)
    q = quantize_nvfp4(w, tile_2d=True)
    s = q.scales.float()
    assert s.shape == (40, 4)
    for t0 in range(0, 40, 16):
        tile = s[t0 : t0 + 16]
        assert (tile == tile[0]).all()
    # tile (0, 0)'s scale is that of its 16×16 amax
    s_g = q.global_scale
    want = (w[:16, :16].abs().max() / 6 / s_g).to(torch.float8_e4m3fn).float()
    assert s[0, 0] == want


def test_nvfp4_tile_2d_needs_2d():
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4(torch.randn(2, 16, 16), tile_2d=True)
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4(torch.randn(32), tile_2d=True)


@pytest.mark.parametrize("tile_2d", [False, True])
def test_nvfp4_gaussian_error(tile_2d, gen):
    x = torch.randn(64, 256, generator=gen)
    rel = ((quantize_nvfp4(x, tile_2d=tile_2d).dequantize() - x).norm() / x.norm()).item()
    assert rel < 0.12, f"NVFP4 relative error {rel:.4f} is too high"


def test_nvfp4_scales_follow_the_recipe(gen):
    x = torch.randn(32, 80, generator=gen) * torch.exp2(torch.randint(-5, 6, (32, 1), generator=gen).float())
    q = quantize_nvfp4(x)
    # tensor scale: amax / (448 · 6)
    assert q.global_scale.dtype == F32 and q.global_scale.ndim == 0
    assert q.global_scale.item() == (x.abs().max() / 2688.0).item()
    # block scales are valid E4M3 values, RN of amax_block / 6 / s_global
    assert q.scales.dtype == torch.float8_e4m3fn
    s = q.scales.float()
    assert torch.isfinite(s).all() and (s >= 0).all() and (s <= 448).all()
    assert torch.equal(s.to(torch.float8_e4m3fn).view(torch.uint8), q.scales.view(torch.uint8))
    amax_b = x.reshape(32, 5, 16).abs().amax(dim=-1)
    assert torch.equal(s, (amax_b / 6 / q.global_scale).to(torch.float8_e4m3fn).float())
    # values are E2M1 · s_block · s_global
    dec = (s * q.global_scale).double().repeat_interleave(16, dim=-1)
    assert on_e2m1_grid(q.dequantize().double() / dec, rtol=1e-6).all()
    # the tensor max maps to 6 · 448 · s_global ≈ amax
    i = x.abs().argmax()
    assert q.dequantize().flatten()[i].abs().item() == pytest.approx(x.abs().max().item(), rel=1e-6)
    assert q.nbytes == q.codes.numel() + q.scales.numel() + 4


def test_nvfp4_sr_rounds_scale_up_so_nothing_clips(gen):
    x = torch.randn(256, 64, generator=gen)
    q = quantize_nvfp4(x, rounding="stochastic", generator=gen)
    dec = (q.scales.float() * q.global_scale).double().repeat_interleave(16, dim=-1)
    assert ((x.double().abs() / dec) <= 6 * (1 + 1e-6)).all()
    amax_b = x.reshape(256, 4, 16).abs().amax(dim=-1)
    exact = amax_b / 6 / q.global_scale
    assert (q.scales.float() >= exact * (1 - 1e-6)).all()
    # round-to-nearest does clip some block maxima (baselines §1.7): the SR path is different
    rn = quantize_nvfp4(x)
    dec_rn = (rn.scales.float() * rn.global_scale).double().repeat_interleave(16, dim=-1)
    assert ((x.double().abs() / dec_rn) > 6 * (1 + 1e-6)).any()


@pytest.mark.parametrize("fn", ["quantize_mxfp4", "quantize_nvfp4"])
def test_a_tensor_without_elements_is_named_not_a_reshape_error(fn):
    """(0, 64) used to fail inside a reshape ("cannot reshape tensor of 0 elements")."""
    import adahop.formats as formats

    with pytest.raises(ValueError, match=r"shape \(0, 64\) has no elements; nothing to quantize"):
        getattr(formats, fn)(torch.zeros(0, 64))


def test_the_old_name_ceil_is_refused_naming_rceil():
    """'ceil' named RCEIL, 2^ceil(log2(amax/6)), where specs/baselines.md §1.4 calls CEIL another rule,
    2^(ceil(log2 amax) - 2) (a probe read it against the spec's CEIL column); it is 'rceil' now."""
    x = torch.tensor([[1.5] + [0.0] * 31])
    with pytest.raises(ValueError, match="scale_rule='ceil' is now 'rceil'"):
        quantize_mxfp4(x, scale_rule="ceil")
    # RCEIL at amax 1.5: 2^ceil(log2 0.25) = 2^-2, the block max decodes to 6·2^-2 = 1.5 (CEIL would give 2^-1)
    assert quantize_mxfp4(x, scale_rule="rceil").scales[0, 0].item() == 127 - 2
