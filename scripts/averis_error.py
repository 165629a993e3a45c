"""GEMM error of Averis against NVIDIA's NVFP4 recipe on operands with and without a per-channel
mean bias (the bias Averis removes), one converted linear layer forward + backward on the CPU.

Rows: the presets ``nvfp4`` and ``averis``, the variant ``averis@mean-bf16`` (mean vectors in BF16,
`GemmSpec.mean_bf16`), and each with round to nearest on every operand (``-rne``: what rounding
costs, since v1 of Averis rounds every FP4 tensor stochastically). Columns: ‖Δ‖/‖exact‖ of y, dX and
dW against the FP32 product. Used by `docs/results.md` (the 20M-token table's Averis row).

    python scripts/averis_error.py [--tokens 2048] [--features 512] [--bias 0,3] [--seed 0]
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import replace

import torch
from torch import nn

import adahop
from adahop.recipes import GEMMS, get_recipe


def nearest(recipe):
    """``recipe`` with round to nearest on every operand of every GEMM."""
    def rne(spec):
        return replace(spec, a=replace(spec.a, rounding="nearest"), b=replace(spec.b, rounding="nearest"))
    return replace(recipe, name=f"{recipe.name}-rne", **{g: rne(recipe.gemm(g)) for g in GEMMS})


def errors(recipe, x, w, dy) -> tuple[float, float, float]:
    """Relative errors of y, dX, dW of one ``recipe`` layer against FP32."""
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    m = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
    with torch.no_grad():
        m[0].weight.copy_(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adahop.convert_model(m, recipe, seed=0)
    xx = x.clone().requires_grad_()
    y = m(xx)
    y.backward(dy)
    return rel(y.detach(), x @ w.t()), rel(xx.grad, dy @ w), rel(m[0].weight.grad, dy.t() @ x)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--features", type=int, default=512)
    ap.add_argument("--bias", default="0,3", help="per-channel mean bias, in units of the noise's std (comma-separated)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    recipes = [get_recipe(n) for n in ("nvfp4", "averis", "averis@mean-bf16")]
    recipes += [nearest(r) for r in recipes]
    print("| mean bias | recipe | y | dX | dW |\n|---|---|---|---|---|")
    for bias in (float(b) for b in args.bias.split(",")):
        g = torch.Generator().manual_seed(args.seed)
        t, k = args.tokens, args.features
        w = torch.randn(k, k, generator=g) * 0.02
        x = torch.randn(t, k, generator=g) + bias * torch.randn(1, k, generator=g)
        dy = 1e-3 * (torch.randn(t, k, generator=g) + bias * torch.randn(1, k, generator=g))
        for r in recipes:
            e = errors(r, x, w, dy)
            print(f"| {bias:g} | {r.name} | " + " | ".join(f"{v:.4f}" for v in e) + " |")


if __name__ == "__main__":
    main()
