"""Recipe presets: GEMM placements, hand-composed references, SR unbiasedness, validation, tables.

Every layer-level test runs a converted ``nn.Linear`` (fprop output, ∇X, ∇W) on CPU. Shapes: T=64
tokens (a power of two, so HALO-2's token Hadamard fits), K=128, N=64 (multiples of 64, so
Tseng's RHT-64 needs no padding).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import replace

import pytest
import torch
from torch import nn

from adahop import convert_model, get_recipe, list_recipes, on_step
from adahop.formats import quantize_mxfp4, quantize_nvfp4
from adahop.gemm import draw_signs, gemm, multiply, prepare, without_quantization
from adahop.hadamard import block_hadamard, hadamard_matrix, random_signs
from adahop.recipes import GEMMS, GemmSpec, OperandSpec, Recipe, Transform
from adahop.recipes.table import describe_recipes, gemm_table
from adahop.utils import mix_seed

T, K, N = 64, 128, 64
RIVALS = ["tseng", "halo-0", "halo-1", "halo-2", "nvfp4", "averis", "averis-mxfp4", "quartet"]
FIXED = ["bf16", "mxfp4", "mxfp4-had", *RIVALS]  # presets whose strategies need no calibration
TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # TE get_wgrad_sign_vector()



def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b``."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def data(seed: int = 0, T: int = T, K: int = K, N: int = N) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T,K] with a per-channel mean (as LLM activations have), w [N,K], dy [T,N]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g) + torch.randn(K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    dy = torch.randn(T, N, generator=g) + 0.5 * torch.randn(N, generator=g)
    return x, w, dy


def run_layer(recipe, x, w, dy, *, seed=0, step=0, backend="reference"):
    """(y, ∇X, ∇W) of one converted bias-free linear layer (layer id 0) at ``step``."""
    model = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w)
    convert_model(model, recipe, seed=seed, backend=backend)
    on_step(model, step)
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, model[0].weight.grad


def quantization_off(recipe: Recipe) -> Recipe:
    """``recipe`` with every GEMM's quantizer switched off; transforms, splits and OE still run."""
    return replace(recipe, **{g: without_quantization(recipe.gemm(g)) for g in GEMMS})


def layer_gen(gemm_name: str, *, seed=0, step=0, layer=0, call=0) -> torch.Generator:
    """The generator a converted layer uses for one GEMM call (`adahop.nn.linear`)."""
    return torch.Generator().manual_seed(mix_seed(seed, step, layer, gemm_name, call))


# ---------------------------------------------------------------------------------------------
# presets and registry


def test_list_recipes_order():
    assert list_recipes() == ["bf16", "mxfp4", "mxfp4-had", *RIVALS, "adahop-lv1", "adahop-lv2"]


@pytest.mark.parametrize("name", RIVALS)
def test_rival_presets_are_frozen_and_replaceable(name):
    r = get_recipe(name)
    assert r.name == name and r.description
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.bf16_last_layers = 3
    assert replace(r, bf16_last_layers=3).bf16_last_layers == 3


def test_nvfp4_wgrad_signs_are_te_vector():
    signs = draw_signs(get_recipe("nvfp4").wgrad, None, "cpu")
    assert signs.tolist() == TE_SIGNS


def test_nvfp4_weight_tiles_make_fprop_and_dgrad_weights_equal():
    r = get_recipe("nvfp4")
    _, w, _ = data()
    w_fprop = prepare(w.t(), "b", r.fprop).q.dequantize()  # Wᵀ [K,N] blocked along K
    w_dgrad = prepare(w, "b", r.dgrad).q.dequantize()  # W [N,K] blocked along N
    torch.testing.assert_close(w_fprop.t(), w_dgrad, atol=0, rtol=0)


def test_nvfp4_keeps_last_block_bf16():
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64)) for _ in range(4))
    convert_model(model, "nvfp4")
    assert [model.layers[i][0].strategies()["fprop"] for i in range(4)] == ["none", "none", "none", "bf16"]


# ---------------------------------------------------------------------------------------------
# placements: with the quantizer off, every preset's GEMMs are the exact products


def _placement_cases():
    cases = [pytest.param(get_recipe(n), id=n) for n in FIXED + ["averis@mean-bf16", "averis-mxfp4@mean-bf16"]]
    for name in ("adahop-lv1", "adahop-lv2"):
        r = get_recipe(name)
        for s in ("none", "iht", "iht+oe_left", "iht+oe_right"):
            specs = {g: replace(r.gemm(g), oe_rank=8).with_strategy(s) for g in GEMMS}
            cases.append(pytest.param(replace(r, calibration=None, **specs), id=f"{name}-{s}"))
    return cases


