"""Optimizers over low-precision masters (adahop.optim) and the fused step (adahop.kernels.optim_step):
the loss falls on a quadratic and on llama-tiny, pure BF16 AdamW stalls at large |w| where M+Adam
moves, stochastic rounding is unbiased and fresh per step, resume is exact, checkpoints keep each
dtype, and the Triton kernel (interpreted) equals its reference bit for bit."""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from adahop.kernels.backend import triton_available
from adahop.kernels.optim_step import (ALGORITHMS, ROUNDINGS, STATE_NAMES, bit_mismatches, bit_mismatches_multi,
                                       optim_step, optim_step_multi, optim_step_reference, round_bf16, step_scalars)
from adahop.kernels.philox import philox_randint
from adahop.optim import (AdamW, MAdam, PackedMaster, build_optimizer, convert_master_weights, memory_bytes,
                          read_master)
from adahop.utils import mix_seed

COMBOS = [("adamw", "fp32"), ("adamw", "bf16"), ("sr-adamw", "bf16"), ("kahan-adamw", "bf16"), ("m+adam", "bf16"),
          ("m+adam", "fp8"), ("m+adam", "fp4"), ("sr-adamw", "nvfp4")]


def _quadratic(name, master, steps=150, lr=3e-3, scale=1.0, **kw):
    torch.manual_seed(0)
    target = torch.randn(32, 64) * scale
    lin = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(target + 0.3 * scale * torch.randn(32, 64))
    convert_master_weights(lin, master)
    opt = build_optimizer(name, lin.parameters(), lr=lr, master=master, states="fp32" if master == "fp32" else "bf16",
                          **kw)
    losses = []
    for _ in range(steps):
        loss = ((lin.weight.to(torch.float32) - target) ** 2).mean()
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, lin


# on a quadratic the RNE rules cannot move FP4 masters (half an ulp is 25% of |w|) and NVFP4's
# rescaled E4M3 block scales re-randomize SR every step (docs/optim.md): those run on llama-tiny only
QUAD_COMBOS = COMBOS[:-2] + [("sr-adamw", "fp4"), ("kahan-adamw", "fp4")]


@pytest.mark.parametrize("name,master", QUAD_COMBOS, ids=lambda v: str(v))
def test_loss_falls_on_a_quadratic(name, master):
    # FP8/FP4 grids are coarse (half an ulp is 6% / 25% of |w|): a smaller drop is all they allow
    losses, _ = _quadratic(name, master, lr=1e-2, mul_lr_scale=3.0 if master in ("fp32", "bf16") else 10.0)
    want = 0.5 if master in ("fp32", "bf16") else 0.8
    assert losses[-1] < want * losses[0], f"{name} on {master}: {losses[0]:.4f} -> {losses[-1]:.4f}"


def _large_weights(name, master, steps=60, lr=1e-3, **kw):
    """Fit w (|w| in [2, 14]) to targets 10% away: BF16's half ulp there is >= 2^-7 = 0.0078, far
    above AdamW's steps (≈ lr = 1e-3)."""
    gen = torch.Generator().manual_seed(0)
    w0 = (torch.sign(torch.randn(32, 64, generator=gen)) * (2 + 12 * torch.rand(32, 64, generator=gen))).bfloat16()
    target = w0.float() * 1.1
    w = torch.nn.Parameter(w0.clone() if master == "bf16" else w0.float())
    opt = build_optimizer(name, [w], lr=lr, master=master, states="fp32", **kw)
    losses = []
    for _ in range(steps):
        loss = ((w.float() - target) ** 2).mean()
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, w.detach(), w0


def test_bf16_adamw_stalls_at_large_weights_and_madam_does_not():
    ad, w_ad, w0 = _large_weights("adamw", "bf16")
    assert torch.equal(w_ad, w0) and ad[-1] == ad[0], "pure BF16 AdamW moved weights it cannot move"
    fp32, _, _ = _large_weights("adamw", "fp32")
    assert fp32[-1] < 0.95 * fp32[0]  # the same steps in FP32 do move them
    mad, w_m, _ = _large_weights("m+adam", "bf16", mul_lr_scale=10.0)
    assert (w_m != w0).float().mean() > 0.9
    assert mad[-1] < 0.5 * mad[0], f"M+Adam: {mad[0]:.4f} -> {mad[-1]:.4f}"
    assert mad[-1] < fp32[-1]  # relative steps: faster than FP32 AdamW's additive ones here


def test_literal_arxiv_form_pushes_negative_weights_the_wrong_way():
    # the third-party reading w·u_e/ρ = u_e for |w| >= τ: its sign is -sign(w·g), wrong for w < 0
    s = step_scalars(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1, mul_lr=1e-2)
    w = torch.tensor([-1.0, 1.0])
    g = torch.tensor([1.0, 1.0])  # the loss falls as either weight decreases
    for alg, want in (("madam-arxiv", [1, -1]), ("madam-arxiv-relative", [-1, -1])):
        wn = w.clone()
        optim_step_reference(alg, wn, g, [torch.zeros(2) for _ in STATE_NAMES[alg]], s)
        assert torch.sign(wn - w).tolist() == want, alg


def test_sr_is_unbiased_and_fresh_per_seed():
    lo = torch.tensor(1.0, dtype=torch.bfloat16).float()
    ulp = 2.0**-7
    x = torch.full((20000,), float(lo) + 0.3 * ulp)
    draws = [round_bf16(x, "stochastic", seed).float() for seed in (1, 2)]
    for d in draws:
        assert set(d.unique().tolist()) == {float(lo), float(lo) + ulp}
        mean_err = (d - x).mean().item() / ulp  # E = 0; one draw's sd is sqrt(.3·.7) ulp
        assert abs(mean_err) < 5 * (0.21 / x.numel()) ** 0.5, mean_err
    assert not torch.equal(draws[0], draws[1])
    assert torch.equal(round_bf16(x, "stochastic", 1), draws[0])  # reproducible under a seed
    assert torch.equal(round_bf16(x, "nearest"), torch.full_like(x, float(lo)).bfloat16())


def test_sr_adamw_steps_are_unbiased_and_fresh_per_step():
    # a step of 0.1 ulp everywhere: RNE drops it, SR moves ~10% of the weights by one ulp per step
    w = torch.nn.Parameter(torch.ones(20000, dtype=torch.bfloat16))
    opt = build_optimizer("sr-adamw", [w], lr=2.0**-7 * 0.1, betas=(0.0, 0.0), master="bf16")
    moved = []
    for _ in range(2):
        before = w.detach().clone()
        w.grad = -torch.ones_like(w)  # Adam's normalized step is exactly +lr
        opt.step()
        moved.append(w.detach() != before)
    frac = [m.float().mean().item() for m in moved]
    assert all(abs(f - 0.1) < 0.015 for f in frac), frac
    assert not torch.equal(moved[0], moved[1])


