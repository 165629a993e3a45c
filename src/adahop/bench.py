"""`adahop bench linear|model`: speed and memory against BF16, measured side by side in one process.

Timing follows the device notes (METHOD.md): CUDA events around the region, warm-up excluded,
median of many repetitions, fresh random (never zero) inputs.

- ``linear``: one layer's forward + backward at the Llama linear shapes, for BF16 ``nn.Linear``,
  the FP8-folded fast path (plain MXFP4, IHT, and IHT with OE-Right on wgrad as AdaHOP-Lv2 gives
  the Column-pattern X), and MXFP4 emulated by dequantize-then-matmul (the reference backend).
- ``model``: end-to-end training tokens/s and peak memory for BF16 and each recipe, eager and
  with ``torch.compile``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

__all__ = ["add_arguments", "run", "bench_linear", "bench_model", "LINEAR_SHAPES"]

#: (name, K=in_features, N=out_features) of the linear layers of each model.
LINEAR_SHAPES = {
    "llama3.2-1b": [("q/o_proj", 2048, 2048), ("k/v_proj", 2048, 512), ("gate/up_proj", 2048, 8192), ("down_proj", 8192, 2048)],
    "llama3.1-8b": [("q/o_proj", 4096, 4096), ("k/v_proj", 4096, 1024), ("gate/up_proj", 4096, 14336), ("down_proj", 14336, 4096)],
}


def _time(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs (CUDA events), after 3 warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _layer(kind: str, k: int, n: int, device) -> torch.nn.Module:
    from .nn import convert_model, get_controller
    from .patterns import Plan

    lin = torch.nn.Linear(k, n, bias=False, device=device)
    if kind == "bf16":
        return lin
    wrapper = torch.nn.Sequential(lin)
    recipe, backend, strategies = {
        "mxfp4 fast": ("mxfp4", "auto", None),
        "iht fast": ("mxfp4-had", "auto", None),
        "adahop-lv2 fast (iht, wgrad oe_right)": ("adahop-lv2", "auto", {"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_right"}),
        "mxfp4 emulated (dequantize + matmul)": ("mxfp4", "reference", None),
    }[kind]
    plan = Plan(table="lv2", layers={"0": {**strategies, "x": "C", "w": "N", "dy": "N"}}) if strategies else None
    convert_model(wrapper, recipe, plan=plan, backend=backend)
    get_controller(wrapper).on_step(10**6)
    return wrapper


def bench_linear(models=("llama3.1-8b",), tokens=(8192, 16384), reps: int = 20) -> list[dict]:
    """Forward+backward milliseconds, TFLOP/s and ratio to BF16 for each layer kind and shape."""
    from .nn import LowPrecisionLinear

    dev = torch.device("cuda")
    kinds = ["bf16", "mxfp4 fast", "iht fast", "adahop-lv2 fast (iht, wgrad oe_right)", "mxfp4 emulated (dequantize + matmul)"]
    rows = []
    for model in models:
        for t in tokens:
            for name, k, n in LINEAR_SHAPES[model]:
                base = None
                for kind in kinds:
                    layer = _layer(kind, k, n, dev)
                    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    dy = torch.randn(t, n, device=dev, dtype=torch.bfloat16)

                    def step():
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            y = layer(x)
                        y.backward(dy)

                    ms = _time(step, reps if "emulated" not in kind else max(3, reps // 4))
                    flops = 6 * t * k * n
                    lp = next((m for m in layer.modules() if isinstance(m, LowPrecisionLinear)), None)
                    saved = lp.saved_bytes if lp is not None else (t * k + n * k) * 2
                    base = base or ms
                    rows.append(dict(model=model, layer=name, tokens=t, K=k, N=n, kind=kind, ms=ms,
                                     tflops=flops / ms / 1e9, speedup_vs_bf16=base / ms, saved_bytes=saved,
                                     saved_ratio_vs_bf16=(t * k + n * k) * 2 / saved))
                    del layer, x, dy
                    torch.cuda.empty_cache()
    return rows


def bench_model(model: str = "llama3.2-1b", *, recipes=("bf16", "adahop-lv2", "mxfp4"), seq_len: int = 4096, batch: int = 4,
                layers: int | None = None, steps: int = 6, compile_modes=(False, True)) -> list[dict]:
    """Training tokens/s (median step time after warm-up) and peak memory, same process for all."""
    import torch.nn.functional as F

    from .models import build_model
    from .nn import convert_model, on_step
    from .recipes import get_recipe

    dev = torch.device("cuda")
    rows = []
    for compiled in compile_modes:
        for recipe in recipes:
            torch.manual_seed(0)
            m = build_model(model, vocab_size=32768, max_seq_len=seq_len)
            if layers is not None:
                m.model.layers = m.model.layers[:layers]
                m.config.num_hidden_layers = layers
            m = m.to(dev)
            r = get_recipe(recipe)
            if r.calibration is not None:
                r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, steps=2))
            convert_model(m, r)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
            fwd = torch.compile(m) if compiled else m
            ids = torch.randint(0, 32768, (batch, seq_len + 1), device=dev)

            def step(i):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = fwd(input_ids=ids[:, :-1]).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                on_step(m, i + 1)

            for i in range(4):  # calibration (2 steps) + compile warm-up
                step(i)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for i in range(4, 4 + steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step(i)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            ms = statistics.median(times)
            rows.append(dict(model=model, layers=layers or m.config.num_hidden_layers, recipe=recipe, compiled=compiled,
                             step_ms=ms, tok_per_s=batch * seq_len / ms * 1e3, peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30))
            del m, opt, fwd
            torch.cuda.empty_cache()
    base = {c: next((r["tok_per_s"] for r in rows if r["recipe"] == "bf16" and r["compiled"] == c), None) for c in compile_modes}
    for r in rows:
        r["vs_bf16"] = r["tok_per_s"] / base[r["compiled"]] if base[r["compiled"]] else None
    return rows


def _print(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``adahop bench linear`` and ``adahop bench model``."""
    sub = p.add_subparsers(dest="bench_cmd", required=True)
    lin = sub.add_parser("linear", help="one linear layer, forward + backward")
    lin.add_argument("--shapes", default="llama3.1-8b", help="comma-separated: llama3.2-1b, llama3.1-8b")
    lin.add_argument("--tokens", default="8192,16384")
    lin.add_argument("--reps", type=int, default=20)
    lin.add_argument("--json", help="write the rows here")
    mod = sub.add_parser("model", help="end-to-end training step")
    mod.add_argument("--model", default="llama3.2-1b")
    mod.add_argument("--layers", type=int, help="keep only the first N blocks (e.g. 4 with llama3.1-8b)")
    mod.add_argument("--recipes", default="bf16,adahop-lv2,mxfp4")
    mod.add_argument("--seq-len", type=int, default=4096)
    mod.add_argument("--batch-size", type=int, default=4)
    mod.add_argument("--steps", type=int, default=6)
    mod.add_argument("--no-compile", action="store_true", help="eager only")
    mod.add_argument("--json", help="write the rows here")


def run(args) -> None:
    """Run the chosen benchmark, print its table and optionally write JSON. ValueError without CUDA."""
    if not torch.cuda.is_available():
        raise ValueError("adahop bench needs a CUDA GPU; the CPU reference path is for correctness, not speed")
    if args.bench_cmd == "linear":
        rows = bench_linear(tuple(args.shapes.split(",")), tuple(int(t) for t in args.tokens.split(",")), args.reps)
    else:
        rows = bench_model(args.model, recipes=tuple(args.recipes.split(",")), seq_len=args.seq_len, batch=args.batch_size,
                           layers=args.layers, steps=args.steps, compile_modes=(False,) if args.no_compile else (False, True))
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
