#!/usr/bin/env python
"""Does a compiled converted model compute the eager model's gradients? (GPU check)

    PYTHONPATH=src python scripts/check_compiled_grads.py [--model llama-20m] [--recipes adahop-lv2,mxfp4-had]
    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/check_compiled_grads.py --device cpu --backend triton --model llama-tiny

For each recipe: build the model, calibrate eagerly (2 steps) where the recipe calibrates, then
run one step eagerly and one step under ``torch.compile`` from the same weights and data, under
bf16 autocast, and print the loss, how many parameters got a nonzero gradient, and the relative
gradient error of compiled against eager. Variants: ``--force-outputs all`` makes every operand
write codes and FP8 (isolates the quantizer's ``outputs=``).

``--projection`` checks the stochastic recipes instead (issue 24 §0): one converted layer, the mean
dW over ``--draws`` fresh draws projected on the exact dYᵀX, eager and compiled; unbiased is 1
(before the fix tseng's compiled projection was ~0).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
import torch.nn.functional as F

import adahop.gemm as gemm_mod
from adahop.models import build_model
from adahop.nn import convert_model, on_step, seed_compiled_rng
from adahop.recipes import get_recipe


def one_step(model, fwd, ids):
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        logits = fwd(input_ids=ids[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def check(model_name: str, recipe: str, device: str = "cuda", backend: str = "auto", compile_backend: str = "inductor",
          batch: int = 4, seq_len: int = 256) -> None:
    torch.manual_seed(0)
    m = build_model(model_name, vocab_size=4096, max_seq_len=256).to(device)
    r = get_recipe(recipe)
    if r.calibration is not None:
        r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, steps=2))
    if not r.is_bf16:
        convert_model(m, r, backend=backend)
    ids = torch.randint(0, 4096, (batch, seq_len + 1), device=device)
    for i in range(2):  # calibration (eager), then the plan freezes
        one_step(m, m, ids)
        if not r.is_bf16:  # a BF16 model is left unconverted: no controller to step
            on_step(m, i + 1)
    state = copy.deepcopy(m.state_dict())
    le, ge = one_step(m, m, ids)
    m.load_state_dict(state)
    lc, gc = one_step(m, torch.compile(m, backend=compile_backend), ids)
    names = [n for n, _ in m.named_parameters()]
    nz = lambda g: sum(1 for n in names if n in g and bool(g[n].any()))  # noqa: E731
    err = max(((gc[n] - ge[n]).norm() / ge[n].norm().clamp_min(1e-30)).item() if n in gc else float("inf")
              for n in names if n in ge)
    missing = [n for n in names if n in ge and (n not in gc or not gc[n].any())][:4]
    print(f"{model_name} {recipe}: loss eager {le:.5f} compiled {lc:.5f}; params with grad eager {nz(ge)} compiled "
          f"{nz(gc)} of {len(names)}; max rel grad err {err:.3g}; missing e.g. {missing}", flush=True)
    torch.compiler.reset()


def projection(recipe: str, device: str, backend: str, compile_backend: str, draws: int = 32,
               tokens: int = 256, k: int = 512) -> tuple[float, float]:
    """(eager, compiled) projection of the mean dW over ``draws`` on dYᵀX for one [k, k] layer."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(k, k, bias=False)).to(device)
    convert_model(m, recipe, backend=backend)
    x0, dy = torch.randn(tokens, k, device=device), torch.randn(tokens, k, device=device)
    exact = dy.t() @ x0
    out = []
    for fn in (m, torch.compile(m, fullgraph=True, backend=compile_backend)):
        acc = torch.zeros_like(exact)
        for i in range(draws):
            on_step(m, 100 + i)
            seed_compiled_rng(m, 100 + i)
            m.zero_grad(set_to_none=True)
            fn(x0.clone().requires_grad_()).backward(dy)
            acc += m[0].weight.grad.float()
        mean = acc / draws
        out.append(((mean * exact).sum() / exact.square().sum()).item())
    torch.compiler.reset()
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-20m")
    ap.add_argument("--recipes", default="bf16,mxfp4-had,adahop-lv2")
    ap.add_argument("--force-outputs", default=None, help="'all': every operand writes codes and FP8")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu with --backend triton under TRITON_INTERPRET=1")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend: inductor, aot_eager, eager")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--projection", action="store_true", help="SR recipes: mean dW projected on dY^T X, eager and compiled")
    ap.add_argument("--draws", type=int, default=32)
    args = ap.parse_args()
    if args.projection:
        bad = 0
        for recipe in args.recipes.split(","):
            e, c = projection(recipe, args.device, args.backend, args.compile_backend, args.draws)
            ok = abs(e - 1) < 0.05 and abs(c - 1) < 0.05
            bad += not ok
            print(f"projection {recipe}: eager {e:.4f} compiled ({args.compile_backend}) {c:.4f} {'ok' if ok else 'FAIL'}", flush=True)
        raise SystemExit(1 if bad else 0)
    if args.force_outputs:
        orig = gemm_mod._quantize

        def forced(t, axis, op, tr, signs, generator, backend, outputs="all", zero_rows=None):
            return orig(t, axis, op, tr, signs, generator, backend, args.force_outputs, zero_rows)

        gemm_mod._quantize = forced
    for recipe in args.recipes.split(","):
        check(args.model, recipe, args.device, args.backend, args.compile_backend, args.batch, args.seq_len)


if __name__ == "__main__":
    main()
