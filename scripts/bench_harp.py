"""Time HARP's per-layer fitting (`adahop.ptq.fit.fit_harp`) at a model's linear shapes (issue 22).

    python scripts/bench_harp.py --model llama-350m [--steps 100] [--bits 2] [--device cuda] [--json OUT]

For each distinct (out, in) shape of the model's decoder linears, one fit on a random weight and a
Hessian with a few loud input channels (the structure incoherence processing is for) runs ``--steps``
Adam steps after 5 untimed ones; the table gives ms per step, the seconds a layer takes at the paper's
1200 steps, and the model's whole HARP fitting time (every layer, at 1200 steps), the part of `adahop ptq
--method harp-*` that the issue's "llama-350m end to end in under 10 minutes" target is mostly about.
On CUDA each shape runs twice from the same start, eager and with its steps replayed from a CUDA graph
(`fit_harp(cuda_graph=...)`, the default on a GPU), and the table gives both times. Then a short fit of
``--check-steps`` steps in each mode: their final losses must agree to ``--graph-tol`` (exit 1 past it). Short,
because the fit's target is a rounding: over long fits any float-rounding difference grows into another path.
Last on CUDA, one block's shapes fitted side by side as `adahop ptq` fits them (`fit_harp_groups`: each shape's
graph replayed on its own stream): ms per step of the whole block against the shapes one after another, the
whole model's fitting time at that rate, and a short grouped fit's losses against each group's own fit.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch

from adahop.models import PRESETS
from adahop.ptq.fit import FitOptions, fit_harp_groups, fit_harp_many
from adahop.ptq.grids import make_grid
from adahop.ptq.incoherence import TwoSided
from adahop.ptq.rotation import HARPRotation


def linear_shapes(model: str) -> Counter:
    """``Counter({(out, in): layers})`` of the decoder linears of a preset (q, k, v, o, gate, up, down)."""
    c = PRESETS[model]
    d, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    shapes = [(c["num_attention_heads"] * hd, d), (kv, d), (kv, d), (d, c["num_attention_heads"] * hd), (f, d), (f, d), (d, f)]
    return Counter({s: k * layers for s, k in Counter(shapes).items()})


def make_group(m: int, n: int, layers: int, device) -> tuple[list, list, callable]:
    """``layers`` random weights ``[m, n]``, Hessians with a few loud input channels (the structure incoherence
    processing is for), and a function giving fresh RHT-start rotations with the same signs each call."""
    g = torch.Generator().manual_seed(0)
    ws, hs = [], []
    for _ in range(layers):
        ws.append((torch.randn(m, n, generator=g) * 0.02).to(device))
        x = torch.randn(4 * n, n, generator=g)
        x[:, : max(1, n // 256)] *= 20  # a few loud channels
        hs.append((x.T @ x / x.shape[0]).to(device))

    def rotations():
        gs = torch.Generator().manual_seed(1)
        return [TwoSided.random_signs(HARPRotation(m).to(device), HARPRotation(n).to(device), generator=gs, device=device)
                for _ in range(layers)]

    return ws, hs, rotations


def time_fit(m: int, n: int, steps: int, grid, device, cuda_graph: bool = False, layers: int = 1) -> dict:
    """One fit of ``layers`` layers of shape ``[m, n]`` together (as `adahop ptq` fits a block's layers of one
    shape); ms per step of that fit, and the mean proxy loss at its start and end."""
    ws, hs, rotations = make_group(m, n, layers, device)
    fit_harp_many(ws, hs, rotations(), grid, FitOptions(steps=5), cuda_graph=cuda_graph)  # warm-up: allocator, solver handles
    rs = fit_harp_many(ws, hs, rotations(), grid, FitOptions(steps=steps), cuda_graph=cuda_graph)
    return {"shape": [m, n], "layers_together": layers, "ms_per_step": 1e3 * rs[0].seconds * layers / steps,
            "loss_start": sum(r.loss_start for r in rs) / layers, "loss_end": sum(r.loss_end for r in rs) / layers,
            "cuda_graph": rs[0].cuda_graph, "graph_error": rs[0].graph_error}


def time_block(model: str, steps: int, check_steps: int, grid, device) -> dict:
    """A block's fits as `adahop ptq` runs them (:func:`fit_harp_groups`: every shape's graph captured, then
    replayed side by side on streams of their own): ms per step of the whole block, and the largest relative
    gap of a short grouped fit's final losses to each group's own fit (``check_steps``)."""
    blocks = PRESETS[model]["num_hidden_layers"]
    groups = [make_group(m, n, count // blocks, device) for (m, n), count in linear_shapes(model).items()]
    fit_harp_groups([(ws, hs, rot()) for ws, hs, rot in groups], grid, FitOptions(steps=5))  # warm-up
    rs = fit_harp_groups([(ws, hs, rot()) for ws, hs, rot in groups], grid, FitOptions(steps=steps))
    layers = sum(len(r) for r in rs)
    short = fit_harp_groups([(ws, hs, rot()) for ws, hs, rot in groups], grid, FitOptions(steps=check_steps))
    alone = [fit_harp_many(ws, hs, rot(), grid, FitOptions(steps=check_steps)) for ws, hs, rot in groups]
    gap = max(abs(a.loss_end - b.loss_end) / max(abs(a.loss_end), 1e-30) for ra, rb in zip(alone, short) for a, b in zip(ra, rb))
    return {"ms_per_step": 1e3 * rs[0][0].seconds * layers / steps, "layers": layers,
            "cuda_graph": all(r.cuda_graph for g in rs for r in g), "loss_gap_rel": gap}


#: aten ops that only view their input (no kernel on a GPU): left out of --count-ops
VIEW_OPS = frozenset({"view", "permute", "_unsafe_view", "expand", "transpose", "unsqueeze", "squeeze", "detach",
                      "_reshape_alias", "alias", "select", "slice", "t", "as_strided", "reshape", "diagonal"})


def count_ops(m: int, n: int, layers: int, grid) -> tuple[float, float]:
    """(all, non-view) aten ops dispatched per Adam step of a fit of ``layers`` layers ``[m, n]`` on the CPU:
    the launches a GPU step would make without a CUDA graph (a 4-step fit's count minus a 2-step one's, halved,
    so the loss evaluations before and after the fit drop out)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    ops = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(m, n, generator=g) * 0.02 for _ in range(layers)]
    hs = [torch.eye(n) + 0.01 for _ in range(layers)]
    counts = []
    for steps in (2, 4):
        ts = [TwoSided.random_signs(HARPRotation(m), HARPRotation(n), generator=g) for _ in range(layers)]
        ops.clear()
        with Count():
            fit_harp_many(ws, hs, ts, grid, FitOptions(steps=steps))
        counts.append((sum(ops.values()), sum(v for o, v in ops.items() if o not in VIEW_OPS)))
    return tuple((b - a) / 2 for a, b in zip(*counts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-125m", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=100, help="timed Adam steps per shape (default 100)")
    ap.add_argument("--full-steps", type=int, default=FitOptions().steps, help="steps a real fit takes (default: the paper's 1200)")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--quantizer", default="int")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--graph-tol", type=float, default=1e-4,
                    help="largest relative gap of a short graphed fit's final loss to the eager one's (CUDA; default 1e-4)")
    ap.add_argument("--check-steps", type=int, default=8, help="steps of that check's fits (default 8: 3 eager, 5 replayed)")
    ap.add_argument("--count-ops", action="store_true",
                    help="instead of timing: aten ops dispatched per fit step at each shape (CPU, no GPU needed)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for flag in ("steps", "full_steps", "check_steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    try:
        device, grid = torch.device(args.device), make_grid(args.quantizer, args.bits)
    except (RuntimeError, ValueError) as e:  # a device string torch does not know, a grid that does not exist
        ap.error(str(e))
    if args.count_ops:
        blocks = PRESETS[args.model]["num_hidden_layers"]
        print(f"| shape (out × in) | layers fitted together | ops per step | non-view ops per step |\n|---|---|---|---|")
        for (m, n), count in linear_shapes(args.model).items():
            print(f"| {m} × {n} | {count // blocks} | " + " | ".join(f"{v:.0f}" for v in count_ops(m, n, count // blocks, grid)) + " |")
        return 0
    cuda = device.type == "cuda"
    rows, total, bad = [], 0.0, []
    print(f"HARP fitting at {args.model}'s shapes, {args.quantizer} W{args.bits}, {args.device}, {args.steps} timed steps each\n")
    extra = " | graphed ms/step | graphed s/layer | loss gap, short fits |" if cuda else " |"
    print(f"| shape (out × in) | layers (fitted together) | ms/step | s/layer at {args.full_steps} steps | proxy loss start → end ({args.steps} steps)" + extra)
    print("|---|---|---|---|---|" + ("---|---|---|" if cuda else ""))
    blocks = PRESETS[args.model]["num_hidden_layers"]
    for (m, n), count in linear_shapes(args.model).items():
        k = count // blocks  # a block's layers of this shape: one fit
        r = time_fit(m, n, args.steps, grid, device, layers=k)
        r["s_per_layer"] = r["ms_per_step"] * args.full_steps / 1e3 / k
        line = f"| {m} × {n} | {count} ({k}) | {r['ms_per_step']:.2f} | {r['s_per_layer']:.1f} | {r['loss_start']:.4f} → {r['loss_end']:.4f} |"
        best = r["s_per_layer"]
        if cuda:  # the same fit replayed from a CUDA graph: its time, and its final loss against the eager one's
            gr = time_fit(m, n, args.steps, grid, device, cuda_graph=True, layers=k)
            a, b = (time_fit(m, n, args.check_steps, grid, device, cuda_graph=c, layers=k)["loss_end"] for c in (False, True))
            gap = abs(b - a) / max(abs(a), 1e-30)
            r["graphed"] = {**gr, "s_per_layer": gr["ms_per_step"] * args.full_steps / 1e3 / k, "loss_gap_rel": gap}
            line += f" {gr['ms_per_step']:.2f}{'' if gr['cuda_graph'] else ' (capture failed: eager)'} | {r['graphed']['s_per_layer']:.1f} | {gap:.1e} |"
            best = min(best, r["graphed"]["s_per_layer"]) if gr["cuda_graph"] else best
            if gr["graph_error"]:
                print(f"capture failed at {m} × {n}: {gr['graph_error']}")
            if not gap <= args.graph_tol:
                bad.append((m, n, gap))
        total += best * count
        rows.append({**r, "layers": count})
        print(line)
    print(f"\nwhole model: {total:.0f} s of HARP fitting ({total / 60:.1f} min) for {sum(r['layers'] for r in rows)} layers"
          + (" (the faster of eager and graphed per shape)" if cuda else ""))
    block = None
    if cuda:  # the block's shapes side by side, as adahop ptq fits them
        block = time_block(args.model, args.steps, args.check_steps, grid, device)
        seq = sum(r["graphed"]["ms_per_step"] if r["graphed"]["cuda_graph"] else r["ms_per_step"] for r in rows)
        block["one_after_another_ms_per_step"] = seq
        block["whole_model_s"] = block["ms_per_step"] * args.full_steps / 1e3 * blocks
        print(f"one block's {block['layers']} layers side by side: {block['ms_per_step']:.2f} ms/step against {seq:.2f} one "
              f"shape after another; whole model {block['whole_model_s']:.0f} s ({block['whole_model_s'] / 60:.1f} min) of "
              f"HARP fitting; short grouped fits' loss gap to separate ones {block['loss_gap_rel']:.1e}")
        if not block["loss_gap_rel"] <= args.graph_tol:
            bad.append(("block", args.model, block["loss_gap_rel"]))
    for m, n, gap in bad:
        what = f"{n}'s block fitted side by side" if m == "block" else f"{m} × {n}: the graphed fit"
        print(f"FAIL: {what}: final loss {gap:.1e} from the separate or eager fit's (tolerance {args.graph_tol})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "bits": args.bits, "quantizer": args.quantizer,
                       "steps_timed": args.steps, "full_steps": args.full_steps, "rows": rows, "total_s": total, "block": block, "graph_failures": bad}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
