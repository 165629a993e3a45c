#!/usr/bin/env python
"""Accuracy of the FP8 row-wise-scaled GEMM (``torch._scaled_mm``) across shapes, against float64.

Operands are exact FP8 E4M3 values in the range the MXFP4 fold produces (E2M1 codes times 2^0..2^-8)
with FP32 row/column scales, so any error is the GEMM's own accumulation. For each shape (M, K, N)
it prints (FP32 output) ‖Δ‖/‖|A|·|B|‖ over several fresh draws, the same for the BF16 tensor
cores on the same (exactly representable) operands, the time of each, and the cuBLAS kernel name.
Used to find the shapes where cuBLAS's FP8 kernel accumulates below FP32 (docs/kernels_notes.md).

    python scripts/diag_gemm.py [--draws 3]
"""

from __future__ import annotations

import argparse

import torch

from adahop.bench import cuda_time_ms
from adahop.kernels.mx_matmul import _fp8_rowwise_mm_impl

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
SHAPES = [  # (M, K, N): fprop/dgrad-like, then wgrad-like (small M·N, long K = tokens), then ragged
    (8192, 4096, 4096), (8192, 4096, 1024), (8192, 14336, 4096), (16384, 2048, 512), (4096, 4096, 4096),
    (4096, 8192, 4096), (1024, 8192, 4096), (1024, 16384, 4096), (512, 16384, 2048), (512, 32768, 2048),
    (2048, 16384, 2048), (1000, 4096, 1000), (1024, 4096, 1024), (1000, 4096, 1008), (1024, 4096, 1008),
    (2048, 4096, 2048), (256, 4096, 256), (64, 8192, 4096),
]


def fp8_operand(rows, k, gen, dev):
    code = E2M1.to(dev)[torch.randint(0, 8, (rows, k), device=dev, generator=gen)]
    sign = torch.randint(0, 2, (rows, k), device=dev, generator=gen) * 2 - 1
    blk = torch.exp2(-torch.randint(0, 9, (rows, k // 32, 1), device=dev, generator=gen).float())
    v = (code * sign).view(rows, k // 32, 32) * blk
    scale = torch.exp2(torch.randint(-20, 20, (rows,), device=dev, generator=gen).float())
    return v.view(rows, k).to(torch.float8_e4m3fn), scale


def kernel_names(fn) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return " | ".join(n[:90] for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=3)
    args = ap.parse_args()
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(torch.seed() % 2**31)
    print("M K N | fp8 rel_ab (max over draws) | bf16-tc rel_ab | fp8 ms | bf16-tc ms | kernel")
    for m, k, n in SHAPES:
        worst = worst_bf = 0.0
        for _ in range(args.draws):
            a, sa = fp8_operand(m, k, gen, dev)
            b, sb = fp8_operand(n, k, gen, dev)
            da, db = a.double() * sa.double()[:, None], b.double() * sb.double()[:, None]
            ref = da @ db.t()
            scale = (da.abs() @ db.abs().t()).norm()
            out = _fp8_rowwise_mm_impl(a, sa, b, sb, torch.float32)
            worst = max(worst, ((out.double() - ref).norm() / scale).item())
            bf = torch.mm(a.bfloat16(), b.bfloat16().t(), out_dtype=torch.float32) * sa[:, None] * sb[None, :]
            worst_bf = max(worst_bf, ((bf.double() - ref).norm() / scale).item())
        t8 = cuda_time_ms(lambda: _fp8_rowwise_mm_impl(a, sa, b, sb, torch.bfloat16))
        a16, b16 = a.bfloat16(), b.bfloat16()
        t16 = cuda_time_ms(lambda: torch.mm(a16, b16.t(), out_dtype=torch.float32))
        names = kernel_names(lambda: _fp8_rowwise_mm_impl(a, sa, b, sb, torch.float32))
        print(f"{m} {k} {n} | {worst:.2e} | {worst_bf:.2e} | "
              f"{t8:.3f} | {t16:.3f} | {names}", flush=True)


if __name__ == "__main__":
    main()
