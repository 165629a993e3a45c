#!/usr/bin/env python
"""CPU diagnostic of low-precision master writes (docs/optim.md, "FP8/FP4 masters"): a linear
teacher-student regression shaped like an LLM layer (weights ~ N(0, 0.02), the teacher 0.01 away),
trained with the experiment's schedule (warm-up, cosine to 0.1×, β2 0.95, weight decay 0.1) by each
optimizer, master format and master rounding. Prints the final loss and, averaged over the run, the
fraction of weights whose stored value changed per step, the fraction of blocks whose scale changed,
and the fraction of weights stored as exactly zero after the first packing and at the end.

Usage: ``python scripts/master_write_diag.py [--steps 300] [--lr 2e-3]``."""

from __future__ import annotations

import argparse

import torch

from adahop.optim import MAdam, convert_master_weights
from adahop.optim.master import PackedMaster, read_master
from adahop.train.config import TrainConfig
from adahop.train.setup import lr_at

ROWS = [  # (label, optimizer, master, rounding)
    ("adamw fp32", "adamw", "fp32", "nearest"),
    ("m+adam bf16 RNE", "m+adam", "bf16", "nearest"),
    ("adamw fp8 RNE", "adamw", "fp8", "nearest"),
    ("adamw fp8 SR", "adamw", "fp8", "stochastic"),
    ("m+adam fp8 RNE", "m+adam", "fp8", "nearest"),
    ("m+adam fp8 SR", "m+adam", "fp8", "stochastic"),
    ("adamw fp4 RNE", "adamw", "fp4", "nearest"),
    ("adamw fp4 SR", "adamw", "fp4", "stochastic"),
    ("m+adam fp4 RNE", "m+adam", "fp4", "nearest"),
    ("m+adam fp4 SR", "m+adam", "fp4", "stochastic"),
    ("m+adam nvfp4 RNE", "m+adam", "nvfp4", "nearest"),
    ("m+adam nvfp4 SR", "m+adam", "nvfp4", "stochastic"),
]


def scales_of(p) -> torch.Tensor | None:
    return p.parts["scales"].clone() if isinstance(p, PackedMaster) else None


def run(opt_name: str, master: str, rounding: str, *, steps: int, lr: float, mul: float, d_out=256, d_in=512,
        batch=256, seed=0) -> dict:
    torch.manual_seed(seed)
    w0 = torch.randn(d_out, d_in) * 0.02
    teacher = w0 + torch.randn(d_out, d_in) * 0.01
    lin = torch.nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w0)
    convert_master_weights(lin, master)
    p = lin.weight
    zeros0 = (read_master(p) == 0).float().mean().item()
    states = torch.float32 if master == "fp32" else torch.bfloat16
    kw = dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=states, rounding=rounding, seed=seed,
              backend="reference")
    if opt_name == "m+adam":
        opt = MAdam([p], mul_lr_scale=mul, **kw)
    else:
        from adahop.optim import AdamW
        opt = AdamW([p], **kw) if master != "fp32" else torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.95),
                                                                          weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    schedule = TrainConfig(lr=lr, steps=steps, warmup_steps=20, min_lr_ratio=0.1)  # the experiment's schedule
    moved = flips = 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(schedule, step)
        x = torch.randn(batch, d_in, generator=gen)
        loss = ((lin(x.to(p.dtype)).float() - x @ teacher.T) ** 2).mean()
        loss.backward()
        before, sc = read_master(p).clone(), scales_of(p)
        opt.step()
        opt.zero_grad()
        moved += (read_master(p) != before).float().mean().item()
        if sc is not None:
            flips += (scales_of(p) != sc).float().mean().item()
    with torch.no_grad():
        x = torch.randn(4096, d_in, generator=gen)
        final = ((x @ read_master(p).T - x @ teacher.T) ** 2).mean().item()
        start = ((x @ w0.T - x @ teacher.T) ** 2).mean().item()
    return dict(start=start, final=final, moved=moved / steps, flips=flips / steps,
                zeros=(read_master(p) == 0).float().mean().item(), zeros0=zeros0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--mul", type=float, default=10.0, help="M+Adam's --madam-mul-lr")
    ap.add_argument("--only", default="", help="comma-separated substrings of the row labels to run")
    args = ap.parse_args()
    print(f"steps {args.steps}, lr {args.lr}, mul {args.mul}")
    print("| row | start → final loss | weights moved per step | block scales changed per step | zeros start → end |")
    print("|---|---|---|---|---|")
    for label, name, master, rounding in ROWS:
        if args.only and not any(s in label for s in args.only.split(",")):
            continue
        r = run(name, master, rounding, steps=args.steps, lr=args.lr, mul=args.mul)
        print(f"| {label} | {r['start']:.3e} → {r['final']:.3e} | {r['moved']:.4f} | {r['flips']:.4f} | "
              f"{r['zeros0']:.4f} → {r['zeros']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