# seed pairs that must draw independent SR bits: another seed, one bit of the key's high half, the next seed
SEED_PAIRS = [(7, 8), (2**40 + 5, 5), (mix_seed(0, "optim", 1), mix_seed(0, "optim", 2))]


def _tie_disagreement(backend, seed_a, seed_b, stream_a=0, stream_b=0, n=8192):
    """Fraction of exact ties (1 + half a BF16 ulp) that two (seed, stream) draws round differently,
    through the fused step (AdamW, betas 0, step = +half an ulp): 1/2 for independent bits."""
    s = step_scalars(lr=2.0**-8, beta1=0.0, beta2=0.0, eps=1e-30, weight_decay=0.0, step=1)
    ws = [torch.ones(n, dtype=torch.bfloat16) for _ in range(2)]
    g = -torch.ones(n)
    for w, seed, stream in ((ws[0], seed_a, stream_a), (ws[1], seed_b, stream_b)):
        optim_step("adamw", w, g, [torch.zeros(n), torch.zeros(n)], s, rounding="stochastic", seed=seed, stream=stream,
                   backend=backend)
        assert set(w.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
        assert abs((w.float() > 1).float().mean().item() - 0.5) < 5 * (0.25 / n) ** 0.5
    return (ws[0] != ws[1]).float().mean().item()


@pytest.mark.parametrize("pair", SEED_PAIRS, ids=["next", "high-half", "steps"])
def test_sr_decisions_are_independent_across_seeds(pair):
    # half of the ties differ (5 sd: 0.028); a seed that barely entered the stream would give ~0
    assert abs(_tie_disagreement("reference", *pair) - 0.5) < 0.028
    assert _tie_disagreement("reference", pair[0], pair[0]) == 0.0


def test_sr_decisions_are_independent_across_streams():
    assert abs(_tie_disagreement("reference", 7, 7, 0, 1) - 0.5) < 0.028
    assert abs(_tie_disagreement("reference", 7, 7, 3, 2**32 - 1) - 0.5) < 0.028


def test_optimizer_sr_is_fresh_per_parameter_and_per_seed():
    # the optimizer's seed and each parameter's index both reach the rounding: ties split 50/50
    def run(seed):
        ps = [torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16)) for _ in range(2)]
        opt = build_optimizer("sr-adamw", ps, lr=2.0**-8, betas=(0.0, 0.0), eps=1e-30, master="bf16", seed=seed)
        for p in ps:
            p.grad = -torch.ones_like(p)
        opt.step()
        return [p.detach().clone() for p in ps]
    a, b = run(0), run(1)
    for x, y in ((a[0], a[1]), (a[0], b[0]), (a[1], b[1])):
        assert abs((x != y).float().mean().item() - 0.5) < 0.028


@pytest.mark.parametrize("missing", [(0, 1), (2, 1), None], ids=["first-step", "after-plan", "none"])
def test_optimizer_step_is_optim_step_per_parameter(missing):
    # what MasterOptimizer.step does, spelled out per tensor: one launch per bucket of one step count,
    # a parameter without a gradient is skipped but keeps its index (its Philox stream); the kept
    # plan of a group (from the second step on) gives the same bits and is dropped when it no longer fits
    torch.manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2, 2)]
    ps = [torch.nn.Parameter(torch.randn(sh).bfloat16()) for sh in shapes]
    ref = [p.detach().clone() for p in ps]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = MAdam([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], state_dtype=torch.bfloat16, seed=3,
                rounding="stochastic", **kw)
    states = [[torch.zeros(sh, dtype=torch.bfloat16) for _ in range(3)] for sh in shapes]
    steps = [0, 0, 0]
    for it in range(4):
        grads = [torch.randn(sh).bfloat16() for sh in shapes]
        for i, p in enumerate(ps):
            p.grad = None if (it, i) == missing else grads[i].clone()
        opt.step()
        if missing is None and it >= 1:
            assert all(opt._plans[gi] is not None for gi in (0, 1))  # the kept buckets did this step
        for i in range(3):
            if ps[i].grad is None:
                continue
            steps[i] += 1
            s = step_scalars(lr=kw["lr"], beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1 if i < 2 else 0.0,
                             step=steps[i], mul_lr=kw["lr"] * 1.0, cap=1.0)
            optim_step("madam-arxiv-relative", ref[i], grads[i], states[i], s, rounding="stochastic",
                       seed=mix_seed(3, "optim", steps[i]), stream=i, backend="reference")
        for p, r in zip(ps, ref):
            assert torch.equal(p.detach().view(torch.int16), r.view(torch.int16)), it


def test_load_state_dict_into_a_stepped_optimizer_drops_its_plans():
    import copy

    def run(reload):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64).bfloat16())
        opt = build_optimizer("kahan-adamw", [p], lr=1e-2, master="bf16", states="bf16")
        snap = None
        for it in range(4):
            if it == 2:
                snap = (p.detach().clone(), copy.deepcopy(opt.state_dict()))
            p.grad = torch.randn(64, generator=torch.Generator().manual_seed(it)).bfloat16()
            opt.step()
        if reload:  # back to step 2 in the same optimizer, then the same two steps again
            with torch.no_grad():
                p.copy_(snap[0])
            opt.load_state_dict(snap[1])
            for it in (2, 3):
                p.grad = torch.randn(64, generator=torch.Generator().manual_seed(it)).bfloat16()
                opt.step()
        return p.detach().clone(), [v.clone() for k, v in opt.state[p].items() if k != "step"]

    (w1, st1), (w2, st2) = run(False), run(True)
    assert torch.equal(w1.view(torch.int16), w2.view(torch.int16))
    assert all(torch.equal(a, b) for a, b in zip(st1, st2))


def test_multi_step_refuses_mixed_dtypes_and_repeated_streams():
    s = step_scalars(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    w = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)]
    g = [torch.zeros(4), torch.zeros(4)]
    st = [[torch.zeros(4), torch.zeros(4)] for _ in w]
    with pytest.raises(ValueError, match="one dtype each"):
        optim_step_multi("adamw", w, g, st, s)
    with pytest.raises(ValueError, match="streams must be distinct"):
        optim_step_multi("adamw", [w[0], w[0].clone()], g, st, s, streams=[1, 1])