@pytest.mark.parametrize("recipe", _placement_cases())
def test_placements_exact_without_quantization(recipe):
    x, w, dy = data()
    y, dx, dw = run_layer(quantization_off(recipe), x, w, dy)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    assert rel(y, xd @ wd.t()) <= 1e-5
    assert rel(dx, dyd @ wd) <= 1e-5
    assert rel(dw, dyd.t() @ xd) <= 1e-5


# ---------------------------------------------------------------------------------------------
# quantization on: each recipe against a reference composed by hand from formats + hadamard


def q_mx(t, axis, *, rule="floor", sr=False, gen=None):
    r = "stochastic" if sr else "nearest"
    return quantize_mxfp4(t, axis=axis, scale_rule=rule, rounding=r, generator=gen, max_scale_range=8).dequantize()


def q_nv(t, axis, *, sr=False, tile=False, gen=None):
    r = "stochastic" if sr else "nearest"
    return quantize_nvfp4(t, axis=axis, rounding=r, tile_2d=tile, generator=gen).dequantize()


def rht_backward(x, w, dy, block):
    """Tseng/Quartet backward: RHT(block) with per-call signs + SR with the 3/4 pre-scale.

    Draw order per GEMM generator: signs, then B's SR bits (in forward), then A's (backward)."""
    gw, gd = layer_gen("wgrad"), layer_gen("dgrad")
    s_w, s_d = random_signs(block, generator=gw), random_signs(block, generator=gd)

    def q(t, axis, s, gen):
        return q_mx(block_hadamard(t, block_size=block, axis=axis, signs=s), axis, rule="tseng", sr=True, gen=gen)

    x_q = q(x, 0, s_w, gw)  # X [T,K] along T, for wgrad
    w_q = q(w, 0, s_d, gd)  # W [N,K] along N, for dgrad
    dx = q(dy, 1, s_d, gd) @ w_q  # ∇X = Q(∇Y·D·H)·Q(H·D·W)
    dw = q(dy.t(), 1, s_w, gw) @ x_q  # ∇W = Q(∇Yᵀ·D·H)·Q(H·D·X)
    return dx, dw


def ref_tseng(x, w, dy):
    return (x @ w.t(), *rht_backward(x, w, dy, 64))


def ref_quartet(x, w, dy):
    def q(t, axis):  # fixed H32 (no signs), RTN, OCP floor
        return q_mx(block_hadamard(t, block_size=32, axis=axis), axis)

    return (q(x, 1) @ q(w.t(), 0), *rht_backward(x, w, dy, 32))


def ref_halo(level):
    def ref(x, w, dy):
        if level == 0:
            return q_mx(x, 1) @ q_mx(w.t(), 0), q_mx(dy, 1) @ q_mx(w, 0), q_mx(dy.t(), 1) @ q_mx(x, 0)
        h, h_t = hadamard_matrix(x.shape[1]), hadamard_matrix(x.shape[0])  # symmetric: Hᵀ = H
        y = q_mx(x @ h, 1) @ q_mx((w @ h).t(), 0)  # Q(XH)·Q(WH)ᵀ
        g = h_t @ dy if level == 2 else dy
        dx = (q_mx(g, 1) @ q_mx(w @ h, 0)) @ h  # [Q(G)·Q(WH)]·Hᵀ
        if level == 2:
            dx = h_t @ dx  # undo the token rotation
        dw = (q_mx(dy.t(), 1) @ q_mx(x @ h, 0)) @ h  # [Q(Gᵀ)·Q(XH)]·Hᵀ
        return y, dx, dw

    return ref


def ref_nvfp4(x, w, dy):
    s = torch.tensor(TE_SIGNS, dtype=torch.float32)
    y = q_nv(x, 1) @ q_nv(w.t(), 0, tile=True)
    dx = q_nv(dy, 1, sr=True, gen=layer_gen("dgrad")) @ q_nv(w, 0, tile=True)
    gw = layer_gen("wgrad")
    x_q = q_nv(block_hadamard(x, block_size=16, axis=0, signs=s), 0)  # X: RHT16 along T, RNE
    dw = q_nv(block_hadamard(dy.t(), block_size=16, axis=1, signs=s), 1, sr=True, gen=gw) @ x_q
    return y, dx, dw


