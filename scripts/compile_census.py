"""Census of the Triton kernel specializations one training step of a model's converted linears
compiles, and what each costs to compile for sm_90 (Hopper) from an empty cache, on this CPU.

How: every distinct linear shape of the model (q, k/v, o, gate/up, down) is converted to
``LowPrecisionLinear`` (backend ``"triton"``) and run forward + backward on *meta* tensors of the
real shapes. ``launch()`` (``kernels/_triton_launch.py``) is patched to record its kernel and
arguments instead of running, and the FP8 GEMM (``_fp8_rowwise_mm_impl``, cuBLAS) to return an
empty result. Each recorded launch goes through Triton's own binder (the JIT's signature, constexpr
and divisibility specialization; a meta tensor's pointer reads as 16-byte aligned, as a CUDA
allocation is), is deduplicated, then compiled with ``triton.compile`` for ``cuda:90`` in a fresh
``TRITON_CACHE_DIR``: seconds in total and in ptxas, registers and spill bytes of the cubin.
``adahop-lv2`` runs the union over all 27 (x, w, dy) patterns' lv2 plans (an upper bound: a real
plan uses a subset).

Caveat: Triton 3.9 here vs Triton 3.6 on the H200 (its bundled ptxas 12.x for sm_90: ``--ptxas legacy``,
the default, runs this Triton's bundled 12.9 likewise), and this machine's 2-core CPU:
the set of specializations is the code's, the seconds are only indicative. Run it under the GPU's own
Triton before a GPU round: its compiler passes can fail where 3.9's do not (the transposing quantizer's
row-max loop broke 3.6's TritonGPUOptimizeThreadLocality, found on the H200 first, then reproduced here):

    pip install --no-deps --target /tmp/tr36 triton==3.6.0
    PYTHONPATH=/tmp/tr36:src python scripts/compile_census.py --model llama-125m --recipes mxfp4,adahop-lv2 --tokens 1024 Kernels Inductor
generates itself (casts, pads, the optimizer) are not counted.

    python scripts/compile_census.py --model llama3.1-8b --recipes mxfp4,adahop-lv2 --tokens 8192
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile
import time

import torch
from torch import nn

from adahop.kernels import _triton_fold, _triton_quantize, _triton_quantize_nvfp4, mx_matmul  # before TRITON_INTERPRET

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.6's default (3.9 warns that it will change)
os.environ["TRITON_INTERPRET"] = "1"  # only so that resolve_backend accepts backend="triton" off CUDA; kernels stay JIT

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia import compiler as nvc  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from adahop import convert_model  # noqa: E402
from adahop.models import PRESETS  # noqa: E402
from adahop.nn.function import LowPrecisionLinearFn  # noqa: E402
from adahop.patterns import Pattern, Plan, gemm_pairs, strategy_for  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
LAUNCHES: list = []  # (kernel, kwargs)


def _record(kernel, grid, writes, **kwargs):
    LAUNCHES.append((kernel, kwargs))


for mod in (_triton_quantize, _triton_fold, _triton_quantize_nvfp4):
    mod.launch = _record
mx_matmul._fp8_rowwise_mm_impl = lambda a, sa, b, sb, out_dtype, exact=False: a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


def layer_shapes(model: str) -> set[tuple[int, int]]:
    c = PRESETS[model]
    h, hd, f = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return {(h, q), (h, kv), (q, h), (h, f), (f, h)}  # (in, out): q, k/v, o, gate/up, down


def plans(recipe: str) -> list[dict | None]:
    if recipe != "adahop-lv2":
        return [None]
    seen = {}
    for x, w, dy in itertools.product("RCN", repeat=3):
        pairs = gemm_pairs(Pattern.parse(x), Pattern.parse(w), Pattern.parse(dy))
        s = {g: strategy_for(g, pairs[g], "lv2") for g in ("fprop", "dgrad", "wgrad")}
        seen.setdefault(tuple(s.values()), {**s, "x": x, "w": w, "dy": dy})
    return list(seen.values())


def record(model: str, recipe: str, tokens: int) -> None:
    for (k, n), entry in itertools.product(sorted(layer_shapes(model)), plans(recipe)):
        lin = nn.Sequential(nn.Linear(k, n, bias=False, device="meta", dtype=torch.bfloat16))
        plan = Plan(table="lv2", layers={"0": entry}) if entry else None
        convert_model(lin, recipe, plan=plan, backend="triton")
        x = torch.empty(tokens, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
        y = LowPrecisionLinearFn.apply(x, lin[0].weight, None, lin[0], torch.bfloat16, None)  # the layer's
        y.backward(torch.empty(tokens, n, device="meta", dtype=torch.bfloat16))  # forward minus autocast (no meta autocast)


def specialize(kernel, kwargs):
    """What Triton's JIT would compile for this launch: (key, ASTSource, options)."""
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    bound, spec, opts = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(BACKEND, opts, bound, spec, opts)
    key = (kernel.fn.__name__, str(spec), str(options))
    return key, triton.compiler.ASTSource(kernel, signature, constexprs, attrs), options


