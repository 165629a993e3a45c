"""Two per-GEMM recipe fields (issue 18): the fast path's accumulation (once an environment
variable) and the rule that runs GEMMs too small for the fast path in BF16."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import adahop
from adahop.nn import LowPrecisionLinear, get_controller, small_gemm_count
from adahop.recipes import GEMMS, SmallGemmRule, get_recipe


# ----------------------------------------------------------------------------- accumulation


def test_accumulation_is_a_validated_recipe_field():
    r = get_recipe("mxfp4")
    assert r.accumulations == {g: "fp8-mma" for g in GEMMS}
    assert r.with_accumulation("fp32").accumulations == {g: "fp32" for g in GEMMS}
    with pytest.raises(ValueError, match="accumulation='fp16'"):
        r.with_accumulation("fp16")
    import dataclasses

    with pytest.raises(ValueError, match="dgrad: accumulation='tf32'"):
        dataclasses.replace(r, dgrad=dataclasses.replace(r.dgrad, accumulation="tf32"))


def test_the_recipe_accumulation_reaches_every_gemm(monkeypatch):
    """Each of the three GEMMs calls the MXFP4 GEMM with its spec's accumulation."""
    import adahop.kernels as kernels

    seen = []
    real = kernels.mx_matmul

    def spy(qa, qb, **kw):
        seen.append(kw["accumulation"])
        return real(qa, qb, **kw)

    monkeypatch.setattr(kernels, "mx_matmul", spy)
    for acc in ("fp32", "fp8-mma"):
        seen.clear()
        model = nn.Sequential(nn.Linear(64, 64, bias=False))
        adahop.convert_model(model, get_recipe("mxfp4").with_accumulation(acc), exclude=())
        model(torch.randn(32, 64, requires_grad=True)).sum().backward()
        assert seen == [acc] * 3
        # a CPU model runs the FP32 reference, and describe says so beside the recipe's fast-path accumulation
        assert adahop.describe(model).splitlines()[0].endswith(
            f"fast-path accumulation {acc} (on CUDA; here the reference sums in FP32)")


def test_the_environment_variable_is_an_error_naming_the_option(monkeypatch):
    monkeypatch.setenv("ADAHOP_GEMM_ACCUMULATION", "fp32")
    with pytest.raises(ValueError, match=r"with_accumulation\('fp32'\)"):
        adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "mxfp4", exclude=())


def test_mx_matmul_ignores_the_environment(monkeypatch):
    """The default is fixed in the signature: no environment lookup can change a GEMM's numbers."""
    import inspect

    from adahop.kernels import mx_matmul

    assert inspect.signature(mx_matmul).parameters["accumulation"].default == "fp8-mma"


# ----------------------------------------------------------------------------- small GEMMs


def test_the_rule_routes_shapes_per_gemm():
    rule = SmallGemmRule()  # K·N < 2048², or outer dim < 1024
    assert rule.bf16_gemms(768, 2048) == GEMMS  # llama-125m gate/up: K·N = 1.6M
    assert rule.bf16_gemms(2048, 512) == GEMMS  # Llama-3.2-1B k/v_proj
    assert rule.bf16_gemms(2048, 2048) == ()  # Llama-3.2-1B q/o_proj: K·N = 2048², not below
    assert rule.bf16_gemms(4096, 1024) == ()  # Llama-3.1-8B k/v_proj
    # 8192 -> 512: fprop's outer dim is N = 512, dgrad's K = 8192, wgrad's min(K, N) = 512
    assert rule.bf16_gemms(8192, 512) == ("fprop", "wgrad")
    assert rule.bf16_gemms(512, 8192) == ("dgrad", "wgrad")
    assert SmallGemmRule(min_kn=0, min_outer=0).bf16_gemms(32, 32) == ()
    with pytest.raises(ValueError, match="min_outer=-1"):
        get_recipe("mxfp4").with_small_gemms_bf16(SmallGemmRule(min_outer=-1))


def test_presets_run_every_gemm_in_low_precision():
    """Off by default: a preset's numerics never depend on the width of the model."""
    assert all(get_recipe(n).bf16_small_gemms is None for n in adahop.list_recipes())


def _pair(recipe, rule, k=64, n=128, bias=True):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(k, n, bias=bias))
    conv = nn.Sequential(nn.Linear(k, n, bias=bias))
    conv.load_state_dict(ref.state_dict())
    adahop.convert_model(conv, get_recipe(recipe).with_small_gemms_bf16(rule), exclude=())
    return ref, conv


def _grads(model, x, dy):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return y, x.grad, model[0].weight.grad


