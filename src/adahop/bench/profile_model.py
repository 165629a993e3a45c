#!/usr/bin/env python
"""Where a training step of ``adahop bench model`` spends device time, and what that allows.

    PYTHONPATH=src python scripts/profile_model.py --model llama3.1-8b --layers 4 --batch-size 2 \\
        --recipes bf16,adahop-lv2 --modes compiled [--json out.json]

For each recipe and mode: 5 warm-up steps (calibration, compile), then 3 profiled steps
(torch.profiler, CUDA kernels only). Kernels are put in classes by name: GEMMs (BF16 and FP8
cuBLAS), attention, the fused quantizer and fold (ours), OE's top-k/gather/scatter, the optimizer,
and the rest (norms, activations, casts, loss: Inductor's fused kernels under compile).

For the BF16 recipe it then splits the GEMM time between the converted linear layers and the LM
head (which stays BF16, DESIGN.md §3) in proportion to their FLOPs, and prints the end-to-end
speedup that a linear-layer speedup ``r`` allows (Amdahl): ``T / (T - L + L / r)``, where ``T`` is
the step's kernel time (the sum over its kernels; the step's wall time is a little longer) and ``L``
the linear layers' GEMM time. That says which e2e target a layer speedup can
reach (`docs/benchmarks_history.md`, round 6).
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from adahop.bench.harness import model_step
from adahop.models import model_config

#: (class, pattern on the kernel name), first match wins
CLASSES = [
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("GEMM FP8", r"qqtst|qqsss|_qq|f8f8|e4m3"),
    ("GEMM BF16", r"nvjet|gemm|cutlass|xmma|sm90_|sm80_|ampere_|cublas|^aten::(mm|addmm|bmm)$"),  # aten: --device cpu
    ("quantize + fold (adahop)", r"_mx_quantize|_mx_amax|_fold_kernel"),
    ("OE top-k / gather / scatter", r"topk|TopK|radixSort|index_copy|index_elementwise|scatter_gather|gatherTopK"),
    ("optimizer", r"adam|Adam"),
]


def classify(name: str) -> str:
    for cls, pat in CLASSES:
        if re.search(pat, name):
            return cls
    return "other (norms, activations, casts, loss, ...)"


def linear_and_head_flops(model: str, layers: int | None, tokens: int) -> tuple[float, float]:
    """Training FLOPs (forward + backward = 6·params·tokens) of the converted linears and of the LM head."""
    cfg = model_config(model, vocab_size=32768, max_seq_len=4096)
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_block = 2 * h * h + 2 * h * kv + 3 * h * i  # q, o; k, v; gate, up, down
    n = layers or cfg.num_hidden_layers
    return 6.0 * per_block * n * tokens, 6.0 * h * cfg.vocab_size * tokens


def e2e_speedup(total: float, linear: float, r: float) -> float:
    """End-to-end speedup when ``linear`` of a step's ``total`` time runs ``r``× faster (Amdahl)."""
    return total / (total - linear + linear / r)


def linear_speedup_needed(total: float, linear: float, e2e: float) -> float:
    """The linear-layer speedup giving an end-to-end ``e2e``; inf when even free linears fall short."""
    rest = total - linear
    return linear / (total / e2e - rest) if total / e2e > rest else float("inf")


def profile_row(model, recipe, mode, seq_len, batch, layers, steps=3, device="cuda") -> dict:
    _, step = model_step(model, recipe, mode, seq_len, batch, layers, device)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(5):
        step(i)
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for i in range(5, 5 + steps):
            step(i)
        sync()
    step_ms = (time.perf_counter() - t0) * 1e3 / steps  # wall time under the profiler (a little above bench model's)
    per_class, kernels = {}, {}
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            c = classify(e.key)
            per_class[c] = per_class.get(c, 0.0) + us / 1e3 / steps
            kernels[e.key] = (us / 1e3 / steps, c)
    row = dict(model=model, layers=layers, recipe=recipe, mode=mode, step_ms=step_ms,
               kernel_ms=sum(per_class.values()), classes=per_class,
               top=sorted(((k[:100], ms, c) for k, (ms, c) in kernels.items()), key=lambda t: -t[1])[:25])
    if recipe == "bf16":
        f_lin, f_head = linear_and_head_flops(model, layers, seq_len * batch)
        gemm = per_class.get("GEMM BF16", 0.0)
        lin = gemm * f_lin / (f_lin + f_head)
        t = row["kernel_ms"]
        row.update(linear_gemm_ms=lin, head_gemm_ms=gemm - lin, linear_share=lin / t,
                   e2e_if_linear_x={str(r): e2e_speedup(t, lin, r) for r in (1.2, 1.45, 1.6, 1.78, 2.0)},
                   linear_x_needed={str(e): linear_speedup_needed(t, lin, e) for e in (1.2, 1.3)})
    return row


def show(row: dict) -> None:
    print(f"\n## {row['model']} ({row['layers'] or 'all'} blocks) {row['recipe']} {row['mode']}: "
          f"step {row['step_ms']:.1f} ms, kernels {row['kernel_ms']:.1f} ms")
    for c, ms in sorted(row["classes"].items(), key=lambda kv: -kv[1]):
        print(f"  {ms:9.2f} ms  {ms / row['kernel_ms']:6.1%}  {c}")
    if "linear_gemm_ms" in row:
        print(f"  BF16 GEMMs split by FLOPs: linear layers {row['linear_gemm_ms']:.2f} ms "
              f"({row['linear_share']:.1%} of kernel time), LM head {row['head_gemm_ms']:.2f} ms")
        print("  e2e speedup if the linear layers ran r x faster: "
              + ", ".join(f"r={r}: {v:.3f}" for r, v in row["e2e_if_linear_x"].items()))
        print("  linear-layer speedup needed for an e2e of: "
              + ", ".join(f"{e}x: {v:.2f}" for e, v in row["linear_x_needed"].items()))
    print("  top kernels:")
    for k, ms, c in row["top"][:12]:
        print(f"    {ms:8.2f} ms  {c[:12]:12s}  {k[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--recipes", default="bf16,adahop-lv2")
    ap.add_argument("--modes", default="compiled", help="of eager, compiled, compiled+cudagraphs, auto (what adahop train --compile runs)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (CPU op times, tiny models)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profile_model.py needs a CUDA GPU (or --device cpu for a dry run)")
    rows = []
    for mode in args.modes.split(","):
        for recipe in args.recipes.split(","):
            rows.append(profile_row(args.model, recipe, mode, args.seq_len, args.batch_size, args.layers, device=args.device))
            show(rows[-1])
            torch.compiler.reset()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            if args.json:  # a run cut short keeps the finished rows
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
