#!/usr/bin/env python
"""How long torch.compile takes to trace a frozen converted model, per form of its layers (issue 18 item 4).

    PYTHONPATH=src python scripts/dynamo_trace_time.py [--model llama-tiny] [--recipe adahop-lv2]
        [--forms opaque,traced] [--backend eager] [--device cpu]

Builds ``--model`` (vocabulary 512, 2 × 32 tokens), converts it to ``--recipe``, freezes its plan
with 2 eager calibration steps, then for each form of ``adahop.nn.opaque.set_compiled_layers``
times the first compiled forward + backward (``torch.compile(model, backend=--backend)``; ``eager``
is dynamo alone, ``aot_eager`` adds AOTAutograd, ``inductor`` everything) and the second one, and
counts the frames dynamo compiled. One process, one model, ``torch.compiler.reset()`` between forms.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--recipe", default="adahop-lv2")
    ap.add_argument("--forms", default="opaque,traced")
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from torch._dynamo.utils import counters

    from adahop.models import build_model
    from adahop.nn import LowPrecisionLinear, convert_model, on_step
    from adahop.nn.opaque import set_compiled_layers
    from adahop.recipes import get_recipe

    torch.manual_seed(0)
    m = build_model(args.model, vocab_size=512, max_seq_len=64).to(args.device)
    r = get_recipe(args.recipe)
    if r.calibration is not None:
        r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, steps=2))
    convert_model(m, r)
    ids = torch.randint(0, 512, (2, 33), device=args.device)

    def step(f):
        out = f(input_ids=ids[:, :-1], use_cache=False).logits
        F.cross_entropy(out.float().flatten(0, 1), ids[:, 1:].flatten()).backward()
        if args.device == "cuda":
            torch.cuda.synchronize()

    for i in range(2):  # calibration, eager; the plan freezes after step 2
        step(m)
        on_step(m, i + 1)
    n = sum(isinstance(x, LowPrecisionLinear) for x in m.modules())
    for form in args.forms.split(","):
        prev = set_compiled_layers(form)
        try:
            torch.compiler.reset()
            counters.clear()
            f = torch.compile(m, backend=args.backend)
            t0 = time.perf_counter()
            step(f)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            step(f)
            second = time.perf_counter() - t0
        finally:
            set_compiled_layers(prev)
        print(f"{args.model} {args.recipe} ({n} converted linears), layers {form}, backend {args.backend}: "
              f"first compiled step {first:.1f} s, second {second:.2f} s, frames {counters['frames']['total']}")


if __name__ == "__main__":
    main()
