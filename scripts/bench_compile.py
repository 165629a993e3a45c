#!/usr/bin/env python
"""Issue 18 item 1 on the GPU: compiled speed in `adahop train --compile`'s mode, cold compile, breaks.

    PYTHONPATH=src python scripts/bench_compile.py [--model llama-125m --seq-len 1024 --batch-size 16]
        [--recipes bf16,mxfp4,adahop-lv2] [--modes eager,compiled,auto] [--forms auto,opaque,traced,traced-inline]
        [--layers N] [--phases cold,side_by_side] [--log-dir DIR] [--profile N] [--json out.json]
    PYTHONPATH=src python scripts/bench_compile.py --device cpu --model llama-tiny --seq-len 32 --batch-size 2 --steps 1
        (a dry run of the script on the CPU: auto is the default mode there, Inductor compiles C++)

Two phases, each row from ``adahop.bench.bench_model`` (the harness of ``adahop bench model``):

1. cold: each recipe alone in a fresh process whose ``TORCHINDUCTOR_CACHE_DIR`` and
   ``TRITON_CACHE_DIR`` are new empty folders, in mode ``auto`` (what ``adahop train --compile``
   runs once the plan is frozen: ``reduce-overhead``, CUDA graphs, on a GPU). Its
   ``compile_step_s`` is the first compile with empty caches (the issue's target: 8B-shaped Lv2
   <= 90 s and <= 2x BF16's; at llama-125m it is the same measurement on the small model).
2. side by side: all recipes and ``--modes`` in one process (one fresh cache folder for the
   process), for the tokens/s ratios to BF16 of the same mode (targets at llama-125m 1024 x 16:
   Lv2 >= 0.9x, mxfp4 >= 0.95x, compiled the same way as BF16).

``--forms``: how a frozen converted layer enters the compiled graph: ``auto`` (the default of
``adahop.nn.opaque``: the opaque form for every layer since round 13, ``layer_form``),
``opaque`` (two ops that run eager mode's code), ``traced`` (its GEMMs traced by dynamo,
the Triton launches as the op ``adahop::triton_launch``) or ``traced-inline`` (traced, the launches
through ``wrap_triton``, which Inductor emits at the price of a TTIR analysis per call while
tracing); with several, each phase runs once per form (BF16's cold row once: it has no converted layer).

Every compiled row reports ``graph_breaks`` (counted over the row; calibration runs eagerly, so
any break is in the compiled model), ``recompiles`` (frames compiled after the step that
compiled; must be 0) and ``cudagraph_skips`` (graphs ``reduce-overhead`` ran without CUDA graphs:
correct, but the host overhead is back; rerun with ``TORCH_LOGS=perf_hints`` for the reason).
The side-by-side phase also prints, per recipe and compiled mode, the relative difference of the
untimed check step's loss and gradient norm to eager mode's: both runs start from the same weights
and data and take the same steps, so it is small but not zero (Inductor rounds some ops otherwise,
and a quantized recipe's GEMM inputs then round to other MXFP4 codes); a percent-level gap, or
fewer parameters with a gradient, is a compiled-path bug (`scripts/check_compiled_grads.py`).
Rows that fail keep their error and the others go on. The script prints one table per phase and,
with ``--json``, writes ``{"cold": [...], "side_by_side": [...]}``. Exit code 1 if a compiled
row recompiled, broke its graph or failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

KEYS = ("recipe", "mode", "form", "compile_mode", "tok_per_s", "vs_bf16", "step_ms", "compile_step_s", "warmup_s",
        "graph_breaks", "recompiles", "cudagraph_skips", "peak_mem_gib", "loss", "grads_ok", "error")


def worker(args) -> None:
    """Runs in the child: the rows of ``bench_model`` as JSON on the last line of stdout; the compile
    phases' times (dynamo's ``compile_times``) on stderr."""
    import torch

    from adahop.bench import bench_model

    from adahop.nn.opaque import set_compiled_layers

    set_compiled_layers(args.form if args.form in ("auto", "opaque") else "traced")
    if args.device == "cuda":
        from adahop.kernels._triton_launch import set_traced_launches

        set_traced_launches("inline" if args.form == "traced-inline" else "opaque")
    if args.stack_every:  # a compile that outlives its timeout still says where it was
        threading.Thread(target=_stack_dumps, args=(args.stack_every,), daemon=True).start()
    prof = None
    if args.profile:  # where the compile's host time goes (the functions with the most cumulative time)
        import cProfile  # (no faulthandler stack dumps: on the H200 they crashed the compiling child, round 9)

        prof = cProfile.Profile()
        prof.enable()
    rows = bench_model(args.model, recipes=tuple(args.recipes.split(",")), seq_len=args.seq_len, batch=args.batch_size,
                       layers=args.layers, steps=args.steps, modes=tuple(args.modes.split(",")), device=args.device)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(args.profile)
    for r in rows:
        r["form"] = args.form
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True), file=sys.stderr, flush=True)
    print("ROWS " + json.dumps(rows), flush=True)


def _stack_dumps(every: float, stop: threading.Event | None = None) -> None:
    """Every ``every`` seconds until ``stop`` is set, the main thread's innermost Python frames on stderr.
    Read from a Python thread (``sys._current_frames``), not faulthandler's signal, which crashed
    compiling children (round 9)."""
    main, t0, stop = threading.main_thread().ident, time.perf_counter(), stop or threading.Event()
    while not stop.wait(every):
        frame = sys._current_frames().get(main)
        stack = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "(no frame)\n"
        # a frame kept until the next sample keeps its locals alive: tensors allocated in a CUDA-graph tree's pool
        # then outlive their graph ("Detected 2 tensor(s) in the cudagraph pool not tracked as outputs", round 28)
        del frame
        print(f"--- main thread at {time.perf_counter() - t0:.0f} s:\n{stack}", file=sys.stderr, flush=True)


def run_child(args, recipes: str, modes: str, timeout: float, form: str = "auto") -> list[dict]:
    """One fresh process with empty Inductor and Triton caches; its rows (an error row if it died).
    Its stderr (progress, compile-phase times) goes to ``--log-dir`` when given."""
    with tempfile.TemporaryDirectory(prefix="adahop-cold-") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
               "TRITON_CACHE_DIR": str(Path(tmp) / "triton")}
        cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--seq-len", str(args.seq_len),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--recipes", recipes, "--modes", modes,
               "--device", args.device, "--form", form, "--profile", str(args.profile), "--stack-every", str(args.stack_every)] + (
                   ["--layers", str(args.layers)] if args.layers else [])
        err = None
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            err = open(Path(args.log_dir) / f"{recipes.replace(',', '-')}_{modes.replace(',', '-')}_{form}.log", "w")
        try:
            r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=err or subprocess.PIPE, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return [dict(recipe=rc, mode=m, form=form, error=f"timed out after {timeout:.0f} s")
                    for rc in recipes.split(",") for m in modes.split(",")]
        finally:
            if err:
                err.close()
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ROWS ")]
    if r.returncode or not lines:
        return [dict(recipe=recipes, mode=modes, form=form, error=f"exit {r.returncode}: {(r.stderr or '')[-400:]}")]
    return json.loads(lines[-1][5:])


def show(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    print(" | ".join(KEYS))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in KEYS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-125m")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--recipes", default="bf16,mxfp4,adahop-lv2")
    ap.add_argument("--modes", default="eager,compiled,auto", help="of the side-by-side phase (the cold one runs auto)")
    ap.add_argument("--phases", default="cold,side_by_side")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--forms", default="auto",
                    help="how a frozen converted layer enters the graph: auto, opaque, traced, traced-inline, comma-separated "
                         "(a cold row and a side-by-side process for each)")
    ap.add_argument("--form", default="auto", help=argparse.SUPPRESS)  # the child's one form
    ap.add_argument("--profile", type=int, default=0, help="cProfile each child; its N functions of most cumulative time in the log")
    ap.add_argument("--log-dir", default=None, help="each child's stderr (progress, compile-phase times) into a file here")
    ap.add_argument("--stack-every", type=float, default=0,
                    help="every S seconds each child writes its main thread's Python stack to its stderr (where a stuck compile is)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    forms = args.forms.split(",")
    out = {}
    if "cold" in args.phases:
        out["cold"] = [row for rc in args.recipes.split(",") for fm in forms if rc != "bf16" or fm == forms[0]
                       for row in run_child(args, rc, "auto", args.timeout, fm)]
        bf16 = next((r.get("compile_step_s") for r in out["cold"] if r["recipe"] == "bf16"), None)
        for r in out["cold"]:
            if bf16 and r.get("compile_step_s"):
                r["compile_vs_bf16"] = r["compile_step_s"] / bf16
        show(f"cold compile, mode auto, empty caches, one process per recipe ({args.model}, {args.batch_size} x "
             f"{args.seq_len})", out["cold"])
        print("compile_step_s vs BF16: " + ", ".join(f"{r['recipe']} {r['compile_vs_bf16']:.2f}x"
                                                      for r in out["cold"] if "compile_vs_bf16" in r))
    if "side_by_side" in args.phases:
        out["side_by_side"] = [row for fm in forms for row in run_child(args, args.recipes, args.modes, args.timeout * 3, fm)]
        show(f"side by side in one process ({args.model}, {args.batch_size} x {args.seq_len})", out["side_by_side"])
        # the untimed check step computes the same loss and gradient norm in every mode of a recipe (to rounding)
        for r in out["side_by_side"]:
            e = next((b for b in out["side_by_side"] if b["recipe"] == r["recipe"] and b["mode"] == "eager"
                      and b.get("form") == r.get("form")), None)
            if e is not None and r is not e and "loss" in r and "loss" in e:
                print(f"{r['recipe']} {r['mode']} vs eager: loss {r['loss'] / e['loss'] - 1:+.2e}, "
                      f"grad norm {r['grad_norm'] / e['grad_norm'] - 1:+.2e}, params with grad {r['params_with_grad']}"
                      f"/{r['params']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    rows = [r for rs in out.values() for r in rs]
    bad = [r for r in rows if "error" in r or r.get("recompiles") or r.get("graph_breaks")]
    for r in bad:
        print(f"FAIL {r.get('recipe')} {r.get('mode')}: {r.get('error') or ''} recompiles={r.get('recompiles')} "
              f"graph_breaks={r.get('graph_breaks')}")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
