"""`adahop bench model` harness on the CPU: the rows, the ratios, the strategy counts (the GPU
timings themselves live in docs/benchmarks.md, never in tests)."""

from __future__ import annotations

import math

import pytest

from adahop.bench import bench_model


def test_bench_model_rows_on_cpu():
    rows = bench_model("llama-tiny", recipes=("bf16", "adahop-lv2", "nope"), seq_len=32, batch=2, steps=1,
                       modes=("eager",), device="cpu")
    assert [r["recipe"] for r in rows] == ["bf16", "adahop-lv2", "nope"]
    bf16, lv2, bad = rows
    assert bf16["vs_bf16"] == 1.0 and bf16["strategies"] == ""  # plain nn.Linear: nothing converted
    assert lv2["tok_per_s"] > 0 and math.isclose(lv2["vs_bf16"], lv2["tok_per_s"] / bf16["tok_per_s"])
    assert all(r["warmup_s"] > 0 for r in (lv2, bf16))
    # 2 calibration steps, then the frozen plan: every GEMM of the 14 linears got a strategy
    counts = dict(part.rsplit(" ", 1) for part in lv2["strategies"].split(", "))
    assert sum(int(v) for v in counts.values()) == 42 and "calibrating" not in counts
    assert "error" in bad and "nope" in bad["error"] and bad["vs_bf16"] is None  # recorded, not raised
    # the untimed check step: every parameter got a gradient, and Lv2 computes what BF16 does, roughly
    for r in (bf16, lv2):
        assert r["params_with_grad"] == r["params"] > 0 and r["grads_ok"]
    assert math.isclose(lv2["loss"], bf16["loss"], rel_tol=0.02)
    assert math.isclose(lv2["grad_norm"], bf16["grad_norm"], rel_tol=0.25)


def test_bench_model_auto_mode_counts_breaks_and_recompiles(monkeypatch):
    """``--modes auto`` compiles in `adahop train --compile`'s final mode (the default one on the CPU)
    once Lv2's plan is frozen, and the row says so: the mode, the compiling step's time, no graph
    break and no recompile after it (dynamo only here: fast, no C++ toolchain)."""
    import torch

    real, modes = torch.compile, []

    def recording(m, **kw):
        modes.append(kw.get("mode"))
        return real(m, backend="eager")

    monkeypatch.setattr(torch, "compile", recording)
    (row,) = bench_model("llama-tiny", recipes=("adahop-lv2",), seq_len=32, batch=2, steps=1, modes=("auto",), device="cpu")
    assert "error" not in row, row
    assert modes == ["default"] and row["compile_mode"] == "default"
    assert row["compile_step_s"] > 0 and row["graph_breaks"] == 0 and row["recompiles"] == 0
    assert row["grads_ok"]


def test_bench_model_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown mode"):
        bench_model("llama-tiny", modes=("fast",), device="cpu")


def test_layer_step_runs_forward_and_backward_of_each_kind_on_cpu():
    """`bench linear`'s step: each kind's weight gradient points where BF16's does (fresh inputs
    per call of layer_step, the same seed here)."""
    import torch

    from adahop.bench import layer_step

    grads = {}
    for kind in ("bf16", "mxfp4 fast", "adahop-lv2 fast (iht, wgrad oe_right)"):
        torch.manual_seed(0)
        layer, step = layer_step(kind, 128, 64, 96, "cpu")
        step()
        grads[kind] = next(layer.parameters()).grad.flatten().float()
    for kind in ("mxfp4 fast", "adahop-lv2 fast (iht, wgrad oe_right)"):
        assert torch.nn.functional.cosine_similarity(grads[kind], grads["bf16"], dim=0) > 0.95


def _profile_model_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "profile_model.py"
    spec = importlib.util.spec_from_file_location("profile_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_model_flops_and_amdahl():
    """The step breakdown's arithmetic: training FLOPs of the converted linears and of the LM head
    (6 · params · tokens), Amdahl's end-to-end speedup and its inverse, and the kernel classes."""
    pm = _profile_model_script()
    # 4 blocks of Llama-3.1-8B: q, o 4096², k, v 4096·1024, gate, up, down 4096·14336; LM head 4096·32768
    lin, head = pm.linear_and_head_flops("llama3.1-8b", 4, 8192)
    assert lin == 6 * 4 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) * 8192
    assert head == 6 * 4096 * 32768 * 8192
    assert pm.e2e_speedup(100.0, 50.0, 2.0) == 100.0 / 75.0
    assert pm.e2e_speedup(100.0, 0.0, 5.0) == 1.0
    r = pm.linear_speedup_needed(114.6, 55.85, 1.3)
    assert abs(pm.e2e_speedup(114.6, 55.85, r) - 1.3) < 1e-12 and 1.89 < r < 1.91  # round 6's 8B-shaped figure
    assert pm.linear_speedup_needed(100.0, 10.0, 1.2) == float("inf")  # 90 of 100 stay: at most 1.11x
    assert pm.classify("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "GEMM FP8"
    assert pm.classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "GEMM BF16"
    assert pm.classify("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert pm.classify("_mx_quantize_kernel") == "quantize + fold (adahop)"
    assert pm.classify("triton_poi_fused_mul_silu_0").startswith("other")
