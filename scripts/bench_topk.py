#!/usr/bin/env python
"""OE's index selection on the GPU: ``torch.topk`` of one long vector against adahop's two-pass
:func:`adahop.gemm.top_indices`, each call alone and replayed from a CUDA graph, side by side.

    PYTHONPATH=src python scripts/bench_topk.py [--lengths 768,2048,8192,16384,32768] [--k 64] [--json out.json]

Round 17's llama-125m AdaHOP-Lv2 profile spent 2.74 ms a step in ``sbtopk::gatherTopK``: a top-k of one
vector (OE's row or column norms, up to 16,384 tokens long) runs as a single thread block. Each row
also checks that both pick the same values.
"""

from __future__ import annotations

import argparse
import json

import torch


def graphed_us(fn, calls: int = 100) -> float:
    """Microseconds a call of ``fn()``: ``calls`` calls captured in one CUDA graph, the graph's replays timed by
    :func:`adahop.bench.harness.cuda_graph_time_ms` (median of 5), divided by ``calls``: a call of a few µs
    would otherwise be mostly the replay's own launch."""
    from adahop.bench.harness import cuda_graph_time_ms

    def many():
        for _ in range(calls):
            fn()

    return cuda_graph_time_ms(many, reps=5) * 1e3 / calls


def main(argv=None) -> None:
    from adahop.gemm import top_indices

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="768,2048,4096,8192,16384,32768,65536")
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = []
    print(f"k={a.k}; µs a call, replayed from a CUDA graph")
    print("| length | torch.topk | top_indices | × |")
    print("|---|---|---|---|")
    for n in (int(x) for x in a.lengths.split(",")):
        v = torch.rand(n, device="cuda") ** 4  # norms: positive, skewed
        same = bool(torch.equal(v[top_indices(v, a.k)], torch.topk(v, a.k).values))
        t_ref = graphed_us(lambda: torch.topk(v, a.k).indices)
        t_two = graphed_us(lambda: top_indices(v, a.k))
        rows.append(dict(length=n, k=a.k, topk_us=t_ref, top_indices_us=t_two, same_values=same))
        print(f"| {n} | {t_ref:.1f} | {t_two:.1f} | {t_ref / t_two:.2f} |" + ("" if same else " VALUES DIFFER"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
