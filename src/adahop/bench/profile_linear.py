#!/usr/bin/env python
"""Where a converted linear's forward + backward spends device time: torch.profiler kernel table.

    PYTHONPATH=src python scripts/profile_linear.py [--shape down_proj] [--tokens 8192] [--kinds ...]

For each layer kind of ``adahop bench linear`` (BF16, plain MXFP4, IHT, AdaHOP-Lv2 with wgrad
OE-Right), runs 3 warm-up steps and then profiles 5, and prints the kernels by device time per
step (µs), so a benchmark's gap to BF16 can be attributed to quantization, GEMMs, OE and glue.
"""

from __future__ import annotations

import argparse
import torch
from torch.profiler import ProfilerActivity, profile

from adahop.bench.harness import LINEAR_SHAPES, layer_step

KINDS = ["bf16", "mxfp4 fast", "iht fast", "adahop-lv2 fast (iht, wgrad oe_right)"]


def profile_kind(kind: str, t: int, k: int, n: int, steps: int = 5, top: int = 14) -> None:
    _, step = layer_step(kind, t, k, n, torch.device("cuda"))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            name = e.key if len(e.key) < 90 else e.key[:87] + "..."
            per_kernel[name] = [us, e.count]
    total = sum(v[0] for v in per_kernel.values()) / steps
    print(f"\n## {kind}: {total:.0f} us of kernels per step (T={t}, K={k}, N={n})")
    for name, (us, calls) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us / steps:9.1f} us  {calls // steps:3d}x  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--shape", default="down_proj,gate/up_proj", help="comma-separated layer names of LINEAR_SHAPES")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--kinds", default=";".join(KINDS), help="';'-separated layer kinds of adahop bench linear")
    args = ap.parse_args()
    for name, k, n in LINEAR_SHAPES[args.model]:
        if name in args.shape.split(","):
            print(f"\n# {args.model} {name}")
            for kind in args.kinds.split(";"):
                profile_kind(kind, args.tokens, k, n)


if __name__ == "__main__":
    main()
