"""Decode-time speed of `adahop ptq`'s packed layers against BF16 (issue 22, the inference path).

    python scripts/bench_decode.py --model llama3.1-8b [--bits 2,4] [--rows 1] [--sweep] [--json OUT]
    python scripts/bench_decode.py --folder runs/m125-harp-w2 [--tokens 64]     # a model of our own, end to end

Per layer: for each distinct decoder linear shape of ``--model``, one call of ``x·Wᵀ`` for ``--rows`` rows (1: one
token) in BF16 (``nn.Linear``), and as :class:`adahop.ptq.decode.PackedLinear` on int codes of each ``--bits`` (groups
of 128): without rotation (the matvec kernel alone), with the RHT, and with HARP (random Θ: the speed does not depend
on the values); and on MXFP4 codes with the RHT. Each is captured in a CUDA graph of 20 calls and replayed, so the time is the GPU's, not the host's;
the table gives µs per call, the ratio to BF16, and the decoder's linears per token (all blocks) as tokens/s.

``--folder``: the end-to-end decode of a folder `adahop ptq` wrote, greedy, one token at a time with the KV cache:
the BF16 export (``transformers``) against :func:`adahop.ptq.decode.load_packed_model`; tokens/s of each. Eager,
where at our model sizes the host's launches bound both; and on CUDA with a ``StaticCache`` and each token's step
replayed from a CUDA graph, which leaves the kernels' time.
CUDA only for the per-layer table (the CPU has no graphs); ``--folder`` runs anywhere.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch

from adahop.models import PRESETS
from adahop.ptq.decode import PackedLinear, load_packed_model
from adahop.ptq.grids import make_grid
from adahop.ptq.incoherence import RHTRotation, TwoSided, rht_block
from adahop.ptq.quantize import pack_bits
from adahop.ptq.rotation import HARPRotation


def shapes(model: str) -> dict[tuple[int, int], int]:
    """``{(out, in): layers per block}`` of a preset's decoder linears."""
    c = PRESETS[model]
    d, f = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out: dict[tuple[int, int], int] = {}
    for s in [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)]:
        out[s] = out.get(s, 0) + 1
    return out