STAGE_S: dict[str, float] = {}


def _timed(name, f):
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            STAGE_S[name] = STAGE_S.get(name, 0.0) + time.perf_counter() - t
    return g


nvc.CUDABackend.make_cubin = _timed("ptxas", nvc.CUDABackend.make_cubin)


def compile_one(src, options) -> tuple[float, float, str]:
    with tempfile.TemporaryDirectory() as d:
        os.environ["TRITON_CACHE_DIR"] = d
        triton.knobs.cache.dir = d
        STAGE_S.clear()
        t = time.perf_counter()
        c = triton.compile(src, target=TARGET, options=options.__dict__)
        total = time.perf_counter() - t
        with open(os.path.join(d, "k.cubin"), "wb") as f:
            f.write(c.asm["cubin"])
        ru = subprocess.run([os.path.join(os.path.dirname(nvc.__file__), "bin", "cuobjdump"), "--dump-resource-usage",
                             os.path.join(d, "k.cubin")], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", ru)
    return total, STAGE_S.get("ptxas", 0.0), (f"reg {m[1]} stack {m[2]} local {m[4]}" if m else "?")


SHOWN = ("BR", "BK", "NCHUNK", "NKT", "NBP", "LAYOUT", "VEC", "MASK_R", "MASK_K", "MASK", "HB", "HAS_SIGNS", "ROW_SRC",
         "WRITE_CODES", "WRITE_FP8", "ZERO_ROWS", "RULE", "STOCHASTIC")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--recipes", default="mxfp4,adahop-lv2")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch * seq_len)")
    ap.add_argument("--top", type=int, default=0, help="print only the N slowest rows (0: all)")
    ap.add_argument("--cached", metavar="MODEL:TOKENS", help="compile only what this model's step does not (its cache is warm)")
    ap.add_argument("--ptxas", default="legacy", help="'legacy': Triton's bundled ptxas (12.9 here), which Triton <= 3.8 "
                    "runs for sm_90; 'blackwell': the ptxas-blackwell (13.4) Triton 3.9 runs; or a path")
    a = ap.parse_args()
    if a.ptxas != "blackwell":
        os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = (os.path.join(os.path.dirname(nvc.__file__), "bin", "ptxas")
                                                     if a.ptxas == "legacy" else a.ptxas)
    print(f"ptxas for sm_90: {nvc.get_ptxas(90).path} ({nvc.get_ptxas(90).version})")
    for recipe in a.recipes.split(","):
        cached = set()
        if a.cached:
            LAUNCHES.clear()
            record(a.cached.split(":")[0], recipe, int(a.cached.split(":")[1]))
            cached = {specialize(k, kw)[0] for k, kw in LAUNCHES}
        LAUNCHES.clear()
        record(a.model, recipe, a.tokens)
        uniq = {}
        for kernel, kwargs in LAUNCHES:
            key, src, options = specialize(kernel, kwargs)
            if key not in cached:
                uniq.setdefault(key, (src, options, kernel))
        rows = []
        for src, options, kernel in uniq.values():
            total, ptxas, ru = compile_one(src, options)
            names = [p.name for p in kernel.params]
            cst = " ".join(f"{names[i[0]]}={v}" for i, v in src.constants.items() if names[i[0]] in SHOWN)
            ones = [names[i[0]] for i in src.constants if not kernel.params[i[0]].is_constexpr]  # int args == 1
            rows.append((total, ptxas, kernel.fn.__name__, cst + (f" ({','.join(ones)}=1)" if ones else ""),
                         options.num_warps, ru))
            print(f"  compiled {kernel.fn.__name__} {cst} w{options.num_warps}: {total:.1f} s", flush=True)
        rows.sort(reverse=True)
        print(f"\n== {a.model}, {recipe}, {a.tokens} tokens: {len(LAUNCHES)} launches, {len(rows)} specializations"
              f"{' not in ' + a.cached if a.cached else ''}, {sum(r[0] for r in rows):.1f} s compile ({sum(r[1] for r in rows):.1f} s ptxas)")
        print(f"{'s':>6} {'ptxas':>6}  {'kernel':20} {'warps':>5}  {'cubin':26} constexprs")
        for total, ptxas, name, cst, nw, ru in rows[: a.top or None]:
            print(f"{total:6.1f} {ptxas:6.1f}  {name:20} {nw:5d}  {ru:26} {cst}")


if __name__ == "__main__":
    main()
