#!/usr/bin/env python
"""CPU toy measurement behind docs/optim.md: fit a 64×64 linear weight to a Gaussian target
(initial error 0.3·|target|) for 300 steps with each optimizer, master format and M+Adam form;
prints the first and last loss. Usage: ``python scripts/optim_quadratic.py [--lr 1e-3]``."""

from __future__ import annotations

import argparse

import torch

from adahop.optim import build_optimizer, convert_master_weights


def quad(name, master, form="arxiv-relative", steps=300, lr=1e-3, mul=10.0):
    torch.manual_seed(0)
    target = torch.randn(64, 64)
    lin = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(target + torch.randn(64, 64) * 0.3)
    convert_master_weights(lin, master)
    opt = build_optimizer(name, lin.parameters(), lr=lr, master=master, states="fp32" if master == "fp32" else "bf16",
                          madam_form=form, mul_lr_scale=mul)
    first = None
    for _ in range(steps):
        loss = ((lin.weight.to(torch.float32) - target) ** 2).mean()
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return first, loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    print("| optimizer | master | first loss | last loss |\n|---|---|---|---|")
    for name in ("adamw", "sr-adamw", "kahan-adamw"):
        for master in ("fp32", "bf16", "fp8", "fp4"):
            if name == "sr-adamw" and master == "fp32":
                continue
            print(f"| {name} | {master} | %.4f | %.4f |" % quad(name, master, lr=args.lr))
    for form in ("arxiv-relative", "arxiv", "workshop"):
        for mul in (1.0, 3.0, 10.0, 30.0):
            for master in ("fp32", "bf16", "fp8"):
                print(f"| m+adam {form} ×{mul:g} | {master} | %.4f | %.4f |" % quad("m+adam", master, form, lr=args.lr, mul=mul))


if __name__ == "__main__":
    main()