def ref_averis(fmt, mean_bf16=False):
    def q(t, axis, gen, tile=False):
        if fmt == "nvfp4":
            return q_nv(t, axis, sr=True, tile=tile, gen=gen)
        return q_mx(t, axis, rule="rceil", sr=True, gen=gen)

    def mean(t, dim):  # the token mean; with mean_bf16 rounded to BF16 before R = t - mean is formed
        mu = t.mean(dim)
        return mu.to(torch.bfloat16).float() if mean_bf16 else mu

    def q_mean(mu, gen):  # the mean vector: FP4 on its own, or (mean_bf16) the BF16 one as it is
        return mu if mean_bf16 else q(mu, -1, gen)

    def rows_split(a, b_q_fn, gen):  # Eq. 11: Q(R)·Q(B) + 1·(Q(μ)·Q(B)); the mean rides as A's last row
        mu = mean(a, 0)[None]
        if mean_bf16:  # the BF16 mean times Q(B), broadcast over the rows
            return q(a - mu, 1, gen) @ (b := b_q_fn()) + mu @ b
        a_q = q(torch.cat((a - mu, mu)), 1, gen)
        c = a_q @ b_q_fn()
        return c[:-1] + c[-1:]

    def ref(x, w, dy):
        gf, gw, gd = layer_gen("fprop"), layer_gen("wgrad"), layer_gen("dgrad")
        y = rows_split(x, lambda: q(w.t(), 0, gf, tile=True), gf)
        # forward: X split for wgrad (residual, then its mean), W for dgrad
        mu_x = mean(x, 0)
        r_x = q(x - mu_x, 0, gw)
        mu_x = q_mean(mu_x, gw)
        w_q = q(w, 0, gd, tile=True)
        dx = rows_split(dy, lambda: w_q, gd)
        a = dy.t()  # [N,T]
        mu_d = mean(a, 1)
        r_d = q(a - mu_d[:, None], 1, gw)
        mu_d = q_mean(mu_d, gw)
        # Eq. 12, all four terms
        dw = r_d @ r_x + T * torch.outer(mu_d, mu_x) + torch.outer(r_d.sum(1), mu_x) + torch.outer(mu_d, r_x.sum(0))
        return y, dx, dw

    return ref


REFERENCES = {
    "tseng": ref_tseng,
    "halo-0": ref_halo(0),
    "halo-1": ref_halo(1),
    "halo-2": ref_halo(2),
    "nvfp4": ref_nvfp4,
    "averis": ref_averis("nvfp4"),
    "averis-mxfp4": ref_averis("mxfp4"),
    "quartet": ref_quartet,
    "averis@mean-bf16": ref_averis("nvfp4", mean_bf16=True),
}


@pytest.mark.parametrize("name", RIVALS + ["averis@mean-bf16"])
def test_recipe_matches_hand_composed_reference(name):
    x, w, dy = data()
    y, dx, dw = run_layer(get_recipe(name), x, w, dy)
    y_ref, dx_ref, dw_ref = REFERENCES[name](x, w, dy)
    assert rel(y, y_ref) <= 1e-5, f"fprop rel err {rel(y, y_ref):.2e}"
    assert rel(dx, dx_ref) <= 1e-5, f"dgrad rel err {rel(dx, dx_ref):.2e}"
    assert rel(dw, dw_ref) <= 1e-5, f"wgrad rel err {rel(dw, dw_ref):.2e}"
    exact = (x @ w.t(), dy @ w, dy.t() @ x)
    assert all(rel(a, e) > 1e-3 for a, e in zip((dx, dw), exact[1:])), "the backward was not quantized"


@pytest.mark.parametrize("name", ["nvfp4", "averis", "averis@mean-bf16"])
def test_nvfp4_fast_gemm_matches_hand_composed_reference(name, monkeypatch):
    """The NVFP4 GEMM on BF16 operands (backend "triton": its CPU emulation under TRITON_INTERPRET=1)
    against the same hand-composed references: it changes no operand, only how the sums are formed.
    (The quantizer's reference twin stands in for its Triton kernel, so the SR draws are the
    references'; tests/test_nvfp4_quantize.py checks the kernel.)"""
    import adahop.kernels.quantize_nvfp4 as qn

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(qn, "iht_quantize_nvfp4_triton", qn.iht_quantize_nvfp4_reference)
    x, w, dy = data(1)
    got = run_layer(get_recipe(name), x, w, dy, backend="triton")
    for what, a, b in zip(("fprop", "dgrad", "wgrad"), got, REFERENCES[name](x, w, dy)):
        assert rel(a, b) <= 1e-5, f"{name} {what} rel err {rel(a, b):.2e}"