def test_our_adamw_matches_torch_adamw_in_fp32():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(50, 40))
    b = torch.nn.Parameter(a.detach().clone())
    ours, ref = AdamW([a], lr=1e-2, weight_decay=0.1), torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(50, 40)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_packed_masters_store_codes_and_read_as_bf16():
    lin = torch.nn.Linear(64, 16)
    convert_master_weights(lin, "fp4")
    w = lin.weight
    assert isinstance(w, PackedMaster) and w.dtype == torch.bfloat16 and lin.bias.dtype == torch.bfloat16
    assert w.packed_bytes == 16 * (32 + 2)  # 4.25 bits per weight
    y = lin(torch.randn(3, 64, dtype=torch.bfloat16))
    y.sum().backward()
    assert w.grad.dtype == torch.bfloat16 and w.grad.shape == (16, 64)
    torch.testing.assert_close(w.to(torch.bfloat16).float(), read_master(w), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="in place"):
        with torch.no_grad():
            w.mul_(2)


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "nvfp4"])
def test_packed_masters_deepcopy_and_pickle(fmt):
    """copy.deepcopy and torch.save of a module with packed masters. Both failed with "Attempted to
    call copy_() on an invalid python storage" / "... data pointer on an invalid python storage": the
    wrapper tensor has no storage of its own, and Tensor's deepcopy and pickling read it (fresh-user pass)."""
    import copy
    import io

    lin = torch.nn.Linear(64, 16)
    convert_master_weights(lin, fmt)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for clone in (copy.deepcopy(lin), _save_load(lin, io)):
        w = clone.weight
        assert isinstance(w, PackedMaster) and isinstance(w, torch.nn.Parameter) and w.fmt == fmt and w.requires_grad
        assert all(torch.equal(w.parts[k], lin.weight.parts[k]) for k in lin.weight.parts)
        assert all(w.parts[k].data_ptr() != lin.weight.parts[k].data_ptr() for k in w.parts)  # a copy, not a view
        assert torch.equal(clone(x), lin(x))
    sd = _save_load(lin.state_dict(), io)
    assert torch.equal(read_master(sd["weight"]), read_master(lin.weight))


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "nvfp4"])
def test_packed_masters_refuse_a_dtype_cast_and_keep_bf16_and_device_moves(fmt):
    """model.to(float32) set a packed weight's dtype to float32 while its reads stayed BF16, so the next
    forward failed deep in F.linear ("self and mat2 must have the same dtype"); model.to(bfloat16) and a
    move to the device it is on keep the packed values."""
    lin = torch.nn.Linear(64, 16)
    convert_master_weights(lin, fmt)
    before = read_master(lin.weight)
    lin.to(torch.bfloat16)
    lin.to("cpu")
    assert isinstance(lin.weight, PackedMaster) and lin.weight.dtype == torch.bfloat16
    assert torch.equal(read_master(lin.weight), before)
    for cast in (lambda: lin.to(torch.float32), lin.float, lin.half):
        with pytest.raises(RuntimeError, match="cannot cast a packed .* before convert_master_weights"):
            cast()
    assert lin.weight.dtype == torch.bfloat16 and lin(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def _save_load(obj, io):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_bytes_per_param_with_bf16_masters_and_states():
    lin = torch.nn.Linear(64, 64, bias=False)
    convert_master_weights(lin, "bf16")
    opt = build_optimizer("m+adam", lin.parameters(), lr=1e-3, master="bf16", states="bf16")
    lin.weight.sum().backward()
    opt.step()
    assert memory_bytes(lin, opt)["bytes_per_param"] == 8.0  # 2 (master) + 3 × 2 (m, v, v_e)
    lin2 = torch.nn.Linear(64, 64, bias=False)
    opt2 = build_optimizer("adamw", lin2.parameters(), lr=1e-3)
    assert isinstance(opt2, torch.optim.AdamW)
    lin2.weight.sum().backward()
    opt2.step()
    assert memory_bytes(lin2, opt2)["bytes_per_param"] == 12.0  # FP32 master + two FP32 moments


# ----------------------------------------------------------------------------- llama-tiny, checkpoints
def _tiny(master: str):
    from adahop.models import build_model
    from adahop.nn import convert_model

    torch.manual_seed(0)
    model = build_model("llama-tiny", vocab_size=256, max_seq_len=16)
    convert_model(model, "mxfp4", seed=0)
    return convert_master_weights(model, master)


def _opt(name, model, master):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return build_optimizer(name, [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-3,
                           betas=(0.9, 0.95), master=master, states="fp32" if master == "fp32" else "bf16", seed=1)


def _steps(model, opt, n, start=0):
    losses = []
    for i in range(start, start + n):
        ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(i % 2))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name,master", COMBOS, ids=lambda v: str(v))
def test_llama_tiny_loss_falls_and_resume_is_exact(name, master, tmp_path):
    from adahop.train.checkpoint import load_checkpoint, save_checkpoint

    model = _tiny(master)
    opt = _opt(name, model, master)
    losses = _steps(model, opt, 6)
    assert losses[-1] < losses[0] - 0.05, losses
    ck = save_checkpoint(tmp_path, 6, model, opt)
    cont = _steps(model, opt, 2, start=6)
    model2 = _tiny(master)
    opt2 = _opt(name, model2, master)
    load_checkpoint(ck, model2, opt2)
    assert _steps(model2, opt2, 2, start=6) == cont
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(read_master(a), read_master(b)), k
    # the checkpoint holds masters and states in their own dtypes
    weights, states = load_file(ck / "model.safetensors"), load_file(ck / "optimizer.safetensors")
    q = "model.layers.0.mlp.down_proj.weight"
    if master in ("fp32", "bf16"):
        assert weights[q].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[master]
    else:
        assert q not in weights and weights[f"{q}::{master}.codes"].dtype in (torch.uint8, torch.float8_e4m3fn)
    assert {v.dtype for k, v in states.items()} == {torch.float32 if master == "fp32" else torch.bfloat16}


def test_train_refuses_bad_combinations(tmp_path):
    from adahop.train import TrainConfig

    with pytest.raises(ValueError, match="--master-weights: fp4 masters .* --parallel ddp"):
        TrainConfig(master_weights="fp4", parallel="ddp", out=str(tmp_path))
    with pytest.raises(ValueError, match="--master-weights: fp8 masters .* drop --compile"):
        TrainConfig(master_weights="fp8", compile=True, out=str(tmp_path))
    with pytest.raises(ValueError, match="--optimizer: sr-adamw .* --master-weights bf16"):
        TrainConfig(optimizer="sr-adamw", out=str(tmp_path))
    with pytest.raises(ValueError, match="--madam-form: 'paper'"):
        TrainConfig(madam_form="paper", out=str(tmp_path))
    with pytest.raises(ValueError, match="--optimizer-states"):
        TrainConfig(optimizer_states="fp8", out=str(tmp_path))
    with pytest.raises(ValueError, match="--master-rounding: 'up'"):
        TrainConfig(master_rounding="up", out=str(tmp_path))
    with pytest.raises(ValueError, match="--master-rounding: FP32 masters are not rounded"):
        TrainConfig(master_rounding="stochastic", out=str(tmp_path))
    with pytest.raises(ValueError, match="--master-rounding: sr-adamw rounds stochastically"):
        TrainConfig(optimizer="sr-adamw", master_weights="bf16", master_rounding="nearest", out=str(tmp_path))


@pytest.mark.parametrize("name,rounding,want", [("m+adam", "auto", "nearest"), ("m+adam", "stochastic", "stochastic"),
                                                ("adamw", "stochastic", "stochastic"), ("sr-adamw", "auto", "stochastic"),
                                                ("kahan-adamw", "nearest", "nearest")])
def test_master_rounding_reaches_the_optimizer(name, rounding, want, tmp_path):
    """--master-rounding is what the built optimizer rounds with (the CLI's m+adam could only round
    to nearest before it existed)."""
    from adahop.train import TrainConfig
    from adahop.train.setup import build_optimizer as build_for

    lin = convert_master_weights(torch.nn.Linear(32, 4, bias=False), "fp4")
    cfg = TrainConfig(optimizer=name, master_weights="fp4", optimizer_states="bf16", master_rounding=rounding,
                      out=str(tmp_path))
    assert build_for(cfg, lin).rounding == want


def test_stochastic_rounding_of_fp32_masters_is_refused_by_the_library_too():
    """build_optimizer used to accept it and round nothing (FP32 writes are exact): the CLI refused it, a
    library caller got plain AdamW."""
    from adahop.optim import build_optimizer

    for name in ("adamw", "kahan-adamw", "m+adam"):
        with pytest.raises(ValueError, match="--master-rounding stochastic: FP32 masters are not rounded"):
            build_optimizer(name, [torch.nn.Parameter(torch.zeros(4))], lr=1e-3, master="fp32", states="bf16",
                            rounding="stochastic")


def test_madam_settings_without_madam_are_refused_not_ignored(tmp_path):
    """`--madam-form workshop` without `--optimizer m+adam` ran plain AdamW (the default optimizer),
    the form silently unused."""
    from adahop.train import TrainConfig

    with pytest.raises(ValueError, match="--madam-form: workshop is an M\\+Adam setting .* --optimizer adamw .* "
                                         "add --optimizer m\\+adam"):
        TrainConfig(madam_form="workshop", master_weights="bf16", out=str(tmp_path))
    with pytest.raises(ValueError, match="--madam-mul-lr: 5.0 is an M\\+Adam setting .* --optimizer kahan-adamw"):
        TrainConfig(optimizer="kahan-adamw", madam_mul_lr=5.0, out=str(tmp_path))
    cfg = TrainConfig(optimizer="m+adam", madam_form="workshop", madam_mul_lr=5.0, out=str(tmp_path))  # its own
    assert (cfg.madam_form, cfg.madam_mul_lr) == ("workshop", 5.0)
    TrainConfig(optimizer="adamw", out=str(tmp_path))  # the defaults pass with any optimizer


# ----------------------------------------------------------------------------- the fused kernel, interpreted
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not (triton_available() and INTERPRET),
                            reason="run by test_optim_kernel_in_interpreter in a TRITON_INTERPRET=1 child")