def packed_layer(m: int, n: int, bits: int, rot: str, device, quantizer: str = "int") -> PackedLinear:
    """A ``PackedLinear`` of random codes and scales (the speed does not depend on the values), made on ``device``:
    the int grid in groups of 128, or ``mxfp4`` (E2M1 codes, power-of-two scales stored as E8M0, groups of 32)."""
    g = torch.Generator(device=device).manual_seed(0)
    grid = make_grid(quantizer, bits, 128 if quantizer == "int" else None)
    codes = torch.randint(0, 2 ** bits, (m, n), device=device, generator=g, dtype=torch.uint8)
    groups = -(-n // grid.group_size)
    if quantizer == "int":
        scales = torch.rand(m, groups, device=device, generator=g) * 0.01 + 1e-3
    else:
        scales = torch.exp2(torch.randint(-10, -4, (m, groups), device=device, generator=g).float())
    t = None
    if rot == "rht":
        t = TwoSided.random_signs(RHTRotation(m), RHTRotation(n), generator=torch.Generator().manual_seed(0))
    elif rot == "harp":
        u, v = HARPRotation(m), HARPRotation(n)
        with torch.no_grad():
            for th in [*u.thetas, *v.thetas]:
                th.copy_(torch.randn(th.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        t = TwoSided.random_signs(u, v, generator=torch.Generator().manual_seed(0))
    return PackedLinear(grid, {"codes": pack_bits(codes, bits), **grid.stored_scales(scales)}, t, (m, n)).to(device)


def graphed_us(fn, x, calls: int = 20, replays: int = 50) -> float:
    """µs per call of ``fn(x)``, ``calls`` captured in one CUDA graph and replayed ``replays`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (replays * calls)


def per_layer(args) -> dict:
    dev = torch.device("cuda")
    blocks = PRESETS[args.model]["num_hidden_layers"]
    rows, totals = [], {}
    print(f"{args.model}: one call of x·Wᵀ, {args.rows} row(s), µs (ratio to BF16)\n")
    # the int grid at each width and rotation, and MXFP4 weights with the RHT (W4 of an adahop-trained model)
    kinds = [(f"W{b} {r}", b, r, "int") for b in args.bits for r in ("none", "rht", "harp")] + [("MXFP4 rht", 4, "rht", "mxfp4")]
    print("| shape (out × in) | per block | bf16 | " + " | ".join(label for label, *_ in kinds) + " |")
    print("|---|---|---|" + "---|" * len(kinds))
    for (m, n), k in shapes(args.model).items():
        x = torch.randn(args.rows, n, device=dev, dtype=torch.bfloat16)
        lin = torch.nn.Linear(n, m, bias=False, device=dev, dtype=torch.bfloat16)
        base = graphed_us(lin, x)
        row = {"shape": [m, n], "per_block": k, "bf16_us": base}
        cells = []
        for label, b, r, q in kinds:
            if r == "rht":
                try:
                    rht_block(m), rht_block(n)
                except ValueError:
                    cells.append("-")
                    continue
            us = graphed_us(packed_layer(m, n, b, r, dev, q), x)
            key = label.lower().replace(" ", "_")
            row[f"{key}_us"] = us
            cells.append(f"{us:.1f} ({base / us:.2f}×)")
            totals[key] = totals.get(key, 0.0) + us * k
        totals["bf16"] = totals.get("bf16", 0.0) + base * k
        rows.append(row)
        print(f"| {m} × {n} | {k} | {base:.1f} | " + " | ".join(cells) + " |", flush=True)
        if args.json:  # after every shape: a run cut by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "rows_per_call": args.rows, "layers": rows, "complete": False}, f, indent=1)
    tps = {key: 1e6 / (v * blocks) for key, v in totals.items()}
    print(f"\nthe decoder's linears alone, per token ({blocks} blocks): " +
          ", ".join(f"{key} {v:,.0f} tok/s ({v / tps['bf16']:.2f}×)" for key, v in tps.items()))
    return {"model": args.model, "rows_per_call": args.rows, "layers": rows, "complete": True, "linears_tok_per_s": tps,
            "device": torch.cuda.get_device_name()}


def _cache_kw(model) -> str:
    # transformers renamed past_key_values to cache (5.2x); the GPU image's 5.17 has only the old name
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _sync(dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def dynamic_decode(model, tokens: int, dev) -> tuple[list[int], float]:
    """Greedy decode of ``tokens`` tokens after token id 0, batch 1, the KV cache grown each step, eager.
    Returns the tokens and the seconds they took."""
    kw, cache, tok, seq = _cache_kw(model), None, torch.zeros(1, 1, dtype=torch.long, device=dev), []
    t0 = _sync(dev)
    for _ in range(tokens):
        out = model(tok, **{kw: cache}, use_cache=True)
        cache, tok = getattr(out, kw), out.logits[:, -1:].argmax(-1)
        seq.append(tok)
    return torch.cat(seq, 1).flatten().tolist(), _sync(dev) - t0


def teacher_forced_logits(model, seq: list[int], dev) -> torch.Tensor:
    """The logits ``[len(seq), vocab]`` (float32) of each step of decoding ``seq`` after token id 0, one token per
    step with a growing KV cache (the decode path, not a prompt's): ``seq`` fed in, whatever the model predicts."""
    kw, cache, out = _cache_kw(model), None, []
    for t in [0, *seq[:-1]]:
        o = model(torch.tensor([[t]], device=dev), **{kw: cache}, use_cache=True)
        cache = getattr(o, kw)
        out.append(o.logits[0, -1].float())
    return torch.stack(out)


def static_decode(model, tokens: int, dev, *, graph: bool) -> tuple[list[int], float]:
    """The same tokens as :func:`dynamic_decode`, with a ``transformers.StaticCache`` and every step's forward,
    argmax and position update in one function of fixed tensors: replayed from a CUDA graph (``graph``), the host
    then launching one graph per token, or run eagerly (to check it against the dynamic cache). The seconds
    count the tokens' loop only (not the warm-up step and the capture)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=tokens)
    kw = _cache_kw(model)
    ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    out = torch.zeros(tokens, dtype=torch.long, device=dev)

    def step():
        logits = model(ids, **{kw: cache}, cache_position=pos, use_cache=True).logits
        nxt = logits[0, -1].argmax()
        out.index_copy_(0, pos, nxt.view(1))
        ids.copy_(nxt.view(1, 1))
        pos.add_(1)

    def restart():  # back to token 0: the cache's own position counter (transformers 5.2x) and ours
        cache.reset()
        ids.zero_(), pos.zero_()

    g = None
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up off the graph: kernels compile, the cache's tensors are allocated
            step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
    else:
        step()  # the same warm-up step, so that the restart below is what the CPU test checks
    restart()
    t0 = _sync(dev)
    for _ in range(tokens):
        g.replay() if g is not None else step()
    return out.tolist(), _sync(dev) - t0


def sweep(args) -> list[dict]:
    """The matvec kernel alone (no rotation) at each ``block_m`` × ``per_sm`` of :func:`int_matvec`, per shape and
    width, graphed: where the defaults (:func:`~adahop.ptq.decode.matvec_tuning`) stand."""
    from adahop.ptq.decode import int_matvec

    dev, out = torch.device("cuda"), []
    configs = [(bm, ps) for bm in (32, 64, 128) for ps in (4, 8, 16)]
    print("\nint_matvec alone, µs per call: block_m × per_sm\n")
    print("| shape | bits | " + " | ".join(f"{bm}×{ps}" for bm, ps in configs) + " |")
    print("|---|---|" + "---|" * len(configs))
    for (m, n) in shapes(args.model):
        x = torch.randn(args.rows, n, device=dev, dtype=torch.bfloat16)
        for b in args.bits:
            layer = packed_layer(m, n, b, "none", dev)
            us = [graphed_us(lambda v, bm=bm, ps=ps: int_matvec(v, layer.codes, layer.scales()["scales"], m, n, b, 128,
                                                                block_m=bm, per_sm=ps), x) for bm, ps in configs]
            out.append({"shape": [m, n], "bits": b, "us": {f"{bm}x{ps}": u for (bm, ps), u in zip(configs, us)}})
            print(f"| {m} × {n} | {b} | " + " | ".join(f"{u:.1f}" for u in us) + " |", flush=True)
    return out


def end_to_end(args) -> dict:
    """Tokens/s of the BF16 export and of the packed model, greedy from token 0, batch 1: eager with a growing
    KV cache, and on CUDA also with a static cache replayed from a CUDA graph (the host's launches out of the
    way, the kernels' speed). A graph that fails to capture is reported with its error, not hidden."""
    import transformers

    dev = torch.device(args.device)
    res = {"folder": args.folder, "tokens": args.tokens, "device": str(dev)}
    modes = {"eager": lambda m: dynamic_decode(m, args.tokens, dev)}
    if dev.type == "cuda":
        modes["graph"] = lambda m: static_decode(m, args.tokens, dev, graph=True)
    models = {"bf16 export": transformers.AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.bfloat16).to(dev).eval(),
              "packed": load_packed_model(args.folder, dtype=torch.bfloat16, device=dev)}
    generated = {}
    for mode, run in modes.items():  # every eager run first: a failed capture may leave the CUDA context unusable
        for label, model in models.items():
            key = label if mode == "eager" else f"{label} ({mode})"
            try:
                with torch.no_grad():
                    for _ in range(2):  # the first pass warms up (kernels compile, caches fill)
                        seq, dt = run(model)
            except Exception as e:  # noqa: BLE001  (a capture failure is a result to report)
                if mode == "eager":
                    raise
                res[f"{key} error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                print(f"{key}: failed: {res[f'{key} error']}")
                continue
            res[key] = args.tokens / dt
            generated[key] = seq
            print(f"{key}: {res[key]:.1f} tok/s (greedy, {args.tokens} tokens, batch 1, {mode})")
    res["ratio"] = res["packed"] / res["bf16 export"]
    if "packed (graph)" in res and "bf16 export (graph)" in res:
        res["ratio (graph)"] = res["packed (graph)"] / res["bf16 export (graph)"]
        print(f"graphed: packed / bf16 {res['ratio (graph)']:.2f}×")
    # the same weights in another order of sums: greedy tokens may part where two logits nearly tie
    a, b = generated["bf16 export"], generated["packed"]
    res["same_tokens"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    print(f"packed / bf16: {res['ratio']:.2f}× eager; the first {res['same_tokens']} of {len(a)} greedy tokens agree")
    # where they part, was it a near tie? Both models fed the export's tokens: their logits' gap against the
    # export's margin between its top two logits at that step
    with torch.no_grad():
        la, lb = (teacher_forced_logits(m, a, dev) for m in models.values())
    gap = (la - lb).abs().amax(-1)
    res["max_logit_gap"] = float(gap.max())
    msg = f"logits, packed against export (teacher-forced): max |gap| {res['max_logit_gap']:.4f}"
    if res["same_tokens"] < len(a):
        i = res["same_tokens"]
        top = la[i].topk(2).values
        res["margin_at_split"], res["gap_at_split"] = float(top[0] - top[1]), float(gap[i])
        msg += (f"; at token {i}, where they part, the export's top two logits are {res['margin_at_split']:.4f} apart"
                f" and the gap is {res['gap_at_split']:.4f}")
    print(msg)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--bits", default="2,4", help="code widths of the packed layers (default 2,4)")
    ap.add_argument("--rows", type=int, default=1, help="rows of x per call (default 1: one token)")
    ap.add_argument("--folder", default=None, help="instead: decode a folder `adahop ptq` wrote, end to end")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time the matvec kernel alone at each block_m × per_sm")
    args = ap.parse_args(argv)
    try:
        args.bits = [int(b) for b in args.bits.split(",")]
    except ValueError:
        ap.error(f"--bits {args.bits!r}: give comma-separated integers, e.g. 2,4")
    if args.tokens < 1 or args.rows < 1:
        ap.error(f"--tokens ({args.tokens}) and --rows ({args.rows}) must be >= 1")
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r}: give cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this machine has no CUDA device; pass --device cpu (with --folder)")
    if args.json:
        from pathlib import Path

        if not Path(args.json).parent.is_dir():  # found before the run, not after it
            ap.error(f"--json {args.json}: its folder {Path(args.json).parent} does not exist")
    if args.folder and (args.bits != [2, 4] or args.rows != 1 or args.sweep):
        ap.error("--bits, --rows and --sweep set up the per-layer table; --folder decodes the folder's own layers")
    if args.folder:
        from pathlib import Path

        from adahop.ptq.export import PACKED_FILE

        if not (Path(args.folder) / PACKED_FILE).is_file():
            ap.error(f"--folder {args.folder}: no {PACKED_FILE} there; pass a folder written by `adahop ptq`")
        res = end_to_end(args)
    else:
        if not torch.cuda.is_available():
            ap.error("the per-layer table needs CUDA (CUDA graphs); on the CPU pass --folder")
        res = per_layer(args)
        if args.sweep:
            res["sweep"] = sweep(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
