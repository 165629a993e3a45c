#!/usr/bin/env python
"""Time of `adahop ptq`'s calibration pass against running the model up to each block (its earlier form).

    PYTHONPATH=src python scripts/bench_calibration.py [--model llama-350m] [--batches 4] [--batch-size 2] [--seq-len 256]

Both take every block's per-layer Hessians ``E[x xᵀ]`` over the same random-id batches, with a quantizer that
leaves the weights as they are (already BF16 values, as quantize_model writes them back), so only the calibration
is timed: :func:`adahop.ptq.calibrate.quantize_model` (one recording forward, then each block alone: ~3L block
forwards) and, per block, :func:`adahop.ptq.calibrate.whole_model_hessians` (the model from its embedding stopped
after that block: ~L²/2). Prints both times and whether the Hessians are equal to the last bit
(tests/test_ptq_gptq.py checks that too, with quantized blocks).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from adahop.models import build_model
from adahop.ptq.calibrate import block_linears, decoder_blocks, quantize_model, whole_model_hessians


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-350m")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build_model(a.model, vocab_size=512, max_seq_len=a.seq_len).eval()
    prefix, blocks = decoder_blocks(model)
    with torch.no_grad():  # quantize_model writes each weight back rounded to BF16: start there, so nothing changes
        for blk in blocks:
            for _, lin in block_linears(blk):
                lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    batches = [torch.randint(0, 512, (a.batch_size, a.seq_len)) for _ in range(a.batches)]
    t0 = time.perf_counter()
    ref = {f"{prefix}.{i}.{n}": h for i, b in enumerate(blocks)
           for n, h in whole_model_hessians(model, b, batches, torch.device("cpu")).items()}
    t_ref = time.perf_counter() - t0
    seen = {}

    def keep(name, w, h):
        seen[name] = h
        return SimpleNamespace(weight=w)

    t0 = time.perf_counter()
    quantize_model(model, batches, keep, device=torch.device("cpu"), log=lambda s: None)
    t_new = time.perf_counter() - t0
    same = seen.keys() == ref.keys() and all(torch.equal(seen[k], ref[k]) for k in ref)
    print(f"{a.model} ({len(blocks)} blocks), {a.batches * a.batch_size * a.seq_len:,} tokens: whole model up to each block "
          f"{t_ref:.1f} s, block by block {t_new:.1f} s ({t_ref / t_new:.1f}x); Hessians equal to the last bit: {same}")


if __name__ == "__main__":
    main()