@pytest.mark.skipif(not triton_available() or INTERPRET, reason="needs triton; runs the interp_* tests in a child process")
def test_optim_kernel_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-o", "addopts=", "-q", "-k", "interp_", "-p", "no:cacheprovider",
           "-W", "ignore"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]


@interp
def test_interp_philox_matches_tl_randint():
    import triton
    import triton.language as tl

    @triton.jit
    def draw(out, seed, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(out + o, tl.randint(seed, o).to(tl.int64) & 0xFFFFFFFF)

    for seed in (0, 12345, 2**62 + 987654321):
        out = torch.empty(64, dtype=torch.int64)
        draw[(1,)](out, seed, N=64)
        assert torch.equal(out, philox_randint(seed, torch.arange(64)))


CASES = [(a, w, s, r) for a, w, s, r in itertools.product(ALGORITHMS, (torch.float32, torch.bfloat16),
                                                           (torch.float32, torch.bfloat16), ROUNDINGS)
         if not (r == "stochastic" and w == torch.float32)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-w{str(c[1])[6:]}-s{str(c[2])[6:]}-{c[3]}")
@interp
def test_interp_fused_step_bit_exact(case):
    alg, wdt, sdt, rounding = case
    gen = torch.Generator().manual_seed(0)
    n = 1100  # one full and one masked block of 1024
    w0 = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-8, 8, (n,), generator=gen).float())
    w0[:4] = 0.0
    w0 = w0.to(wdt)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    st0 = [(torch.rand(n, generator=gen) * 1e-3).to(sdt) for _ in STATE_NAMES[alg]]
    s = step_scalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, mul_lr=3e-2, cap=2.0)
    # stream 1 as the per-tensor path passes it to the second parameter (a constexpr on the GPU)
    assert bit_mismatches(alg, w0, g, st0, s, rounding=rounding, seed=1234, stream=1)[:2] == (0, 0)  # weights, states


@pytest.mark.parametrize("rounding", ROUNDINGS)
@interp
def test_interp_workshop_exponent_steps_beyond_one_octave_bit_exact(rounding):
    # lr·mul·cap = 6: the exponent steps of the polynomial's range and beyond it, in kernel and reference alike
    gen = torch.Generator().manual_seed(1)
    n = 1100
    w0 = (torch.randn(n, generator=gen) * 4).to(torch.bfloat16)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    st0 = [(torch.rand(n, generator=gen) * 1e-3).to(torch.float32) for _ in STATE_NAMES["madam-workshop"]]
    s = step_scalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=2, mul_lr=3.0, cap=2.0)
    assert bit_mismatches("madam-workshop", w0, g, st0, s, rounding=rounding, seed=7, stream=0)[:2] == (0, 0)


@pytest.mark.parametrize("pair", SEED_PAIRS, ids=["next", "high-half", "steps"])
@interp
def test_interp_sr_decisions_are_independent_across_seeds(pair):
    assert abs(_tie_disagreement("triton", *pair) - 0.5) < 0.028
    assert abs(_tie_disagreement("triton", pair[0], pair[0], 0, 5) - 0.5) < 0.028  # and across streams