def test_a_layer_small_in_every_gemm_is_exactly_nn_linear():
    with pytest.warns(UserWarning, match="every GEMM of the model's 1 linear layers is too small"):
        ref, conv = _pair("mxfp4", SmallGemmRule(min_kn=64 * 128 + 1, min_outer=0))
    layer = conv[0]
    assert isinstance(layer, LowPrecisionLinear) and layer.small_bf16 == GEMMS and layer.force_bf16
    x, dy = torch.randn(32, 64), torch.randn(32, 128)
    for a, b in zip(_grads(ref, x, dy), _grads(conv, x, dy)):
        assert torch.equal(a, b)
    assert small_gemm_count(conv) == 3
    text = adahop.describe(conv)
    assert text.count("bf16 (small)") == 3 and any(line.startswith("3 of 3 GEMMs run BF16") for line in text.splitlines())


def test_a_filtered_gemm_equals_the_bf16_path_and_the_others_stay_quantized():
    """64 -> 2048 with min_outer 1024: dgrad (outer K = 64) and wgrad (min = 64) run BF16, fprop
    (outer N = 2048) stays MXFP4. dX and dW equal nn.Linear's bit for bit (their GEMMs are the BF16
    ones; dY is the same), Y is MXFP4's."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # some GEMMs stay quantized: no warning that the model trains as BF16
        ref, conv = _pair("mxfp4", SmallGemmRule(min_kn=0, min_outer=1024), k=64, n=2048, bias=False)
    layer = conv[0]
    assert layer.small_bf16 == ("dgrad", "wgrad") and not layer.force_bf16
    assert layer.strategies() == {"fprop": "none", "dgrad": "bf16", "wgrad": "bf16"}
    x, dy = torch.randn(32, 64), torch.randn(32, 2048)
    (y0, dx0, dw0), (y1, dx1, dw1) = _grads(ref, x, dy), _grads(conv, x, dy)
    assert torch.equal(dx0, dx1) and torch.equal(dw0, dw1)
    assert not torch.equal(y0, y1) and torch.nn.functional.cosine_similarity(y0.flatten(), y1.flatten(), dim=0) > 0.98
    assert small_gemm_count(conv) == 2


def test_calibrated_recipes_apply_the_rule_after_the_plan():
    """AdaHOP: the plan gives each GEMM its strategy, the rule then sends the small ones to BF16."""
    model = nn.Sequential(nn.Linear(64, 2048, bias=False), nn.ReLU(), nn.Linear(2048, 64, bias=False))
    adahop.convert_model(model, get_recipe("adahop-lv2").with_small_gemms_bf16(SmallGemmRule(min_kn=0, min_outer=1024)),
                         exclude=())
    ctrl = get_controller(model)
    for step in range(ctrl.recipe.calibration.steps):
        model(torch.randn(64, 64, requires_grad=True)).sum().backward()
        adahop.on_step(model, step + 1)
    up, down = model[0], model[2]
    assert up.strategies()["dgrad"] == up.strategies()["wgrad"] == "bf16" and up.strategies()["fprop"] != "bf16"
    assert down.strategies()["fprop"] == down.strategies()["wgrad"] == "bf16" and down.strategies()["dgrad"] != "bf16"
    assert small_gemm_count(model) == 4


def test_mxfp4_only_options_with_nvfp4_and_a_recipe_only_strategy_are_refused():
    """lowp_matmul(fmt='nvfp4', scale_rule='tseng', max_scale_range=0) gave the plain NVFP4 result: the options
    were dropped unread; strategy='oe' was answered with a list that named 'calibrated', which lowp_matmul then
    refused too (helper 31)."""
    import adahop

    a, b = torch.randn(16, 64), torch.randn(64, 8)
    with pytest.raises(ValueError, match="scale_rule='tseng', max_scale_range=0 with fmt='nvfp4': both are MXFP4 options"):
        adahop.lowp_matmul(a, b, strategy="none", fmt="nvfp4", scale_rule="tseng", max_scale_range=0)
    adahop.lowp_matmul(a, b, strategy="none", fmt="nvfp4")  # the defaults stay accepted
    with pytest.raises(ValueError, match=r"strategy='oe'; pass one of \('bf16', 'none', 'iht', 'iht\+oe_left', "
                                         r"'iht\+oe_right'\)$"):
        adahop.lowp_matmul(a, b, strategy="oe")
    with pytest.raises(ValueError, match="'calibrated' is a recipe's GEMM"):
        adahop.lowp_matmul(a, b, strategy="calibrated")
