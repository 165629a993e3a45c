"""Re-packing low-precision masters (`adahop.optim.master.pack` / `write_master`): the optimizer
re-packs every packed master every step, so a write whose new values are within half an ulp of the
stored ones must store the same codes under round-to-nearest, and an SR write must stay unbiased."""

from __future__ import annotations

import pytest
import torch

from adahop.optim import MAdam, convert_master_weights
from adahop.optim.master import read_master, write_master


def _layer(fmt: str) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
        s = 2.0**-7
        if fmt == "fp4":  # one block at the top of its scale, with the elements a doubled scale loses
            lin.weight[0, :32] = torch.tensor([6.0, 0.5, -0.5, 1.5, -1.5, 3.0, 1.0, 0.5] * 4) * s
        if fmt == "fp8":  # the top of an E4M3 block and an element that is subnormal one scale up
            lin.weight[0, :32] = 0.01
            lin.weight[0, 0], lin.weight[0, 1] = 448 * 2.0**-14, 1.125 * 2.0**-6 * 2.0**-14
    return convert_master_weights(lin, fmt)


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "nvfp4"])
def test_rne_rewrite_within_half_an_ulp_keeps_every_value(fmt):
    """Before the fix: a block maximum at the top of its scale nudged up by 0.1% doubled the MXFP4
    block scale and sent every ±0.5·scale element to zero (and 1.5 to 2); the E4M3 block rounded its
    newly subnormal element; the NVFP4 tensor scale followed the tensor maximum, so every block
    scale moved on every write."""
    p = _layer(fmt).weight
    w = read_master(p)
    gen = torch.Generator().manual_seed(1)
    nudge = 1 + 1e-3 * (2 * torch.rand(w.shape, generator=gen) - 1)
    top = w.abs() == w.abs().amax()
    nudge = torch.where(top, torch.full_like(w, 1 + 1e-3), nudge)  # every block's max... and the tensor's
    blocks = w.reshape(8, -1, 16).abs()
    is_block_max = (blocks == blocks.amax(-1, keepdim=True)).reshape(w.shape)
    nudge = torch.where(is_block_max, torch.full_like(w, 1 + 1e-3), nudge)
    write_master(p, w * nudge, "nearest")
    after = read_master(p)
    assert torch.equal(after, w), f"{(after != w).sum().item()} of {w.numel()} stored values moved"


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "nvfp4"])
def test_sr_write_is_unbiased(fmt):
    """E[SR write of w + Δ] = w + Δ for steps far below an ulp (the scale rules must never clip)."""
    p = _layer(fmt).weight
    w = read_master(p)
    delta = 0.05 * w.abs().clamp(min=1e-3) * torch.sign(torch.randn(w.shape, generator=torch.Generator().manual_seed(2)))
    target = w + delta
    saved = {k: t.clone() for k, t in p.parts.items()}
    n, acc = 400, torch.zeros_like(w)
    for i in range(n):
        write_master(p, target, "stochastic", torch.Generator().manual_seed(i))
        acc += read_master(p)
        for k, t in saved.items():  # back to the start, tensor scale included
            p.parts[k].copy_(t)
    mean = acc / n
    # the mean of n Bernoulli roundings: error ~ ulp/sqrt(n); compare the tensor-wide bias instead
    rel_bias = ((mean - target).sum() / delta.abs().sum()).abs().item()
    assert rel_bias < 0.05, rel_bias
    assert ((mean - w) * torch.sign(delta)).mean() > 0  # the steps were taken on average


def test_fp4_master_moves_under_sr_and_not_under_rne():
    """The arithmetic of docs/optim.md: once Adam's normalized step falls below 1 (here: noise
    gradients, after ~5 steps), an M+Adam step of an E2M1 master (lr 2e-3, ×10 multiplicative:
    ≤ 1.4% of |w|) is below half an ulp (≥ 1/12 of |w| for normals, 1/4 of the block scale at 0),
    so under RNE nothing moves; under SR about a tenth of the weights move each step."""
    moved = {}
    for rounding in ("nearest", "stochastic"):
        p = _layer("fp4").weight
        opt = MAdam([p], lr=2e-3, mul_lr_scale=10.0, rounding=rounding, seed=0, backend="reference")
        frac = []
        for i in range(12):
            before = read_master(p)
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            opt.step()
            frac.append((read_master(p) != before).float().mean().item())
        moved[rounding] = sum(frac[6:]) / 6
    assert moved["nearest"] < 0.005 and moved["stochastic"] > 0.05, moved


def test_quantize_nvfp4_takes_a_given_tensor_scale_and_refuses_a_bad_one():
    from adahop.formats import quantize_nvfp4
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    auto = quantize_nvfp4(x)
    same = quantize_nvfp4(x, global_scale=auto.global_scale)
    assert torch.equal(same.codes, auto.codes) and torch.equal(same.scales.float(), auto.scales.float())
    wider = quantize_nvfp4(x, global_scale=auto.global_scale * 2)
    assert wider.global_scale.item() == 2 * auto.global_scale.item()
    assert (wider.dequantize() - x).abs().max() <= (x.abs().max() / 6)  # still a faithful quantization
    with pytest.raises(ValueError, match="global_scale must be one positive number"):
        quantize_nvfp4(x, global_scale=torch.tensor(0.0))
