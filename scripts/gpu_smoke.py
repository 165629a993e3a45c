"""GPU smoke test of every recipe through the real layer (CUDA, bf16 autocast, fast path where a
recipe has one), and fast-vs-reference agreement of the converted model's loss and gradients.

    PYTHONPATH=src python3 scripts/gpu_smoke.py      # exits non-zero on any failure
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import adahop


def tiny(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).cuda()


def run(recipe, backend: str, steps: int = 3):
    r = adahop.get_recipe(recipe)
    if r.calibration is not None:
        r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, steps=1))
    m = adahop.convert_model(tiny(), r, backend=backend)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for i in range(steps):
        ids = torch.randint(0, 1024, (4, 257), device="cuda", generator=g)  # 4 x 256 = 1024 tokens (HALO-2: a power of two)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
        adahop.on_step(m, i + 1)
        losses.append(loss.item())
    return losses, grads


fails = 0
for name in adahop.list_recipes():
    try:
        losses, _ = run(name, "auto")
        ok = all(torch.isfinite(torch.tensor(losses)))
        print(f"{'PASS' if ok else 'FAIL'} {name:<14} losses {['%.4f' % x for x in losses]}", flush=True)
        fails += not ok
    except Exception as e:  # report and go on: the smoke test lists every broken recipe
        fails += 1
        print(f"FAIL {name:<14} {type(e).__name__}: {e}", flush=True)

for name in ("mxfp4", "mxfp4-had", "adahop-lv2"):  # the fast path must not change the numerics
    lf, gf = run(name, "auto")
    lr, gr = run(name, "reference")
    rel = ((gf - gr).norm() / gr.norm()).item()
    ok = abs(lf[-1] - lr[-1]) < 1e-3 * abs(lr[-1]) and rel < 1e-2
    fails += not ok
    print(f"{'PASS' if ok else 'FAIL'} fast vs reference {name}: loss {lf[-1]:.5f} vs {lr[-1]:.5f}, grad rel diff {rel:.2e}", flush=True)
print(f"{fails} failures")
sys.exit(1 if fails else 0)