def _multi_case(alg, wdt, sdt, seed=0):
    """Tensors of ragged sizes (one empty, one misaligned: a view at element 1 of its storage)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [5, 1100, 0, 64, 2049, 300]
    ws = [(torch.randn(n + 1, generator=gen) * torch.exp2(torch.randint(-8, 8, (n + 1,), generator=gen).float()))
          .to(wdt) for n in sizes]
    ws = [w[1:] if i == 5 else w[:-1] for i, w in enumerate(ws)]  # ws[5]: not 16-byte aligned
    gs = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes]
    sts = [[(torch.rand(n, generator=gen) * 1e-3).to(sdt) for _ in STATE_NAMES[alg]] for n in sizes]
    return ws, gs, sts


MULTI_CASES = [(a, torch.bfloat16, torch.bfloat16, "stochastic") for a in ALGORITHMS] + [
    ("adamw", torch.float32, torch.float32, "nearest"), ("madam-workshop", torch.float32, torch.float32, "nearest"),
    ("kahan", torch.bfloat16, torch.float32, "nearest")]


@pytest.mark.parametrize("case", MULTI_CASES, ids=lambda c: f"{c[0]}-w{str(c[1])[6:]}-s{str(c[2])[6:]}-{c[3]}")
@interp
def test_interp_multi_step_bit_exact(case):
    alg, wdt, sdt, rounding = case
    ws, gs, sts = _multi_case(alg, wdt, sdt)
    s = step_scalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, mul_lr=3e-2, cap=2.0)
    streams = [4, 0, 9, 2, 1, 7]
    bad_w, bad_s, out = bit_mismatches_multi(alg, ws, gs, sts, s, rounding=rounding, seed=99, streams=streams,
                                             block=1024, num_warps=4)
    assert (bad_w, bad_s) == (0, 0)
    assert not torch.equal(out[1], ws[1]) and not torch.equal(out[5], ws[5])  # the step did move them
    if rounding == "stochastic" and alg == "adamw":  # streams past 2^31 (int64 kernel arguments), both kernels
        big = [2**32 - 1, 2**31, 5, 6, 2**31 + 7, 2**32 - 2]
        assert bit_mismatches_multi(alg, ws, gs, sts, s, rounding=rounding, seed=99, streams=big)[:2] == (0, 0)
        assert bit_mismatches_multi(alg, ws, gs, sts, s, rounding=rounding, seed=99, streams=big,
                                    one_tensor=True)[:2] == (0, 0)
    # the default block gives the same bits (the SR counter is the index in the tensor, not the block)
    assert bit_mismatches_multi(alg, ws, gs, sts, s, rounding=rounding, seed=99, streams=streams)[:2] == (0, 0)


@interp
def test_interp_multi_step_builds_its_table_only_when_tensors_move(monkeypatch):
    from adahop.kernels import _triton_optim_step as K
    from adahop.kernels.optim_step import MultiTensorStep

    ws, gs, sts = _multi_case("adamw", torch.bfloat16, torch.bfloat16, seed=1)
    ref_w, ref_st = [w.clone() for w in ws], [[t.clone() for t in st] for st in sts]
    s = step_scalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=2)
    builds = []
    build = K.build_table
    monkeypatch.setattr(K, "build_table", lambda *a: builds.append(1) or build(*a))
    fused = MultiTensorStep("adamw", sts, list(range(6)), rounding="stochastic", backend="triton")

    def step(gs):
        fused(ws, gs, s, 5)
        optim_step_multi("adamw", ref_w, gs, ref_st, s, rounding="stochastic", seed=5, backend="reference")

    step(gs)
    step(gs)  # the same tensors: the kept table
    assert len(builds) == fused.builds == 1
    gs = [g.clone() for g in gs]  # new gradient tensors: a new table
    step(gs)
    assert len(builds) == fused.builds == 2
    for a, b in zip(ws, ref_w):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    with pytest.raises(ValueError, match="one dtype each"):  # a moved tensor is checked again
        fused(ws, [gs[0].float()] + gs[1:], s, 5)
    with pytest.raises(ValueError, match="contiguous"):
        fused(ws, gs[:1] + [torch.randn(2 * 1100).bfloat16()[::2]] + gs[2:], s, 5)


# ----------------------------------------------------------------------------- the multi kernel, compiled (no GPU)
def _sm90_ptx(alg: int, bf16: bool) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from adahop.kernels import _triton_optim_step as K

    names = "lr b1 omb1 b2 omb2 eps decay wdlr step_size rbc1 rsbc2 mul_lr tau cap w_max".split()
    consts = dict(ALG=alg, W_BF16=bf16, G_BF16=bf16, S_BF16=bf16, STOCHASTIC=bf16, BLOCK=K.MULTI_BLOCK)
    sig = {"tab_ptr": "*i64", "blk_ptr": "*i32", "seed": "i64", **dict.fromkeys(names, "fp32"),
           **dict.fromkeys(consts, "constexpr")}
    src = ASTSource(K._optim_multi_kernel, sig, consts, attrs={(0,): [["tt.divisibility", 16]],
                                                               (1,): [["tt.divisibility", 16]]})
    return compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=K.MULTI_WARPS,
                                                                       enable_fp_fusion=False)).asm["ptx"]


@pytest.mark.skipif(not triton_available() or INTERPRET, reason="needs triton's CUDA backend (compiles, runs nothing)")
@pytest.mark.parametrize("alg,bf16,tensors", [(0, True, 4), (4, False, 6)], ids=["adamw-bf16-sr", "workshop-fp32"])
def test_multi_kernel_full_blocks_move_16_bytes_per_access(alg, bf16, tensors):
    # the table's addresses are loaded values: without the alignment hint on the pointer and the
    # constant mask of full blocks, every element would be its own 2- or 4-byte load (round 7's fix)
    try:
        ptx = _sm90_ptx(alg, bf16)
    except (ImportError, RuntimeError) as e:  # a Triton build without the NVIDIA backend
        pytest.skip(f"no sm_90 compile here: {e}")
    assert ptx.count("ld.global.v4") >= tensors  # w, g and each state, in the full-block branch
    assert ptx.count("st.global.v4") >= tensors - 1  # w and each state


# ---- what the optimizers refuse -----------------------------------------------------------------
def test_options_the_rule_does_not_read_and_bad_values_are_refused_at_construction():
    """torch.optim.AdamW's maximize/amsgrad/foreach/fused or a typo were kept in the groups and never read
    (AdamW(maximize=True) minimized); betas of one number, eps <= 0, a negative weight decay and lr=inf
    were taken (lr=inf turned the weights non-finite)."""
    from adahop.optim import AdamW, KahanAdamW, MAdam, SRAdamW

    ps = [torch.nn.Parameter(torch.ones(4))]
    for cls in (AdamW, SRAdamW, KahanAdamW, MAdam):
        for bad in ({"maximize": True}, {"amsgrad": True}, {"foreach": True}, {"weight_decy": 0.1}):
            with pytest.raises(TypeError, match=f"unsupported option.*{next(iter(bad))}"):
                cls(ps, **bad)
    with pytest.raises(TypeError, match="mul_lr_scale"):
        AdamW(ps, mul_lr_scale=10.0)  # an M+Adam option
    MAdam(ps, mul_lr_scale=10.0, tau=1e-6, cap=None, w_max=None)  # its own are taken
    for kw, what in (({"betas": (0.9,)}, "betas"), ({"eps": 0.0}, "eps"), ({"weight_decay": -1.0}, "weight_decay"),
                     ({"lr": float("inf")}, "lr"), ({"eps": float("nan")}, "eps")):
        with pytest.raises(ValueError, match=what):
            AdamW(ps, **kw)


def test_an_optimizer_built_before_the_masters_were_packed_refuses_to_step():
    """convert_master_weights(fp8/fp4) replaces the matrices' Parameters: an optimizer built before it updated
    the old ones, and the model's weights never trained (only the biases did)."""
    from adahop.optim import SRAdamW, convert_master_weights

    m = torch.nn.Linear(64, 32)
    opt = SRAdamW(m.parameters())
    convert_master_weights(m, "fp8")
    m(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().sum().backward()
    with pytest.raises(ValueError, match="replaced by convert_master_weights.*'fp8'.*build the optimizer after"):
        opt.step()
    ok = SRAdamW(m.parameters())  # built after: steps
    before = m.weight.dequantize().clone()
    ok.step()
    assert not torch.equal(m.weight.dequantize(), before)


def test_masters_packed_after_the_first_step_are_refused_too():
    """From its second step the optimizer runs a kept plan, which skipped the check above: the packed weight
    never trained and the old FP32 Parameter did, silently (helper 26)."""
    from adahop.optim import MAdam, convert_master_weights

    m = torch.nn.Linear(32, 16, bias=False)
    opt = MAdam(m.parameters(), lr=1e-2)
    m(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    convert_master_weights(m, "fp8")
    opt.zero_grad(set_to_none=False)  # the old Parameter keeps a (zero) gradient: the plan still fits
    m(torch.randn(4, 32, dtype=torch.bfloat16)).float().square().mean().backward()
    with pytest.raises(ValueError, match="replaced by convert_master_weights"):
        opt.step()


def test_parameter_groups_are_checked_as_the_constructor_checks_its_options():
    """Only the constructor's defaults were checked: a group's lr=nan trained to NaN weights, and a group's
    typo, negative mul_lr_scale or foreach=True were taken (helper 26)."""
    from adahop.optim import MAdam

    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))
    for group, err, what in (({"lr": float("nan")}, ValueError, "group 0: lr=nan"),
                             ({"mul_lr_scale": -5.0}, ValueError, "mul_lr_scale=-5"),
                             ({"cap": 0.0}, ValueError, "cap=0.0"), ({"foreach": True}, TypeError, "foreach"),
                             ({"mul_lr_sclae": 5.0}, TypeError, "mul_lr_sclae")):
        with pytest.raises(err, match=what):
            MAdam([{"params": [a], **group}])
    opt = MAdam([a])
    with pytest.raises(TypeError, match="group 1: unsupported option.*weight_decy"):
        opt.add_param_group({"params": [b], "weight_decy": 0.1})
    opt.add_param_group({"params": [b], "lr": 1e-2, "mul_lr_scale": 3.0, "name": "vectors", "foreach": False})
    assert opt.param_groups[1]["mul_lr_scale"] == 3.0
    # a group held still at lr 0 (torch allows it; refused for a while), NumPy and tensor numbers
    c, d = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [c], "lr": 0.0})
    opt.add_param_group({"params": [d], "lr": np.float32(1e-3), "eps": torch.tensor(1e-8)})
    c.grad = torch.ones(3)
    opt.step()
    assert torch.equal(c.detach(), torch.ones(3))


