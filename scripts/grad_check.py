#!/usr/bin/env python
"""Gradients of one converted linear against the exact BF16-autocast ones, per recipe and backend.

    python scripts/grad_check.py --recipes tseng,quartet --backends reference,triton [--tokens 16384 --k 512 --n 1344]

Prints, for dX and dW: the cosine similarity to the exact gradient and the norm ratio. A fast path
that agrees with its reference shows the same numbers for both backends (stochastic rounding
draws differ, so a few 1e-3); a broken one shows a cosine far below the reference's or a norm
ratio far from 1. Runs on CUDA when present, else on the CPU (``--backends reference``, or
``triton`` under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from adahop.nn import convert_model, get_controller


def grads(recipe: str | None, backend: str, t: int, k: int, n: int, dev: str, dy_scale: float = 1.0):
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=dev))
    if recipe is not None:
        convert_model(lin, recipe, backend=backend)
        ctl = get_controller(lin)
        if ctl.calibrating:  # AdaHOP: calibrate on this very batch, then freeze
            x0 = torch.randn(t, k, device=dev)
            with torch.autocast(dev, dtype=torch.bfloat16):
                lin(x0).float().sum().backward()
            ctl.on_step(ctl.recipe.calibration.steps)
            lin.zero_grad()
    g = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(t, k, generator=g) * torch.linspace(0.1, 4, k)).to(dev).requires_grad_()  # channel spread
    dy = (torch.randn(t, n, generator=g) * dy_scale).to(dev)
    with torch.autocast(dev, dtype=torch.bfloat16):
        y = lin(x)
    y.backward(dy)
    return x.grad.float(), lin[0].weight.grad.float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="mxfp4-had,tseng,quartet")
    ap.add_argument("--backends", default="reference,triton")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--n", type=int, default=1344)
    ap.add_argument("--dy-scale", type=float, default=1.0, help="size of the output gradient (training: ~1e-6)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ex, ew = grads(None, "reference", args.tokens, args.k, args.n, dev, args.dy_scale)
    for recipe in args.recipes.split(","):
        for be in args.backends.split(","):
            dx, dw = grads(recipe, be, args.tokens, args.k, args.n, dev, args.dy_scale)
            cells = []
            for name, a, b in (("dX", dx, ex), ("dW", dw, ew)):
                cos = F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()
                cells.append(f"{name} cos {cos:.4f} norm ratio {(a.norm() / b.norm()).item():.4g}")
            print(f"{recipe:12s} {be:9s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
