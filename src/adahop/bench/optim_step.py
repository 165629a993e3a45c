#!/usr/bin/env python
"""Speed of one optimizer step over a model's parameters (CUDA): adahop's fused update (one Triton
launch per tensor) against ``torch.optim.AdamW(fused=True)`` on the same parameter shapes.

Rows: torch fused AdamW on FP32 masters and states (today's reference, 16 B/param with the
gradient); torch fused AdamW on BF16 parameters (its states follow the parameter dtype: the same
bytes as ours); adahop's AdamW, SR-AdamW, Kahan-AdamW and M+Adam (each form) on BF16 masters and
BF16 states. Each row is the median over ``--reps`` steps (CUDA events, 3 warm-ups), with the
bytes each step must move and the bandwidth that implies.

Usage: ``python scripts/bench_optim.py [--model llama-125m] [--reps 20] [--json out.json]``.
The issue's target: the fused update at least as fast as ``AdamW(fused=True)`` on the same parameters.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from adahop.bench.harness import cuda_time_ms
from adahop.models import build_model
from adahop.optim import build_optimizer


def _params(model_name: str, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(model_name, vocab_size=32768, max_seq_len=1024)
    params = []
    for p in model.parameters():
        q = torch.nn.Parameter(torch.randn(p.shape, device="cuda", dtype=dtype) * 0.02)
        q.grad = torch.randn(p.shape, device="cuda", dtype=dtype) * 1e-3
        params.append(q)
    return params


def _row(name: str, opt, params, reps: int) -> dict:
    ms = cuda_time_ms(opt.step, reps)
    st = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim)
    w = sum(p.numel() * p.element_size() for p in params)
    g = sum(p.grad.numel() * p.grad.element_size() for p in params)
    moved = 2 * w + g + 2 * st  # read + write weights and states, read gradients
    row = dict(name=name, ms=ms, params=sum(p.numel() for p in params), bytes_moved=moved, gb_per_s=moved / ms / 1e6)
    print(f"{name:42s} {ms:8.3f} ms  {row['gb_per_s']:7.0f} GB/s", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-125m")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_optim.py times CUDA kernels; run it on a GPU")
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; model {args.model}")
    rows = []
    hp = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for dtype, label in ((torch.float32, "fp32 params"), (torch.bfloat16, "bf16 params")):
        params = _params(args.model, dtype)
        rows.append(_row(f"torch AdamW(fused=True), {label}", torch.optim.AdamW(params, fused=True, **hp), params, args.reps))
        del params
    for name, form in (("adamw", None), ("sr-adamw", None), ("kahan-adamw", None), ("m+adam", "arxiv-relative"),
                       ("m+adam", "arxiv"), ("m+adam", "workshop")):
        params = _params(args.model, torch.bfloat16)
        opt = build_optimizer(name, params, master="bf16", states="bf16", madam_form=form or "arxiv-relative", **hp)
        rows.append(_row(f"adahop {name}{'/' + form if form else ''}, bf16 master+states", opt, params, args.reps))
        del params, opt
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