def test_a_pickled_or_copied_optimizer_keeps_its_storage_options_and_steps_alike():
    """torch's __getstate__ keeps defaults, state and groups only: the copy lost state_dtype, seed, rounding
    and the M+Adam form, and a deep copy failed at its first step (helper 26)."""
    import copy
    import pickle

    from adahop.optim import MAdam, convert_master_weights

    torch.manual_seed(0)
    m = convert_master_weights(torch.nn.Linear(32, 16), "bf16")
    opt = MAdam(m.parameters(), state_dtype=torch.bfloat16, rounding="stochastic", seed=5, form="workshop")
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    m(x).float().sum().backward()
    opt.step()
    back = pickle.loads(pickle.dumps(opt))
    assert (back.state_dtype, back.seed, back.rounding, back.form, back.algorithm) == \
        (torch.bfloat16, 5, "stochastic", "workshop", "madam-workshop")
    m2, opt2 = copy.deepcopy((m, opt))
    back.load_state_dict(opt.state_dict())  # a copy still loads states (its hooks are there, once)
    assert len(back._optimizer_load_state_dict_post_hooks) == 1
    for model, o in ((m, opt), (m2, opt2)):
        o.zero_grad()
        model(x).float().sum().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


@pytest.mark.parametrize("master", ["bf16", "fp8"])
def test_load_state_dict_keeps_fp32_states_of_low_precision_masters(master):
    """The pickling __setstate__ (61496a9) ran inside torch's load_state_dict too and dropped the stash the
    post-hook restores state dtypes from: FP32 moments of BF16/FP8 masters came back BF16, so every resume of
    such a run changed the next steps and the one after it was refused (helper 27)."""
    from adahop.optim import AdamW, convert_master_weights

    torch.manual_seed(0)
    m = convert_master_weights(torch.nn.Linear(32, 16, bias=False), master)
    opt = AdamW(m.parameters(), state_dtype=torch.float32)
    m(torch.randn(4, 32, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[m.weight].items() if torch.is_tensor(v)}
    opt.load_state_dict(opt.state_dict())
    for k, v in before.items():
        assert opt.state[m.weight][k].dtype == v.dtype and torch.equal(opt.state[m.weight][k], v), k
    assert len(opt._optimizer_load_state_dict_post_hooks) == 1
    opt.load_state_dict(opt.state_dict())  # and again: the states are still the dtype it keeps


def test_a_sparse_gradient_is_refused_by_name():
    from adahop.optim import AdamW

    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradient"):
        opt.step()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_an_nvfp4_master_keeps_its_block_scales_under_steps_below_half_an_ulp(rounding):
    """Each write re-rounded the E4M3 block scale from the new block maximum: a step of 2^-4 on the block
    maximum alone (half its ulp is 1/6) moved the scale 44 -> 48 and all 16 elements by 9% (helper 26)."""
    from adahop.optim.master import pack, unpack

    g = torch.Generator().manual_seed(0)
    w = torch.rand(64, 64, generator=g) * 2 - 1
    d = pack(w, "nvfp4", "nearest")
    w0 = unpack(d, "nvfp4", w.shape)
    # every element moved by 1/16 of itself, toward and away from zero: below half of any E2M1 ulp
    step = w0 * torch.where(torch.rand(w.shape, generator=g) < 0.5, 1.0, -1.0) / 16
    gen = torch.Generator().manual_seed(1)
    d1 = pack(w0 + step, "nvfp4", rounding, gen, global_scale=d["global_scale"], block_scales=d["scales"])
    if rounding == "nearest":
        assert torch.equal(unpack(d1, "nvfp4", w.shape), w0)
    blocks = w0.reshape(64, 4, 16).abs().amax(-1)
    kept = torch.equal(d1["scales"].float(), d["scales"].float())
    grew = (w0 + step).reshape(64, 4, 16).abs().amax(-1) > blocks  # SR may not clip: a grown maximum may move it
    assert kept or (rounding == "stochastic" and bool(grew.any()))
    fresh = pack(w0 + step, "nvfp4", "nearest", global_scale=d["global_scale"])  # no stored scales: the old rule
    assert not torch.equal(fresh["scales"].float(), d["scales"].float())  # which would have moved some


@pytest.mark.parametrize("opt", ["sr-adamw", "madam"])
def test_an_nvfp4_master_under_stochastic_rounding_is_left_alone_by_a_zero_step(opt):
    """A block maximum stored at exactly 6 steps of its scale reads back as 6.0000005 steps in FP32: the tensor
    scale's check under SR (≤ 448·6) failed, every block scale was derived afresh and 16 elements re-rounded at
    random, so lr 0 moved 60 then 15 of 2048 weights by up to 0.036 (helper 66)."""
    from adahop.optim import SRAdamW
    from adahop.optim.master import read_master, write_master

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    convert_master_weights(m, "nvfp4")
    w = m[0].weight
    stored = read_master(w).float()
    assert bool(stored.abs().amax() > w.parts["global_scale"].float() * (448.0 * 6.0))  # the case: an ulp over
    o = SRAdamW(m.parameters(), lr=1e-3) if opt == "sr-adamw" else MAdam(m.parameters(), lr=1e-3, rounding="stochastic")
    for g in o.param_groups:
        g["lr"] = 0.0
    x = torch.randn(32, 64).bfloat16()
    for _ in range(3):
        before = [p.float() for p in m.parameters()]
        o.zero_grad()
        m(x).float().pow(2).mean().backward()
        o.step()
        assert all(torch.equal(p.float(), b) for p, b in zip(m.parameters(), before))
    parts = {k: v.clone() for k, v in w.parts.items()}
    write_master(w, read_master(w), "stochastic", torch.Generator().manual_seed(1))  # its own values, written back
    assert all(torch.equal(w.parts[k].view(torch.uint8), parts[k].view(torch.uint8)) for k in ("codes", "scales"))


def test_load_state_dict_refuses_another_optimizers_groups():
    """torch's SGD (momentum 0: no states) loaded into AdamW, whose groups it replaced; the first step then failed on
    a bare KeyError: 'betas' (helper 66)."""
    lin = torch.nn.Linear(8, 8)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.randn(2, 8)).sum().backward()
    sgd.step()
    with pytest.raises(ValueError, match="saved param group 0 has no betas, eps: it is another optimizer's"):
        AdamW(lin.parameters()).load_state_dict(sgd.state_dict())
    torch_adamw = torch.optim.AdamW(lin.parameters())
    torch_adamw.step()
    AdamW(lin.parameters()).load_state_dict(torch_adamw.state_dict())  # torch's AdamW groups still load


