#!/usr/bin/env python
"""Per-parameter gradient norms of one training step of a converted model, fast path vs reference.

    python scripts/diag_grads.py --recipe tseng --model llama-60m [--tokens 16384]

Prints the largest ratios ‖grad_fast‖ / ‖grad_reference‖ over the parameters: a fast path that
agrees with its reference stays near 1 everywhere (stochastic rounding differs by ~1e-2).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from adahop.models import build_model
from adahop.nn import convert_model, get_controller


def step_grads(model_name: str, recipe: str, backend: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    m = build_model(model_name, vocab_size=50257, max_seq_len=ids.shape[1]).to(ids.device)
    convert_model(m, recipe, backend=backend)
    ctl = get_controller(m)
    if ctl.calibrating:
        ctl.on_step(ctl.recipe.calibration.steps)  # skip calibration: the default plan of the table
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        logits = m(input_ids=ids[:, :-1]).logits
    F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).backward()
    return {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tseng")
    ap.add_argument("--model", default="llama-60m")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.randint(0, 50257, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(0)).to(dev)
    fast, ref = (step_grads(args.model, args.recipe, be, ids) for be in ("auto", "reference"))
    rows = sorted(((fast[n].norm() / ref[n].norm()).item(), n, fast[n].norm().item(), ref[n].norm().item()) for n in ref)
    print(f"{args.recipe}: total grad norm fast {sum(v[2] ** 2 for v in rows) ** 0.5:.4g}, reference {sum(v[3] ** 2 for v in rows) ** 0.5:.4g}")
    for r, n, a, b in rows[-args.top:][::-1]:
        print(f"  {n:45s} fast {a:.4g}  reference {b:.4g}  ratio {r:.4g}")


if __name__ == "__main__":
    main()
