"""`adahop bench linear|model`: speed and memory against BF16, measured side by side in one process.

Timing follows the device notes (METHOD.md): CUDA events around the region, warm-up excluded,
median of many repetitions, fresh random (never zero) inputs.

- ``linear``: one layer's forward + backward at the Llama linear shapes, for BF16 ``nn.Linear``,
  the FP8-folded fast path (plain MXFP4, IHT, and IHT with OE-Right on wgrad as AdaHOP-Lv2 gives
  the Column-pattern X), MXFP4 emulated the two ways Hopper allows (torchao-style dequantize to BF16
  + BF16 GEMM, and Triton ``tl.dot_scaled``; `adahop.bench.emulated`), and the reference backend
  (PyTorch quantizer, dequantize, FP32 matmul).
- ``model``: end-to-end training tokens/s and peak memory for BF16 and each recipe, eager and
  with ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections.abc import Callable

import torch

from .options import COMPILE_MODES, add_arguments  # torch-free, so that `adahop --help` stays fast
from .rows import merge_rows, normalize_row

__all__ = ["add_arguments", "run", "bench_linear", "bench_model", "model_step", "cuda_graph_time_ms", "LINEAR_SHAPES"]

#: (name, K=in_features, N=out_features) of the linear layers of each model.
LINEAR_SHAPES = {
    "llama-125m": [("q/o_proj", 768, 768), ("k/v_proj", 768, 256), ("gate/up_proj", 768, 2048), ("down_proj", 2048, 768)],
    "llama-350m": [("q/o_proj", 1024, 1024), ("k/v_proj", 1024, 256), ("gate/up_proj", 1024, 2752),
                   ("down_proj", 2752, 1024)],
    "llama3.2-1b": [("q/o_proj", 2048, 2048), ("k/v_proj", 2048, 512), ("gate/up_proj", 2048, 8192), ("down_proj", 8192, 2048)],
    "llama3.1-8b": [("q/o_proj", 4096, 4096), ("k/v_proj", 4096, 1024), ("gate/up_proj", 4096, 14336), ("down_proj", 14336, 4096)],
}


def cuda_time_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs (CUDA events), after 3 warm-ups (CUDA only)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cuda_graph_time_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` captured once in a CUDA graph and replayed (CUDA only).

    Device time alone: no host launch cost, which is what ``torch.compile(mode="reduce-overhead")``
    leaves of a layer. ``fn`` runs 3 times on a side stream first (lazy state, gradient buffers).
    Method: the device notes' METHOD.md (CUDA events, warm-up excluded, median).

    Raises:
        RuntimeError: from CUDA graph capture when ``fn`` syncs with the host (e.g. the reference
            backend's ``.item()`` calls), or without CUDA.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, reps)


#: ``bench linear`` rows of MXFP4 emulated the two ways Hopper allows (`adahop.bench.emulated`)
EMULATED_KINDS = {"mxfp4 dequant-to-bf16 (torchao-style)": "dequant-bf16", "mxfp4 tl.dot_scaled": "dot_scaled"}


def _layer(kind: str, k: int, n: int, device) -> torch.nn.Module:
    from ..nn import convert_model, get_controller
    from ..patterns import Plan

    lin = torch.nn.Linear(k, n, bias=False, device=device)
    if kind == "bf16":
        return lin
    if kind in EMULATED_KINDS:
        from .emulated import EmulatedMXLinear

        return EmulatedMXLinear(lin, EMULATED_KINDS[kind])
    wrapper = torch.nn.Sequential(lin)
    recipe, backend, strategies = {
        "mxfp4 fast": ("mxfp4", "auto", None),
        "iht fast": ("mxfp4-had", "auto", None),
        "adahop-lv2 fast (iht, wgrad oe_right)": ("adahop-lv2", "auto", {"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_right"}),
        "mxfp4 emulated (dequantize + matmul)": ("mxfp4", "reference", None),
    }[kind]
    plan = Plan(table="lv2", layers={"0": {**strategies, "x": "C", "w": "N", "dy": "N"}}) if strategies else None
    convert_model(wrapper, recipe, plan=plan, backend=backend)
    get_controller(wrapper).on_step(10**6)
    return wrapper


def layer_step(kind: str, t: int, k: int, n: int, device) -> tuple[torch.nn.Module, Callable[[], None]]:
    """One layer of ``kind`` (``K → N``) and its forward + backward on fresh random bf16 inputs of
    ``t`` tokens, under bf16 autocast (what ``bench linear`` times and ``scripts/profile_linear.py`` profiles).

    ``kind`` is one of ``bench linear``'s rows (``"bf16"``, ``"mxfp4 fast"``, ``"iht fast"``,
    ``"adahop-lv2 fast (iht, wgrad oe_right)"``, the keys of :data:`EMULATED_KINDS`,
    ``"mxfp4 emulated (dequantize + matmul)"``); the
    step uses X ``[t, K]`` and ∇Y ``[t, N]``, both bfloat16, and accumulates X's and W's gradients.

    Raises:
        KeyError: an unknown ``kind``.
    """
    layer = _layer(kind, k, n, device)
    x = torch.randn(t, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device=device, dtype=torch.bfloat16)

    def step():
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(dy)

    return layer, step


def bench_linear(models=("llama3.1-8b",), tokens=(8192, 16384), reps: int = 20, cuda_graphs: bool = False) -> list[dict]:
    """Forward+backward milliseconds, TFLOP/s and ratio to BF16 for each layer kind and shape.

    ``cuda_graphs``: also time each fast kind and BF16 replayed from a CUDA graph: a second row
    of mode ``"cuda-graph"``, the device time without the host's launch cost. Every row has the
    fields of :data:`adahop.bench.rows.ROW_FIELDS` (``recipe`` is the layer kind, ``tok_per_s`` the
    layer's tokens per second of forward + backward, ``warmup_s`` the first call's seconds).
    """
    import time

    from .emulated import EmulatedMXLinear
    from ..nn import LowPrecisionLinear

    dev = torch.device("cuda")
    kinds = ["bf16", "mxfp4 fast", "iht fast", "adahop-lv2 fast (iht, wgrad oe_right)", *EMULATED_KINDS,
             "mxfp4 emulated (dequantize + matmul)"]
    rows = []
    for model in models:
        for t in tokens:
            for name, k, n in LINEAR_SHAPES[model]:
                base = gbase = None
                for kind in kinds:
                    torch.cuda.reset_peak_memory_stats()
                    t_warm = time.perf_counter()
                    layer, step = layer_step(kind, t, k, n, dev)
                    step()  # the first call: lazy state, Triton's compile
                    torch.cuda.synchronize()
                    warmup_s = time.perf_counter() - t_warm
                    ms = cuda_time_ms(step, reps if "emulated" not in kind else max(3, reps // 4))
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    flops = 6 * t * k * n
                    lp = next((m for m in layer.modules() if isinstance(m, (LowPrecisionLinear, EmulatedMXLinear))), None)
                    saved = lp.saved_bytes if lp is not None else (t * k + n * k) * 2
                    base = base or ms
                    row = normalize_row(dict(
                        bench="linear", model=model, recipe=kind, mode="eager", tok_per_s=t / ms * 1e3, vs_bf16=base / ms,
                        peak_mem_gib=peak, warmup_s=warmup_s, layer=name, tokens=t, K=k, N=n, kind=kind, ms=ms,
                        tflops=flops / ms / 1e9, speedup_vs_bf16=base / ms, saved_bytes=saved,
                        saved_ratio_vs_bf16=(t * k + n * k) * 2 / saved, **_where(dev)))
                    rows.append(row)
                    print("row:", json.dumps(row), flush=True)  # a run cut short keeps the finished rows
                    if cuda_graphs and "emulated" not in kind:  # the reference backend syncs with the host
                        gms = cuda_graph_time_ms(step, reps)
                        gbase = gbase or gms
                        # graph_ms / graph_speedup_vs_bf16: the names of the earlier rounds' logs
                        rows.append({**row, "mode": "cuda-graph", "tok_per_s": t / gms * 1e3, "vs_bf16": gbase / gms,
                                     "ms": gms, "tflops": flops / gms / 1e9, "speedup_vs_bf16": gbase / gms,
                                     "graph_ms": gms, "graph_speedup_vs_bf16": gbase / gms})
                        print("row:", json.dumps(rows[-1]), flush=True)
                    del layer, step
                    torch.cuda.empty_cache()
    return rows


def bench_model(model: str = "llama3.2-1b", *, recipes=("bf16", "adahop-lv2", "mxfp4"), seq_len: int = 4096, batch: int = 4,
                layers: int | None = None, steps: int = 6, modes=("eager", "auto"), device: str = "cuda",
                small_gemms: bool = False, max_batch: int | None = None) -> list[dict]:
    """Training tokens/s (median step time after warm-up) and peak memory, same process for all.

    ``modes`` are keys of :data:`COMPILE_MODES`. A row that fails (out of memory, a compile
    error) is recorded with its error instead of stopping the others. Each row also gives
    ``warmup_s``: seconds of its 5 untimed steps (calibration, compile, CUDA-graph recording); a
    compiled row ``compile_mode`` (the ``torch.compile`` mode), ``compile_step_s`` (the wall time of
    the step that compiled: with empty caches in a fresh process, the cold compile), ``graph_breaks``
    (dynamo's count over the row; calibration runs eagerly), ``recompiles`` (frames compiled after
    that step: must be 0) and ``cudagraph_skips`` (graphs run without CUDA graphs). ``peak_mem_gib``
    (GiB allocated, the caching allocator's peak) spans the timed steps of an eager row, and a compiled
    row's steps from its compile on (its CUDA-graph recording allocates what replays reuse); calibration
    steps are never in it: a calibrating recipe's row gives their peak as ``calibration_peak_mem_gib``
    (eager BF16 steps that record the outlier statistics; None on the CPU and for other recipes), and a
    batch fits only if both do.
    One more untimed step records what the model computed: ``loss``, ``grad_norm`` (all
    parameters) and ``params_with_grad`` (of ``params``), equal across modes of one recipe;
    ``grads_ok`` is False when some parameter got no gradient (such a row's speed is not valid).
    Recipes: adahop presets and torchao's float8 training (:mod:`adahop.bench.torchao_fp8`).
    ``small_gemms``: the adahop recipes run their too-small GEMMs in BF16 (``Recipe.bf16_small_gemms``);
    every row counts them (``small_gemms_bf16``). The fields of :data:`adahop.bench.rows.ROW_FIELDS`
    are in every row (None where a row has no value).
    ``max_batch``: after each row (an out-of-memory one included), the largest batch up to it that trains
    without running out of GPU memory, searched from ``batch`` by :func:`adahop.bench.max_batch.largest_fitting`;
    each try (:func:`adahop.bench.max_batch.batch_fits`) builds the model anew and runs a calibrating recipe's
    calibration, then three steps in the row's mode (compiled: the compile, CUDA-graph recording, a replay).
    The row gets ``largest_batch``, ``batches_tried`` (``[batch, fitted]`` pairs) and ``search_start_mem_gib``; a
    search that failed, or found less than the batch its row trained at, gives ``largest_batch`` None and
    ``largest_batch_error``.

    Raises:
        ValueError: an unknown mode, or ``max_batch`` below ``batch``.
    """
    for mode in modes:
        if mode not in COMPILE_MODES:
            raise ValueError(f"bench model: unknown mode {mode!r}; use some of {', '.join(COMPILE_MODES)}")
    if max_batch is not None and max_batch < batch:
        raise ValueError(f"bench model: --max-batch {max_batch} must be at least --batch-size {batch}")
    rows = []
    for mode in modes:
        for recipe in recipes:
            try:
                rows.append(_bench_model_row(model, recipe, mode, seq_len, batch, layers, steps, device, small_gemms))
            except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                rows.append(dict(bench="model", model=model, layers=layers, seq_len=seq_len, batch=batch, recipe=recipe,
                                 mode=mode, bf16_small_gemms=small_gemms, error=f"{type(e).__name__}: {e}"[:300],
                                 **_where(device)))
            # the row's compiled graphs and their CUDA-graph pool outlive its model until this reset: the search
            # must start from free memory (round 34 on an H100: without it, Lv2+recompute "did not fit" at the
            # batch its row had just trained at)
            torch.compiler.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
            # an out-of-memory row still gets its largest batch (the search bisects below --batch-size)
            if max_batch is not None and ("error" not in rows[-1] or "out of memory" in rows[-1]["error"].lower()):
                try:
                    rows[-1].update(_largest_batch(model, recipe, mode, seq_len, batch, layers, device, small_gemms,
                                                   max_batch, trained="error" not in rows[-1]))
                except Exception as e:  # noqa: BLE001 - the timed row stands without it
                    rows[-1].update(largest_batch=None, largest_batch_error=f"{type(e).__name__}: {e}"[:300])
            print("row:", json.dumps(rows[-1]), flush=True)  # a run cut short keeps the finished rows
    for r in rows:
        base = next((b.get("tok_per_s") for b in rows if b["recipe"] == "bf16" and b["mode"] == r["mode"]), None)
        r["vs_bf16"] = r["tok_per_s"] / base if base and "tok_per_s" in r else None
    return [normalize_row(r) for r in rows]


#: The suffix of a ``bench model`` recipe that runs the model under selective activation recompute
#: (:func:`adahop.nn.recompute.selective_recompute`); ``bf16+recompute`` is BF16 at equal recompute.
RECOMPUTE = "+recompute"


def split_recompute(recipe: str) -> tuple[str, bool]:
    """``(recipe without the suffix, whether it had it)`` for a ``bench model`` recipe (:data:`RECOMPUTE`)."""
    return (recipe[: -len(RECOMPUTE)], True) if recipe.endswith(RECOMPUTE) else (recipe, False)


def model_step(model: str, recipe: str, mode: str, seq_len: int, batch: int, layers: int | None = None,
               device: str = "cuda", small_gemms: bool = False) -> tuple[torch.nn.Module, Callable[..., dict]]:
    """The model of ``bench model`` and one training step of it: ``(model, step)``.

    A ``transformers`` model of ``model``'s shapes (vocabulary 32768; the first ``layers`` blocks
    when given) on ``device``, converted to ``recipe`` (BF16: left as it is), fused AdamW, random
    token ids ``[batch, seq_len + 1]``. ``step(i, record=False)`` runs forward (bf16 autocast),
    cross-entropy, backward and the optimizer step ``i`` (0-based); a calibrating recipe calibrates
    for 2 steps eagerly (on a GPU under selective recompute, as ``adahop train`` does) and is compiled once its
    plan is frozen. With ``record=True`` it returns
    what the step computed (``loss``, ``grad_norm``, ``params_with_grad``, ``params``,
    ``grads_ok``), else ``{}``. ``mode`` is a key of :data:`COMPILE_MODES`; ``step.compile_mode``
    is the ``torch.compile`` mode it resolved to (None: eager) and ``step.first_compiled`` the
    index of the step that compiles (None: eager). Used by ``bench model`` (timing) and
    ``scripts/profile_model.py`` (kernel breakdown).

    ``recipe`` is an adahop preset, or one of :data:`adahop.bench.torchao_fp8.TORCHAO_RECIPES`
    (torchao's float8 training of the same linears: CUDA sm_89+ only), either followed by
    :data:`RECOMPUTE` (``adahop-lv2+recompute``): the blocks under selective activation recompute
    (:func:`adahop.nn.recompute.selective_recompute`). ``small_gemms``: run the
    GEMMs too small for the fast path in BF16 (``Recipe.with_small_gemms_bf16()``, adahop recipes).

    Raises:
        ValueError / RuntimeError: an unknown recipe, or a torchao recipe this device cannot run
            (before the model is built).
    """
    import torch.nn.functional as F

    from ..models import build_model
    from ..nn import convert_model, on_step
    from ..recipes import get_recipe

    from .torchao_fp8 import convert_float8, float8_config, is_torchao_recipe

    dev = torch.device(device)
    recipe, recompute = split_recompute(recipe)
    torchao = is_torchao_recipe(recipe)
    fp8_config = float8_config(recipe, dev) if torchao else None  # fails before the model is built
    r = get_recipe("bf16") if torchao else get_recipe(recipe)
    torch.manual_seed(0)
    m = build_model(model, vocab_size=32768, max_seq_len=seq_len)
    if layers is not None:
        m.model.layers = m.model.layers[:layers]
        m.config.num_hidden_layers = layers
    m = m.to(dev)
    if small_gemms:
        r = r.with_small_gemms_bf16()
    if r.calibration is not None:
        r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, steps=2))
    if torchao:
        convert_float8(m, fp8_config)
    elif not r.is_bf16:  # the BF16 row is the plain transformers model, nn.Linear and all
        convert_model(m, r)
    # a calibrating recipe runs its calibration steps eagerly and is compiled once its plan is frozen; as in
    # `adahop train`, those steps run under selective recompute on a GPU, turned off at the freeze
    from ..nn.recompute import calibrates_under_recompute, selective_recompute, undo_selective_recompute

    calibrating = not r.is_bf16 and r.calibration is not None
    calib_recompute = calibrating and not recompute and calibrates_under_recompute(m, dev)
    if recompute or calib_recompute:
        m.train()
        selective_recompute(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    compile_mode = COMPILE_MODES[mode]
    if compile_mode == "auto":  # what `adahop train --compile` runs once the plan is frozen
        from ..compile_modes import frozen_mode

        compile_mode = frozen_mode(dev.type)
    fwd = m if compile_mode is None or calibrating else torch.compile(m, mode=compile_mode)
    ids = torch.randint(0, 32768, (batch, seq_len + 1), device=dev)

    def step(i: int, record: bool = False) -> dict:
        nonlocal fwd
        check = {}
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = fwd(input_ids=ids[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        if record:  # what the step computed: equal across modes, close to BF16's (a dropped backward shows here)
            grads = [p.grad for p in m.parameters() if p.grad is not None]
            n_with, n_all = sum(bool(g.any()) for g in grads), sum(1 for _ in m.parameters())
            check = dict(loss=loss.item(), grad_norm=torch.nn.utils.get_total_norm(grads).item(),
                         params_with_grad=n_with, params=n_all, grads_ok=n_with == n_all)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if calibrating and on_step(m, i + 1):
            if calib_recompute:
                undo_selective_recompute(m)
            if compile_mode is not None:
                fwd = torch.compile(m, mode=compile_mode)
        return check

    step.compile_mode = compile_mode  # the torch.compile mode the step runs in (None: eager)
    step.first_compiled = None if compile_mode is None else (2 if calibrating else 0)  # index of the step that compiles
    step.calibration_steps = 2 if calibrating else 0  # the first steps, eager and BF16, that calibrate the plan
    return m, step


def _bench_model_row(model: str, recipe: str, mode: str, seq_len: int, batch: int, layers: int | None, steps: int,
                     device: str = "cuda", small_gemms: bool = False) -> dict:
    if split_recompute(recipe)[0] == "torchao-fp8-rowwise" and mode != "eager":
        # as torchtitan does for this recipe (pytorch/pytorch#150859: Inductor's rowwise casts
        # otherwise round differently from eager's); only for this row
        import torch._inductor.config as inductor_config

        with inductor_config.patch(emulate_precision_casts=True):
            return _bench_model_row_timed(model, recipe, mode, seq_len, batch, layers, steps, device, small_gemms)
    return _bench_model_row_timed(model, recipe, mode, seq_len, batch, layers, steps, device, small_gemms)


def _bench_model_row_timed(model: str, recipe: str, mode: str, seq_len: int, batch: int, layers: int | None, steps: int,
                           device: str, small_gemms: bool) -> dict:
    import time

    from ..compile_modes import dynamo_counts
    from ..nn import small_gemm_count

    m, step = model_step(model, recipe, mode, seq_len, batch, layers, device, small_gemms)
    cuda = torch.device(device).type == "cuda"
    counts0, counts1, compile_s = dynamo_counts(), None, None
    t_warm = time.perf_counter()
    calib_peak = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i in range(5):  # calibration (2 steps), the compile after the plan freeze, CUDA-graph recording
        if cuda and i == step.first_compiled:
            # a compiled row's peak spans its compile and CUDA-graph recording: the graphs' pool holds the
            # activations from then on, and replays allocate nothing (a peak of the replays alone is the
            # parameters and optimizer state: every recipe read 17.63 GiB at Llama-3.2-1B 4096 x 4, round 31)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        step(i)
        if cuda:
            torch.cuda.synchronize()
            if i == step.calibration_steps - 1:  # eager BF16 steps: what fits is bounded by them too (round 34)
                calib_peak = torch.cuda.max_memory_allocated() / 2**30
        if i == step.first_compiled:  # the step that compiled (cold: with empty caches, the first compile)
            compile_s, counts1 = time.perf_counter() - t0, dynamo_counts()
        # progress on stderr: a compile can take minutes, and a row that times out prints nothing else
        print(f"{model} {recipe} {mode}: warm-up step {i}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if cuda and step.first_compiled is None:  # eager: the timed steps (synchronized by the last warm-up step)
        torch.cuda.reset_peak_memory_stats()
    warmup_s = time.perf_counter() - t_warm
    times = []
    for i in range(5, 5 + steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(i)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:  # the CPU run only checks the harness (tests)
            t0 = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None  # no peak-memory counter on the CPU
    check = step(5 + steps, record=True)  # untimed
    counts2 = dynamo_counts()
    compiled = {}
    if counts1 is not None:  # breaks of the compiled graphs; frames compiled again after the first compiled step (0)
        compiled = dict(compile_mode=step.compile_mode, compile_step_s=compile_s,
                        graph_breaks=counts2["graph_breaks"] - counts0["graph_breaks"],
                        recompiles=counts2["frames"] - counts1["frames"],
                        cudagraph_skips=counts2["cudagraph_skips"] - counts0["cudagraph_skips"])
    return dict(bench="model", model=model, layers=layers or m.config.num_hidden_layers, seq_len=seq_len, batch=batch,
                recipe=recipe, mode=mode, step_ms=ms, tok_per_s=batch * seq_len / ms * 1e3, peak_mem_gib=peak,
                calibration_peak_mem_gib=calib_peak, warmup_s=warmup_s, bf16_small_gemms=small_gemms, small_gemms_bf16=small_gemm_count(m),
                strategies=_strategy_counts(m), **compiled, **check, **_where(device))


def _largest_batch(model: str, recipe: str, mode: str, seq_len: int, batch: int, layers: int | None, device: str,
                   small_gemms: bool, limit: int, trained: bool) -> dict:
    """``largest_batch``, ``batches_tried`` and ``search_start_mem_gib`` (GiB allocated when the search began: the
    row's memory must be gone by then) of one row (see :func:`bench_model`'s ``max_batch``). ``trained``: the row
    itself trained at ``batch``; a search that then finds a smaller batch gives ``largest_batch`` None and says why in
    ``largest_batch_error`` (as a search that failed does)."""
    import gc

    from .max_batch import batch_fits, largest_fitting

    gc.collect()  # the row's model (or the one that ran out of memory) is gone: start the search from its memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    def fits(b: int) -> bool:
        return batch_fits(lambda n: model_step(model, recipe, mode, seq_len, n, layers, device, small_gemms), b)

    start_gib = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
    largest, tried = largest_fitting(fits, batch, limit)
    out = dict(largest_batch=largest, batches_tried=[list(t) for t in tried], search_start_mem_gib=start_gib)
    if trained and largest < batch:  # the row trained at `batch`: memory the search did not start from was held
        out["largest_batch"] = None
        out["largest_batch_error"] = (f"the search found {largest} although the row trained at batch {batch}: "
                                      f"{start_gib or 0:.2f} GiB were allocated when it started; the result is not valid")
    return out


def _where(device) -> dict:
    """Where and when a row was measured: the GPU (or CPU), torch's version, the date (UTC)."""
    import datetime

    dev = torch.device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return dict(gpu=gpu, torch=torch.__version__, date=datetime.datetime.now(datetime.timezone.utc).date().isoformat())


def _strategy_counts(model: torch.nn.Module) -> str:
    """How many converted GEMMs run each strategy, e.g. ``"iht 40, bf16 8"`` (what the row measured)."""
    from collections import Counter

    from ..nn import LowPrecisionLinear

    c = Counter(s for m in model.modules() if isinstance(m, LowPrecisionLinear) for s in m.strategies().values())
    return ", ".join(f"{k} {v}" for k, v in c.most_common())


def _print(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    if keys:
        print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))


def run(args) -> None:
    """Run the chosen benchmark, print its table and merge its rows into ``--json`` (:func:`merge_rows`).
    ValueError without CUDA."""
    if not torch.cuda.is_available():
        raise ValueError("adahop bench needs a CUDA GPU; the CPU reference path is for correctness, not speed")
    if args.bench_cmd == "linear":
        rows = bench_linear(tuple(args.shapes.split(",")), tuple(int(t) for t in args.tokens.split(",")), args.reps,
                            cuda_graphs=args.cuda_graphs)
    else:
        rows = bench_model(args.model, recipes=tuple(args.recipes.split(",")), seq_len=args.seq_len, batch=args.batch_size,
                           layers=args.layers, steps=args.steps, modes=tuple(args.modes.split(",")),
                           small_gemms=args.bf16_small_gemms, max_batch=args.max_batch)
    _print(rows)
    if args.json:
        n = len(merge_rows(args.json, rows))
        print(f"{len(rows)} rows merged into {args.json} ({n} in all)")