def test_load_state_dict_refuses_another_rules_or_dtypes_states():
    """AdamW's states into Kahan's or M+Adam's failed at the next step on a bare KeyError; one M+Adam form's
    into another's loaded silently; FP32 states into an optimizer built for BF16 ones stayed FP32."""
    from adahop.optim import AdamW, KahanAdamW, MAdam

    def stepped(opt_fn):
        p = torch.nn.Parameter(torch.randn(8))
        opt = opt_fn([p])
        p.grad = torch.randn(8)
        opt.step()
        return opt.state_dict()

    adamw = stepped(lambda ps: AdamW(ps))
    for other, what in ((lambda ps: KahanAdamW(ps), "'adamw' update rule, this optimizer runs 'kahan'"),
                        (lambda ps: MAdam(ps), "update rule"),
                        (lambda ps: AdamW(ps, state_dtype=torch.bfloat16), "state_dtype as saved")):
        with pytest.raises(ValueError, match=what):
            other([torch.nn.Parameter(torch.randn(8))]).load_state_dict(adamw)
    older = {"state": adamw["state"], "param_groups": [{k: v for k, v in g.items() if k != "algorithm"}
                                                       for g in adamw["param_groups"]]}  # saved before groups named the rule
    with pytest.raises(ValueError, match=r"saved states \['exp_avg', 'exp_avg_sq'\] are not this optimizer's"):
        KahanAdamW([torch.nn.Parameter(torch.randn(8))]).load_state_dict(older)
    arxiv = stepped(lambda ps: MAdam(ps, form="arxiv"))
    with pytest.raises(ValueError, match="'madam-arxiv' update rule"):
        MAdam([torch.nn.Parameter(torch.randn(8))], form="arxiv-relative").load_state_dict(arxiv)
    same = AdamW([torch.nn.Parameter(torch.randn(8))])
    same.load_state_dict(adamw)  # its own kind loads, states as saved
    assert same.state[same.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.float32


def test_load_state_dict_refuses_torch_groups_whose_flags_change_the_update():
    """A torch.optim.AdamW(maximize=True) state loaded silently, its group keeping maximize=True, which no step reads:
    the resumed run minimized. torch.optim.Adam's L2 decay (decoupled_weight_decay=False) became decoupled."""
    from adahop.optim import AdamW

    def torch_state(cls, **kw):
        p = torch.nn.Parameter(torch.ones(4))
        opt = cls([p], lr=0.1, **kw)
        p.grad = torch.ones(4)
        opt.step()
        return copy.deepcopy(opt.state_dict())

    for sd, what in ((torch_state(torch.optim.AdamW, maximize=True), "has maximize"),
                     (torch_state(torch.optim.AdamW, amsgrad=True), "has amsgrad"),
                     (torch_state(torch.optim.Adam, weight_decay=0.5), "decoupled_weight_decay=False")):
        with pytest.raises(ValueError, match=what):
            AdamW([torch.nn.Parameter(torch.ones(4))]).load_state_dict(sd)
    for sd in (torch_state(torch.optim.AdamW, foreach=True), torch_state(torch.optim.Adam)):  # the same update
        AdamW([torch.nn.Parameter(torch.ones(4))]).load_state_dict(sd)


def test_a_refused_parameter_leaves_every_step_count_as_it_was():
    """A non-contiguous parameter was refused after its step count had moved: made contiguous as the message says,
    its first update ran with step 2's bias correction (moved by 0.074·lr, not lr). A complex or FP16 parameter of
    a group was refused (naming neither it nor a fix) after the group's other parameters had been counted."""
    t = torch.nn.Parameter(torch.randn(4, 6).t())
    opt = AdamW([t], lr=0.1, weight_decay=0.0, backend="reference")
    t.grad = torch.ones(6, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        opt.step()
    t.data = t.data.contiguous()
    w0 = t.detach().clone()
    opt.step()
    assert opt.state[t]["step"] == 1
    torch.testing.assert_close(t.detach() - w0, torch.full((6, 4), -0.1), rtol=1e-5, atol=0)
    for dtype in (torch.complex64, torch.float16):
        q, p = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3, dtype=dtype))
        opt = AdamW([q, p], backend="reference")
        q.grad, p.grad = torch.ones(3), torch.ones(3, dtype=dtype)
        with pytest.raises(ValueError, match=rf"parameter 1 is {dtype}; the fused step updates float32 or bfloat16"):
            opt.step()
        assert not opt.state[q] and not opt.state[p]
    # a refusal in a later parameter group: the earlier group is not stepped either
    q, t = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4, 6).t())
    opt = AdamW([{"params": [q]}, {"params": [t], "lr": 0.01}], backend="reference")
    q.grad, t.grad = torch.ones(3), torch.ones(6, 4)
    q0 = q.detach().clone()
    with pytest.raises(ValueError, match="parameter 1 .* is not contiguous"):
        opt.step()
    assert not opt.state[q] and torch.equal(q.detach(), q0)


