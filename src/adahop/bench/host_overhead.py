"""Host time of a converted linear's forward + backward with every kernel stubbed out (CPU).

    PYTHONPATH=src python scripts/host_overhead.py mxfp4-had|adahop-lv2 [prof]

The quantizer, the fold and the FP8 GEMM are replaced by functions that return empty tensors of
the right shapes, and the backend is forced to "triton": what remains is adahop's own Python
(engine, autograd function, dataclasses) plus the autograd engine. ``prof`` adds a cProfile.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch


def main(argv: list[str] | None = None) -> None:
    """Stub the kernels (for the rest of this process: run it as a script), then time and
    optionally profile ``argv[0]``'s converted layer (``mxfp4-had`` or ``adahop-lv2``)."""
    argv = sys.argv[1:] if argv is None else argv
    import adahop.kernels.fold as fold
    import adahop.kernels.quantize_mxfp4; qm = sys.modules["adahop.kernels.quantize_mxfp4"]
    import adahop.kernels.mx_matmul; mm = sys.modules["adahop.kernels.mx_matmul"]
    from adahop.kernels import _triton_quantize as tq, _triton_fold as tf
    # stubs: same output shapes, no work (measures the Python around the kernels)
    def fake_quant(x, axis, hb, signs, stochastic, rule, msr, seed, write_codes=True, want_fp8=True, keep=None, **kw):
        rows, kc = (x.shape[0], x.shape[1]) if axis == 1 else (x.shape[1], x.shape[0])
        kp = -(-kc // 32) * 32
        return (torch.empty(rows, kp // 2 if write_codes else 0, dtype=torch.uint8), torch.empty(rows, kp // 32, dtype=torch.uint8),
                torch.empty(rows, kp, dtype=torch.float8_e4m3fn), torch.empty(rows))
    tq.mx_quantize = fake_quant
    tf.fold = lambda codes, scales, e: (torch.empty(codes.shape[0], codes.shape[1] * 2, dtype=torch.float8_e4m3fn), torch.empty(codes.shape[0]))
    mm._fp8_rowwise_mm_impl = lambda a, sa, b, sb, dt, exact=False: torch.empty(a.shape[0], b.shape[0], dtype=dt)
    fold.resolve_backend = lambda b, d: "triton"; qm.resolve_backend = fold.resolve_backend; mm.resolve_backend = fold.resolve_backend
    from adahop.nn import convert_model, get_controller
    from adahop.patterns import Plan
    torch.set_num_threads(1)
    recipe = argv[0]
    lin = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    plan = Plan(table="lv2", layers={"0": {"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_right", "x": "C", "w": "N", "dy": "N"}}) if recipe == "adahop-lv2" else None
    convert_model(lin, recipe, plan=plan, backend="auto")
    get_controller(lin).on_step(10**6)
    x = torch.randn(256, 256, requires_grad=True); dy = torch.randn(256, 256)
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        y.backward(dy)
    for _ in range(20): step()
    t = time.perf_counter(); n = 300
    for _ in range(n): step()
    print(recipe, "host us per fwd+bwd (kernels stubbed):", round((time.perf_counter() - t) / n * 1e6))
    if len(argv) > 1:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(n): step()
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
