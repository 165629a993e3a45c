#!/usr/bin/env python
"""Speed of one optimizer step over a model's parameters (CUDA): adahop's fused multi-tensor update
against ``torch.optim.AdamW(fused=True)`` on the same parameter shapes, side by side.

Rows: torch fused AdamW on FP32 masters and states (16 B/param with the gradient); torch fused AdamW
on BF16 parameters (its states follow the parameter dtype: the same bytes as ours, the issue's
yardstick); adahop's AdamW, SR-AdamW, Kahan-AdamW and M+Adam (each form) on BF16 masters and BF16
states, through ``opt.step()`` (one multi-tensor launch per parameter group, the kept plan);
with ``--per-tensor``, the same rules with one launch per tensor (the round-7 path); with
``--multi-configs``, the multi-tensor kernel at other (elements per program × warps) for AdamW and
the workshop form. Each row: the median over ``--reps`` steps (CUDA events around ``opt.step()``,
then a sync, so host time counts as it does for torch), the host time of one step (launches only,
no sync), the bytes each step must move and the bandwidth that implies, and the time relative to
torch fused AdamW on BF16 parameters (< 1: faster).

Usage: ``python scripts/bench_optim.py [--model llama-125m] [--reps 20] [--per-tensor]
[--multi-configs 1024x4,4096x16] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from adahop.bench.harness import cuda_time_ms
from adahop.models import build_model
from adahop.optim import build_optimizer

HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
RULES = (("adamw", None), ("sr-adamw", None), ("kahan-adamw", None), ("m+adam", "arxiv-relative"), ("m+adam", "arxiv"),
         ("m+adam", "workshop"))


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


def _groups(params):
    # the split a training run makes (adahop.train): matrices decay, vectors do not
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": HP["weight_decay"]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _host_ms(step, reps: int) -> float:
    """Host milliseconds of one ``step()`` (launches return before the GPU is done)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        step()
    host = (time.perf_counter() - t) / reps * 1e3
    torch.cuda.synchronize()
    return host


def _row(name: str, step, opt, params, reps: int, ref_ms: float | None) -> dict:
    ms = cuda_time_ms(step, reps)
    host = _host_ms(step, reps)
    st = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim)
    w = sum(p.numel() * p.element_size() for p in params)
    g = sum(p.grad.numel() * p.grad.element_size() for p in params)
    moved = 2 * w + g + 2 * st  # read + write weights and states, read gradients
    row = dict(name=name, ms=ms, host_ms=host, params=sum(p.numel() for p in params), tensors=len(params),
               bytes_moved=moved, gb_per_s=moved / ms / 1e6, vs_torch_fused_bf16=ms / ref_ms if ref_ms else 1.0)
    print(f"{name:52s} {ms:8.3f} ms  host {host:6.3f} ms  {row['gb_per_s']:7.0f} GB/s  "
          f"x{row['vs_torch_fused_bf16']:.2f}", flush=True)
    return row


def _per_tensor_step(opt):
    """The round-7 path: the same rule and bits, one kernel launch per tensor."""
    from adahop.kernels.optim_step import STATE_NAMES, optim_step
    from adahop.utils import mix_seed

    @torch.no_grad()
    def step():
        index = -1
        for group in opt.param_groups:
            for p in group["params"]:
                index += 1
                st = opt._init_state(p)
                st["step"] += 1
                optim_step(opt.algorithm, p, p.grad, [st[n] for n in STATE_NAMES[opt.algorithm]],
                           opt._scalars(group, st["step"]), rounding=opt.rounding,
                           seed=mix_seed(opt.seed, "optim", st["step"]), stream=index, backend=opt.backend)
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-125m")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--per-tensor", action="store_true", help="also time one launch per tensor (the old path)")
    ap.add_argument("--multi-configs", default="",
                    help="comma-separated BLOCKxWARPS of the multi-tensor kernel to time too, e.g. 1024x4,4096x16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_optim.py times CUDA kernels; run it on a GPU")
    from adahop.kernels import _triton_optim_step as K

    configs = [tuple(int(v) for v in c.split("x")) for c in args.multi_configs.split(",") if c]
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; model {args.model}; "
          f"multi-tensor kernel {K.MULTI_BLOCK}x{K.MULTI_WARPS} (elements per program x warps)")
    rows, ref = [], None
    for dtype, label in ((torch.float32, "fp32 params"), (torch.bfloat16, "bf16 params")):
        params = _params(args.model, dtype)
        opt = torch.optim.AdamW(_groups(params), fused=True, **HP)
        rows.append(_row(f"torch AdamW(fused=True), {label}", opt.step, opt, params, args.reps, ref))
        ref = rows[-1]["ms"] if dtype == torch.bfloat16 else None
        del params, opt
    for r in rows:
        r["vs_torch_fused_bf16"] = r["ms"] / ref
    default = (K.MULTI_BLOCK, K.MULTI_WARPS)
    for name, form in RULES:
        label = f"adahop {name}{'/' + form if form else ''}"
        variants = [("multi-tensor", default)]
        if args.per_tensor:
            variants.append(("per-tensor", None))
        if name == "adamw" or form == "workshop":
            variants += [(f"multi-tensor {b}x{w}", (b, w)) for b, w in configs]
        for how, cfg in variants:
            params = _params(args.model, torch.bfloat16)
            opt = build_optimizer(name, _groups(params), master="bf16", states="bf16",
                                  madam_form=form or "arxiv-relative", **HP)
            if cfg:
                K.MULTI_BLOCK, K.MULTI_WARPS = cfg
            step = opt.step if cfg else _per_tensor_step(opt)
            rows.append(_row(f"{label}, bf16, {how}", step, opt, params, args.reps, ref))
            K.MULTI_BLOCK, K.MULTI_WARPS = default
            del params, opt
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, device=torch.cuda.get_device_name(), torch=torch.__version__,
                           multi_default=list(default), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