def test_madam_arxiv_forms_refuse_workshop_options_in_an_added_param_group():
    """The constructor refused cap/w_max under an arXiv form, but add_param_group took them: never read."""
    opt = MAdam([torch.nn.Parameter(torch.randn(2))], form="arxiv")
    for extra in ({"w_max": 1.0}, {"cap": 0.5}):
        with pytest.raises(ValueError, match=r"\(group 1\) are options of the workshop form"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], **extra})
    assert len(opt.param_groups) == 1
    MAdam([torch.nn.Parameter(torch.randn(2))], form="workshop").add_param_group(
        {"params": [torch.nn.Parameter(torch.randn(2))], "w_max": 1.0, "cap": 0.5})


def test_build_optimizer_refuses_low_precision_masters_declared_over_fp32_parameters():
    """master="bf16" over FP32 parameters (convert_master_weights not called): stochastic rounding had nothing to
    round, silently; groups given as generators still reach the optimizer whole."""
    m = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"master='bf16', but 2 of the 2 parameters are FP32: call convert_master_weights"):
        build_optimizer("sr-adamw", m.parameters(), lr=1e-3, master="bf16")
    convert_master_weights(m, "bf16")
    opt = build_optimizer("sr-adamw", [{"params": (p for p in m.parameters())}], lr=1e-3, master="bf16")
    assert len(opt.param_groups[0]["params"]) == 2


def test_workshop_exponent_step_beyond_one_octave_is_not_clamped():
    """lr·mul_lr_scale·cap = 3: spec §3.2 A moves w = ±1.5 by (1.5 ∓ 0.3)·2^(∓3) in one step; the exponent
    step was clamped to one octave (2^(∓1)), silently: [0.60, -3.60] (helper 26)."""
    p = torch.nn.Parameter(torch.tensor([1.5, -1.5]))
    opt = MAdam([p], lr=0.3, form="workshop", mul_lr_scale=10, cap=1, weight_decay=0.0, backend="reference")
    p.grad = torch.tensor([1.0, 1.0])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.15, -14.4]), rtol=1e-6, atol=0)


def test_a_reset_of_the_optimizer_state_reaches_the_next_step_as_in_torch():
    """The kept step plan (base._Plan) held its own references to the state tensors: opt.state.clear(), a moment
    replaced by zeros (ReLoRA's reset) or a Parameter swapped into the group in place left the step on the old
    moments, and state_dict() (so every checkpoint) no longer held them. torch.optim.AdamW is the reference."""
    from adahop.optim import AdamW

    torch.manual_seed(0)
    w0 = [torch.randn(5, 3), torch.randn(7)]
    grads = [[torch.randn_like(w) for w in w0] for _ in range(8)]

    def run(cls, reset):
        ps = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = cls(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        for i, gs in enumerate(grads):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
            if i == 2:
                reset(opt, ps)
        return ps, opt

    def zero_moment(opt, ps):
        opt.state[ps[0]]["exp_avg"] = torch.zeros_like(ps[0])

    def clear(opt, ps):
        opt.state.clear()

    for reset in (zero_moment, clear):
        ours, opt = run(AdamW, reset)
        ref, ropt = run(torch.optim.AdamW, reset)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[ours[0]]["exp_avg"], ropt.state[ref[0]]["exp_avg"], rtol=1e-6, atol=1e-7)
        assert opt.state_dict()["state"][0]["step"] == int(ropt.state[ref[0]]["step"]), reset.__name__

    # a Parameter swapped into the group in place starts from fresh moments, as in torch
    def swap(opt, ps):
        new = torch.nn.Parameter(ps[1].detach().clone() + 1)
        opt.param_groups[0]["params"][1] = new
        ps[1] = new

    ours, opt = run(AdamW, swap)
    ref, ropt = run(torch.optim.AdamW, swap)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-6, atol=1e-7)
    assert opt.state[ours[1]]["step"] == 5


def test_the_optimizers_refuse_what_they_would_misread():
    """A probe (helper 35): SRAdamW(rounding="nearest") ran stochastic rounding; build_optimizer gave sr-adamw over
    FP32 masters and torch's AdamW with BF16 states under master="fp32"; MAdam's arXiv forms ignored cap/w_max;
    a non-contiguous parameter failed deep in the step naming neither it nor the fix."""
    from adahop.optim import SRAdamW

    p = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"SRAdamW\(rounding='nearest'\): SRAdamW rounds stochastically"):
        SRAdamW([p], rounding="nearest")
    with pytest.raises(ValueError, match="sr-adamw rounds the master update stochastically, and FP32 masters"):
        build_optimizer("sr-adamw", [p], lr=1e-3, master="fp32")
    with pytest.raises(ValueError, match=r"master='fp32', but parameters are stored as bf16: pass master='bf16'"):
        build_optimizer("adamw", [torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))], lr=1e-3)
    with pytest.raises(ValueError, match=r"cap=None, w_max=1.0 \(group 0\) are options of the workshop form"):
        MAdam([p], form="arxiv-relative", cap=None, w_max=1.0)
    with pytest.raises(ValueError, match=r"cap=2.0, w_max=None \(group 1\)"):
        MAdam([{"params": [p]}, {"params": [torch.nn.Parameter(torch.randn(3))], "cap": 2.0}], form="arxiv")
    MAdam([p], form="workshop", cap=2.0, w_max=1.0)  # the form that reads them
    # torch's AdamW defaults, weight decay 0.01 included
    assert SRAdamW([p]).defaults["weight_decay"] == torch.optim.AdamW([p]).defaults["weight_decay"] == 0.01
    t = torch.nn.Parameter(torch.randn(4, 6).t())  # a transposed view: not contiguous
    opt = AdamW([t], backend="reference")
    t.grad = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(6, 4\), strides \(1, 6\)\) is not contiguous"):
        opt.step()