@pytest.mark.parametrize("name", ["halo-1", "halo-2"])
def test_halo_at_512_features_and_tokens(name):
    """HALO's whole-dimension Hadamards above 256 (the Kronecker form) at 512 features and tokens:
    without quantization every placement is undone exactly; quantized, the layer is the
    hand-composed reference up to a few E2M1 rounding flips (the transforms round differently in
    FP32, and a value at a rounding midpoint then lands on the other grid point: one flipped element
    of W·H moves dX by ~1e-3; a wrong transform moves it by ~1e-1)."""
    x, w, dy = data(1, 512, 512, 64)
    y, dx, dw = run_layer(quantization_off(get_recipe(name)), x, w, dy)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    assert max(rel(y, xd @ wd.t()), rel(dx, dyd @ wd), rel(dw, dyd.t() @ xd)) <= 1e-5
    got = run_layer(get_recipe(name), x, w, dy)
    for what, a, b in zip(("fprop", "dgrad", "wgrad"), got, REFERENCES[name](x, w, dy)):
        assert rel(a, b) <= 5e-3, f"{name} {what} rel err {rel(a, b):.2e}"


SR_RECIPES = ["tseng", "nvfp4", "averis", "averis-mxfp4", "quartet"]


@pytest.mark.parametrize("name", SR_RECIPES)
def test_sr_reproducible_and_fresh(name):
    x, w, dy = data()
    r = get_recipe(name)
    _, dx0, dw0 = run_layer(r, x, w, dy, seed=1, step=5)
    _, dx1, dw1 = run_layer(r, x, w, dy, seed=1, step=5)
    torch.testing.assert_close(dw0, dw1, atol=0, rtol=0)
    torch.testing.assert_close(dx0, dx1, atol=0, rtol=0)
    for kw in (dict(seed=2, step=5), dict(seed=1, step=6)):
        _, dx2, dw2 = run_layer(r, x, w, dy, **kw)
        assert not torch.equal(dw0, dw2) and not torch.equal(dx0, dx2), kw
    model = nn.Sequential(nn.Linear(K, N), nn.Linear(N, N))
    convert_model(model, r, seed=1)
    assert model[0].generator("wgrad").initial_seed() != model[1].generator("wgrad").initial_seed()


# ---------------------------------------------------------------------------------------------
# stochastic rounding is unbiased


def lowrank(rows, cols, g, noise=0.3):
    """A rank-one signal plus noise: gradients and activations are dominated by a few directions,
    and a coherent product lets 1% be resolved with a few hundred draws."""
    signal = torch.randn(rows, 1, generator=g) @ torch.randn(1, cols, generator=g)
    return signal + noise * torch.randn(rows, cols, generator=g)


