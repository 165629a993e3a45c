#!/usr/bin/env python
"""Time of `adahop ptq`'s calibration pass against running the model up to each block (its earlier form).

    PYTHONPATH=src python scripts/bench_calibration.py [--model llama-350m] [--batches 4] [--batch-size 2] [--seq-len 256]

Both take every block's per-layer Hessians ``E[x xᵀ]`` over the same random-id batches, with a quantizer that
leaves the weights as they are (already BF16 values, as quantize_model writes them back), so only the calibration
is timed: :func:`adahop.ptq.calibrate.quantize_model`
(one recording forward, then each block alone: ~3L block forwards) and, per block, the whole model from its
embedding stopped after that block (~L²/2 block forwards). Prints both times and whether the Hessians are equal
to the last bit (tests/test_ptq_gptq.py checks that too, with quantized blocks).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from adahop.models import build_model
from adahop.ptq.calibrate import block_linears, decoder_blocks, quantize_model


class _Stop(Exception):
    pass


@torch.no_grad()
def whole_model_hessians(model, batches) -> dict[str, torch.Tensor]:
    """Every block's Hessians the earlier way: the model from its embedding, stopped after the block."""
    prefix, blocks = decoder_blocks(model)
    out = {}
    for i, block in enumerate(blocks):
        sums, count = {}, {}

        def grab(name):
            def hook(_m, args):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                if name not in sums:  # accumulated as the calibration does (addmm_), so that equal inputs give equal bits
                    sums[name], count[name] = torch.zeros(x.shape[1], x.shape[1]), 0
                sums[name].addmm_(x.T, x)
                count[name] += x.shape[0]
            return hook

        def stop(*_):
            raise _Stop

        hooks = [lin.register_forward_pre_hook(grab(n)) for n, lin in block_linears(block)]
        hooks.append(block.register_forward_hook(stop))
        for ids in batches:
            try:
                model(input_ids=ids, use_cache=False)
            except _Stop:
                pass
        for h in hooks:
            h.remove()
        out.update({f"{prefix}.{i}.{n}": v / count[n] for n, v in sums.items()})
    return out


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
    with torch.no_grad():  # quantize_model writes each weight back rounded to BF16: start there, so nothing changes
        for blk in decoder_blocks(model)[1]:
            for _, lin in block_linears(blk):
                lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    batches = [torch.randint(0, 512, (a.batch_size, a.seq_len)) for _ in range(a.batches)]
    t0 = time.perf_counter()
    ref = whole_model_hessians(model, batches)
    t_ref = time.perf_counter() - t0
    seen = {}

    def keep(name, w, h):
        seen[name] = h
        return SimpleNamespace(weight=w)

    t0 = time.perf_counter()
    quantize_model(model, batches, keep, device=torch.device("cpu"), log=lambda s: None)
    t_new = time.perf_counter() - t0
    same = seen.keys() == ref.keys() and all(torch.equal(seen[k], ref[k]) for k in ref)
    blocks = len(decoder_blocks(model)[1])
    print(f"{a.model} ({blocks} blocks), {a.batches * a.batch_size * a.seq_len:,} tokens: whole model up to each block "
          f"{t_ref:.1f} s, block by block {t_new:.1f} s ({t_ref / t_new:.1f}x); Hessians equal to the last bit: {same}")


if __name__ == "__main__":
    main()
