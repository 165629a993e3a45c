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