def test_tseng_dw_unbiased_on_mlp():
    """Tseng's fprop is BF16, so E[∇W] is the exact ∇W of both layers (through ReLU).

    512 draws: the first layer's gradient passes through layer 2's dgrad, whose weight
    quantization noise is shared by all tokens and does not average over T; with 256 draws its
    mean sits at ≈1% (0.6–0.8% with 512)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False))
    ref = copy.deepcopy(mlp)
    x = lowrank(T, 64, g)
    target = x @ torch.randn(64, 64, generator=g) / 8

    def loss(m):
        return 0.5 * ((m(x) - target) ** 2).sum()

    loss(ref).backward()
    convert_model(mlp, "tseng", seed=0)
    draws = 512
    mean = [torch.zeros(64, 64), torch.zeros(64, 64)]
    for i in range(draws):
        on_step(mlp, i)
        mlp.zero_grad()
        loss(mlp).backward()
        if i == 0:
            single = [rel(mlp[j].weight.grad, ref[j].weight.grad) for j in (0, 2)]
        mean[0] += mlp[0].weight.grad / draws
        mean[1] += mlp[2].weight.grad / draws
    for j, m in zip((0, 2), mean):
        err = rel(m, ref[j].weight.grad)
        assert err <= 0.01, f"layer {j}: mean of {draws} draws is {err:.4f} from the BF16 dW"
        assert err < single[j // 2] / 4, f"layer {j}: averaging did not help ({err:.4f} vs {single[j // 2]:.4f})"


@pytest.mark.parametrize("name", ["nvfp4", "averis", "averis-mxfp4", "quartet"])
def test_wgrad_unbiased_given_inputs(name):
    """The forward of these recipes is quantized, so the check is on the wgrad GEMM with fixed
    ∇Y and X: the mean of 256 draws equals the product with the SR operands exact and the RNE
    operands (nvfp4's X) at their deterministic quantized values."""
    g = torch.Generator().manual_seed(0)
    x = lowrank(T, 64, g)
    dy = x @ torch.randn(64, 64, generator=g) / 8 + 0.3 * torch.randn(T, 64, generator=g)
    spec = get_recipe(name).wgrad
    exact_sr = OperandSpec(fmt="none")
    expect_spec = replace(spec, a=exact_sr if spec.a.rounding == "stochastic" else spec.a,
                          b=exact_sr if spec.b.rounding == "stochastic" else spec.b)
    expect = gemm(dy.t(), x, expect_spec)
    draws = [gemm(dy.t(), x, spec, generator=torch.Generator().manual_seed(i)) for i in range(256)]
    err = rel(torch.stack(draws).mean(0), expect)
    assert err <= 0.01, f"{name}: mean of 256 wgrad draws is {err:.4f} from the expectation"
    assert not torch.equal(draws[0], draws[1])
    assert err < rel(draws[0], expect) / 4


# ---------------------------------------------------------------------------------------------
# invalid things raise ValueError naming the field


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Recipe(name="x", fprop=GemmSpec(strategy="calibrated")), "calibration"),
        (lambda: GemmSpec(inner=Transform(block_size=48)).validate("g"), "block_size"),
        (lambda: GemmSpec(outer_a=Transform(block_size=0, signs="per_call")).validate("g"), "outer_a signs"),
        (lambda: OperandSpec(rounding="stochastic", scale_rule="floor").validate("a"), "scale_rule"),
        (lambda: OperandSpec(fmt="mxfp4", tile_2d=True).validate("a"), "tile_2d"),
        (lambda: GemmSpec(mean_split="tokens").validate("g"), "mean_split"),
        # the rank-one mean terms are formed untransformed: with a Hadamard along Kc (or, for the
        # BF16 mean, along B's columns) they came out wrong by ~1.3 relative (quantizer off)
        (lambda: GemmSpec(strategy="iht", mean_split="a_rows", mean_bf16=True).validate("g"), "mean_bf16.*inner transform"),
        (lambda: GemmSpec(mean_split="a_rows", mean_bf16=True, outer_b=Transform(block_size=8)).validate("g"), "outer_b"),
        (lambda: GemmSpec(strategy="iht", mean_split="inner").validate("g"), "mean_split='inner'.*inner transform"),
        (lambda: Recipe(name="x", bf16_last_layers=-1), "bf16_last_layers"),
        (lambda: get_recipe("halo-3"), "halo-2"),
    ],
)
def test_invalid_raises_naming_field(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_halo2_token_count_not_power_of_two():
    x, w, dy = data()
    with pytest.raises(ValueError, match=r"power of two") as e:
        run_layer(get_recipe("halo-2"), x[:48], w, dy[:48])
    assert "batch_size*seq_len" in str(e.value)


def test_halo1_layer_whose_in_features_is_not_a_power_of_two_stays_bf16():
    # HALO rotates X and W over all of in_features; convert_model leaves such a layer in BF16 with
    # a warning instead of failing in the middle of a backward pass
    # (beside a layer that runs HALO: a model where no layer can is refused, it would pass for a HALO one)
    x, w, dy = data()
    model = nn.Sequential(nn.Linear(96, w.shape[0], bias=False), nn.Linear(w.shape[0], w.shape[0], bias=False))
    with pytest.warns(UserWarning, match=r"power of two.*: 0 \(96->"):
        convert_model(model, get_recipe("halo-1"))
    assert model[0].force_bf16 and not model[1].force_bf16
    with torch.no_grad():
        model[0].weight.copy_(w[:, :96])
    xg = x[:, :96].clone().requires_grad_(True)
    model[0](xg).backward(dy)
    ref = run_layer(get_recipe("bf16"), x[:, :96], w[:, :96], dy)
    assert torch.equal(model[0](x[:, :96]).detach(), ref[0]) and torch.equal(xg.grad, ref[1])
    assert torch.equal(model[0].weight.grad, ref[2])
    with pytest.warns(UserWarning, match="power of two"), pytest.raises(ValueError, match="none of the model's 1 linear"):
        run_layer(get_recipe("halo-1"), x[:, :96], w[:, :96], dy)


def test_engine_names_the_fix_when_an_outer_hadamard_does_not_fit():
    from adahop.gemm import gemm

    spec = get_recipe("halo-1").dgrad
    with pytest.raises(ValueError, match=r"in_features: it must be a power of two"):
        gemm(torch.randn(8, 64), torch.randn(64, 96), spec)


# ---------------------------------------------------------------------------------------------
# tables


def test_describe_recipes_lists_every_preset():
    text = describe_recipes()
    for name in list_recipes():
        assert f"\n{name}: " in f"\n{text}", name
    for g in GEMMS:
        assert g in text


def test_adahop_recipes_names_shows_those_recipes_variants_included(capsys):
    # a variant's GEMM table was shown only by starting a training run (new-user probe)
    from adahop.cli import main

    assert main(["recipes", "mxfp4-had@only-wgrad", "adahop-lv2@foid"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mxfp4-had@only-wgrad: ") and "\nadahop-lv2@foid: " in out and "\nmxfp4: " not in out
    assert "dgrad  bf16" in out and "FOID first 64" in out
    assert main(["recipes", "mxfp4@foid"]) == 2
    assert "'foid' needs a recipe with Outlier Extraction" in capsys.readouterr().err


def test_gemm_table_shows_each_operand():
    table = gemm_table(get_recipe("halo-2"))
    assert table.count("\n") >= 7  # header, rule, two rows per GEMM
    assert "H_T full on T, undone on output" in table and "H_K full on K" in table
    nv = gemm_table(get_recipe("nvfp4"))
    assert "nvfp4 16x16" in nv and "fixed signs" in nv and "last 1" in nv
    # the iht table extracts no outliers: its table must not promise OE (it showed "OE k=64")
    iht = gemm_table(get_recipe("mxfp4-had@bf16-calib"))
    assert iht.count("calibrated (all IHT)") == 3 and "OE k=" not in iht
    assert gemm_table(get_recipe("adahop-lv2")).count("calibrated (OE k=64)") == 3


# ---- ablation variants (BASE@VARIANT) --------------------------------------------------------


@pytest.mark.parametrize("base", ["mxfp4", "mxfp4-had", "adahop-lv2"])
@pytest.mark.parametrize("keep", GEMMS)
def test_only_one_gemm_quantized_variant(base, keep):
    """``BASE@only-G``: G keeps the base's spec, the other two GEMMs run BF16; the layer's exact
    GEMMs are bit-identical to a BF16 layer's, the quantized one to the base's."""
    r, b = get_recipe(f"{base}@only-{keep}"), get_recipe(base)
    assert r.name == f"{base}@only-{keep}" and r.calibration == b.calibration
    for g in GEMMS:
        assert r.gemm(g) == (b.gemm(g) if g == keep else GemmSpec(strategy="bf16")), g
    x, w, dy = data(3)
    plan = None
    if base.startswith("adahop"):
        from adahop.patterns import Plan

        plan = Plan.from_patterns({"0": {"x": "C", "w": "N", "dy": "N"}})  # IHT, IHT, IHT+OE-Right (64 of 128)
    outs = {}
    for name in (r.name, base, "bf16"):
        m = nn.Sequential(nn.Linear(K, N, bias=False))
        with torch.no_grad():
            m[0].weight.copy_(w)
        convert_model(m, name, plan=plan if get_recipe(name).calibration else None)
        xx = x.clone().requires_grad_()
        y = m(xx)
        y.backward(dy)
        outs[name] = {"fprop": y.detach(), "dgrad": xx.grad, "wgrad": m[0].weight.grad}
    for g in GEMMS:
        assert torch.equal(outs[r.name][g], outs[base if g == keep else "bf16"][g]), g
    assert not torch.equal(outs[base][keep], outs["bf16"][keep])  # the kept GEMM is quantized


def test_msr_none_variant_and_bad_variants():
    r = get_recipe("adahop-lv2@msr-none")
    assert all(r.gemm(g).a.max_scale_range is None and r.gemm(g).b.max_scale_range is None for g in GEMMS)
    assert get_recipe("adahop-lv2").fprop.a.max_scale_range == 8  # the preset itself is untouched
    both = get_recipe("mxfp4-had@only-wgrad@msr-none")
    assert both.wgrad.a.max_scale_range is None and both.fprop.strategy == "bf16"
    # a variant that would change nothing is refused: it ran as its base under the variant's name (new-user probe)
    for name, what in (("nvfp4@msr-none", "'msr-none' needs MXFP4 operands"), ("bf16@msr-none", "'msr-none' needs"),
                       ("tseng@only-fprop", "quantizes dgrad, wgrad: it would run as the bf16 recipe.*only-dgrad, only-wgrad"),
                       ("bf16@only-wgrad", "quantizes no GEMM: it would run as the base"),
                       ("mxfp4@foid", "'foid' needs a recipe with Outlier"),
                       ("mxfp4-had@bf16-calib@foid", "'foid' needs")):
        with pytest.raises(ValueError, match=what):
            get_recipe(name)
    assert get_recipe("adahop-lv1@foid").dgrad.oe_select == "foid"
    with pytest.raises(ValueError, match="unknown recipe variant 'only-foo'"):  # named before the count check
        get_recipe("mxfp4@only-foo@only-fprop")
    with pytest.raises(ValueError, match="unknown recipe variant 'only-attn'"):
        get_recipe("mxfp4@only-attn")
    with pytest.raises(ValueError, match="at most once"):
        get_recipe("mxfp4@only-fprop@only-dgrad")
    with pytest.raises(ValueError, match="unknown recipe 'mxfp5'"):
        get_recipe("mxfp5@only-fprop")
    assert "@" not in "".join(list_recipes())  # variants are not presets


def test_saved_fp8_variant_sets_the_saved_form_and_refuses_recipes_without_a_fold():
    r = get_recipe("mxfp4@saved-fp8")
    assert r.saved_operands == "fp8" and get_recipe("mxfp4").saved_operands == "mxfp4"
    assert all(r.gemm(g) == get_recipe("mxfp4").gemm(g) for g in GEMMS)  # no GEMM's numerics change
    assert "FP8 fold" in gemm_table(r) and "FP8 fold" not in gemm_table(get_recipe("mxfp4"))
    assert get_recipe("adahop-lv2@saved-fp8").calibration == get_recipe("adahop-lv2").calibration
    for name in ("bf16@saved-fp8", "nvfp4@saved-fp8", "mxfp4@msr-none@saved-fp8", "mxfp4@only-fprop@saved-fp8"):
        with pytest.raises(ValueError, match="'saved-fp8' needs a backward GEMM whose saved operand"):
            get_recipe(name)
    with pytest.raises(ValueError, match="saved_operands='fp4'; allowed"):
        dataclasses.replace(get_recipe("mxfp4"), saved_operands="fp4")


def test_saved_fp8_refuses_recipes_it_leaves_unchanged_in_any_order():
    """@saved-fp8 is checked on the recipe every variant made: a later only-* or msr-none may leave it no
    operand with an FP8 fold."""
    for name in ("mxfp4@saved-fp8@msr-none", "mxfp4@saved-fp8@only-fprop"):
        with pytest.raises(ValueError, match="'saved-fp8' needs a backward GEMM whose saved operand"):
            get_recipe(name)
    assert get_recipe("mxfp4@saved-fp8@only-wgrad").saved_operands == "fp8"


def test_bf16_calib_variant_is_uniform_iht_after_adahops_bf16_steps(fwd_bwd):
    """``mxfp4-had@bf16-calib``: the 30 calibration steps run exact BF16 GEMMs (as AdaHOP's), then
    every GEMM is mxfp4-had's own IHT spec, bit for bit; the variant refuses recipes it cannot mean."""
    r, base = get_recipe("mxfp4-had@bf16-calib"), get_recipe("mxfp4-had")
    assert r.calibration.table == "iht" and r.calibration.steps == get_recipe("adahop-lv2").calibration.steps
    x, w, dy = data(4)

    def layer(name):
        m = nn.Sequential(nn.Linear(K, N, bias=False))
        with torch.no_grad():
            m[0].weight.copy_(w)
        convert_model(m, name, seed=0)
        return m

    def grads(m):
        return fwd_bwd(m, m[0], x, dy)

    m, ref, exact = layer(r.name), layer("mxfp4-had"), layer("bf16")
    for step in range(r.calibration.steps):
        on_step(m, step)
        got = grads(m)
        if step == 0:
            assert all(torch.equal(a, b) for a, b in zip(got, grads(exact)))  # calibrating: exact GEMMs
    on_step(m, r.calibration.steps)
    assert m[0].strategies() == {g: "iht" for g in GEMMS}
    assert m[0]._specs == {g: base.gemm(g) for g in GEMMS}
    for a, b in zip(grads(m), grads(ref)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="IHT on every GEMM it quantizes"):
        get_recipe("mxfp4@bf16-calib")
    with pytest.raises(ValueError, match="calibrates already"):
        get_recipe("adahop-lv2@bf16-calib")


def test_mean_bf16_variant_keeps_the_rank_one_terms_exact_and_refuses_recipes_without_a_split():
    """``averis@mean-bf16``: operands whose tokens are all equal (residual 0 up to the mean's float
    rounding) give the BF16 mean times the other quantized operand, where the FP4 mean misses it by
    its FP4 rounding."""
    r = get_recipe("averis@mean-bf16")
    assert all(r.gemm(g).mean_bf16 for g in GEMMS) and not get_recipe("averis").fprop.mean_bf16
    g = torch.Generator().manual_seed(0)
    mu, b = torch.randn(1, 64, generator=g).to(torch.bfloat16).float(), torch.randn(64, 48, generator=g)
    a = mu.expand(32, 64).contiguous()  # every token the (BF16) mean: the residual is exactly 0
    spec = replace(r.fprop, a=replace(r.fprop.a, rounding="nearest"), b=replace(r.fprop.b, rounding="nearest"))
    pb = prepare(b, "b", spec)
    got = multiply(prepare(a, "a", spec), pb, spec)
    want = (mu.to(torch.bfloat16).float() @ pb.q.dequantize(torch.float32)).expand(32, 48)
    assert rel(got, want) <= 1e-6
    fp4 = replace(spec, mean_bf16=False)
    assert rel(multiply(prepare(a, "a", fp4), prepare(b, "b", fp4), fp4), want) > 1e-2  # the FP4 mean's error
    with pytest.raises(ValueError, match="needs a mean split"):
        GemmSpec(mean_bf16=True).validate("g")
    with pytest.raises(ValueError, match="needs a recipe with a mean split"):
        get_recipe("nvfp4@mean-bf16")


@pytest.mark.parametrize("kw", [dict(strategy="iht"), dict(inner=Transform(block_size=64)),
                                dict(outer_b=Transform(block_size=8))], ids=["iht32", "iht64-padded", "outer_b"])
def test_mean_split_specs_the_gemm_cannot_form_are_refused_not_computed(kw):
    """A mean split under a transform the rank-one terms do not follow: ``GemmSpec.validate`` (run by
    every Recipe) refuses it. Computed, the quantizer off, ``mean_bf16`` in fprop missed A·B by ~1.3
    relative (the BF16 mean times the transformed B) and the ``inner`` split by ~0.35 (means times
    the padded Kc, sums of transformed residuals) where the exact product was due."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 48, generator=g) + 3, torch.randn(48, 40, generator=g)
    for split, bf16 in (("a_rows", True), ("inner", False), ("inner", True)):
        spec = without_quantization(GemmSpec(mean_split=split, mean_bf16=bf16, **kw))
        if split == "inner" and "outer_b" in kw:  # the token means commute with a Hadamard along N'
            spec.validate("g")
            assert bf16 or rel(gemm(a, b, spec), a @ b) <= 1e-5
            continue
        with pytest.raises(ValueError, match="transform|outer_b"):
            spec.validate("g")
    spec = without_quantization(GemmSpec(mean_split="a_rows", **kw))  # the FP4 mean rides as A's row: transformed too
    spec.validate("g")
    assert rel(gemm(a, b, spec), a @ b) <= 1e-5


def test_bf16_calib_and_only_gemm_variants_commute():
    """``mxfp4-had@only-fprop@bf16-calib`` is ``mxfp4-had@bf16-calib@only-fprop`` (the ablation's
    control of ``adahop-lv2@only-fprop``): the BF16 GEMMs stay BF16, the IHT one is calibrated.
    Before, that order was refused with "'mxfp4-had' has ['bf16', 'iht']", untrue of mxfp4-had."""
    for g in GEMMS:
        a, b = get_recipe(f"mxfp4-had@only-{g}@bf16-calib"), get_recipe(f"mxfp4-had@bf16-calib@only-{g}")
        assert all(a.gemm(h) == b.gemm(h) for h in GEMMS) and a.calibration == b.calibration
        assert {h: a.gemm(h).strategy for h in GEMMS} == {h: "calibrated" if h == g else "bf16" for h in GEMMS}
    with pytest.raises(ValueError, match="IHT on every GEMM"):
        get_recipe("bf16@bf16-calib")  # nothing quantized: nothing to calibrate


@pytest.mark.parametrize("name", ["mxfp4", "tseng", "nvfp4", "quartet", "adahop-lv2"])
def test_gradients_accumulated_over_micro_batches_are_the_sum_of_each_micro_batchs(name):
    """T-DIST (`specs/baselines.md` §5, third bullet): dW accumulated over two micro-batches equals the sum of the
    two micro-batches' dW computed apart, bit for bit, SR recipes included (their draws depend on the call, not on
    what the gradient buffer holds)."""
    import warnings

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    xs = [torch.randn(32, 64) for _ in range(2)]
    models = []
    for _ in range(2):
        m = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nvfp4: no block index in these names, its last-block BF16 rule unused
            convert_model(m, name, exclude=(), seed=3)
        on_step(m, 1)
        models.append(m)
    accumulated, apart = models
    for x in xs:
        accumulated(x).square().sum().backward()
    grads = []
    for x in xs:
        apart.zero_grad()
        apart(x).square().sum().backward()
        grads.append([p.grad.clone() for p in apart.parameters()])
    for p, a, b in zip(accumulated.parameters(), *grads):
        assert torch.equal(p.grad, a + b)


def test_a_halo_model_that_fits_no_layer_is_told_of_the_power_of_two():
    """halo-2 on a model whose dims are multiples of 32 but no power of two was told to use dims that are multiples of
    32, which they were (probe rivals): HALO-1/2 rotate in_features whole."""
    import warnings

    model = nn.Sequential(nn.Linear(96, 192), nn.Linear(192, 96))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"multiples of the recipe's block size \(32, or 16 for NVFP4\), in_features "
                                             r"a power of two \(the recipe rotates it whole\), with more blocks"):
            convert_model(model, "halo-2", exclude=())
        with pytest.raises(ValueError, match=r"\(32, or 16 for NVFP4\) with more blocks"):  # no rotation to name
            convert_model(nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 40)), "mxfp4", exclude=())
