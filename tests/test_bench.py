"""`adahop bench model` harness on the CPU: the rows, the ratios, the strategy counts (the GPU
timings themselves live in docs/benchmarks.md, never in tests)."""

from __future__ import annotations

import json
import math

import pytest

from adahop.bench import bench_model


def test_bench_model_rows_on_cpu():
    rows = bench_model("llama-tiny", recipes=("bf16", "adahop-lv2", "nope"), seq_len=32, batch=2, steps=1,
                       modes=("eager",), device="cpu")
    assert [r["recipe"] for r in rows] == ["bf16", "adahop-lv2", "nope"]
    bf16, lv2, bad = rows
    assert bf16["vs_bf16"] == 1.0 and bf16["strategies"] == ""  # plain nn.Linear: nothing converted
    assert lv2["tok_per_s"] > 0 and math.isclose(lv2["vs_bf16"], lv2["tok_per_s"] / bf16["tok_per_s"])
    assert all(r["warmup_s"] > 0 for r in (lv2, bf16))
    # 2 calibration steps, then the frozen plan: every GEMM of the 14 linears got a strategy
    counts = dict(part.rsplit(" ", 1) for part in lv2["strategies"].split(", "))
    assert sum(int(v) for v in counts.values()) == 42 and "calibrating" not in counts
    assert "error" in bad and "nope" in bad["error"] and bad["vs_bf16"] is None  # recorded, not raised
    # the untimed check step: every parameter got a gradient, and Lv2 computes what BF16 does, roughly
    for r in (bf16, lv2):
        assert r["params_with_grad"] == r["params"] > 0 and r["grads_ok"]
    assert math.isclose(lv2["loss"], bf16["loss"], rel_tol=0.02)
    assert math.isclose(lv2["grad_norm"], bf16["grad_norm"], rel_tol=0.25)


def test_bench_model_auto_mode_counts_breaks_and_recompiles(monkeypatch):
    """``--modes auto`` compiles in `adahop train --compile`'s final mode (the default one on the CPU)
    once Lv2's plan is frozen, and the row says so: the mode, the compiling step's time, no graph
    break and no recompile after it (dynamo only here: fast, no C++ toolchain)."""
    import torch

    real, modes = torch.compile, []

    def recording(m, **kw):
        modes.append(kw.get("mode"))
        return real(m, backend="eager")

    monkeypatch.setattr(torch, "compile", recording)
    (row,) = bench_model("llama-tiny", recipes=("adahop-lv2",), seq_len=32, batch=2, steps=1, modes=("auto",), device="cpu")
    assert "error" not in row, row
    assert modes == ["default"] and row["compile_mode"] == "default"
    assert row["compile_step_s"] > 0 and row["graph_breaks"] == 0 and row["recompiles"] == 0
    assert row["grads_ok"]


def test_bench_model_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown mode"):
        bench_model("llama-tiny", modes=("fast",), device="cpu")


def test_layer_step_runs_forward_and_backward_of_each_kind_on_cpu():
    """`bench linear`'s step: each kind's weight gradient points where BF16's does (fresh inputs
    per call of layer_step, the same seed here)."""
    import torch

    from adahop.bench import layer_step

    grads = {}
    for kind in ("bf16", "mxfp4 fast", "adahop-lv2 fast (iht, wgrad oe_right)"):
        torch.manual_seed(0)
        layer, step = layer_step(kind, 128, 64, 96, "cpu")
        step()
        grads[kind] = next(layer.parameters()).grad.flatten().float()
    for kind in ("mxfp4 fast", "adahop-lv2 fast (iht, wgrad oe_right)"):
        assert torch.nn.functional.cosine_similarity(grads[kind], grads["bf16"], dim=0) > 0.95


def test_profile_model_flops_and_amdahl():
    """The step breakdown's arithmetic: training FLOPs of the converted linears and of the LM head
    (6 · params · tokens), Amdahl's end-to-end speedup and its inverse, and the kernel classes."""
    from adahop.bench import profile_model as pm

    # 4 blocks of Llama-3.1-8B: q, o 4096², k, v 4096·1024, gate, up, down 4096·14336; LM head 4096·32768
    lin, head = pm.linear_and_head_flops("llama3.1-8b", 4, 8192)
    assert lin == 6 * 4 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) * 8192
    assert head == 6 * 4096 * 32768 * 8192
    assert pm.e2e_speedup(100.0, 50.0, 2.0) == 100.0 / 75.0
    assert pm.e2e_speedup(100.0, 0.0, 5.0) == 1.0
    r = pm.linear_speedup_needed(114.6, 55.85, 1.3)
    assert abs(pm.e2e_speedup(114.6, 55.85, r) - 1.3) < 1e-12 and 1.89 < r < 1.91  # round 6's 8B-shaped figure
    assert pm.linear_speedup_needed(100.0, 10.0, 1.2) == float("inf")  # 90 of 100 stay: at most 1.11x
    assert pm.classify("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "GEMM FP8"
    assert pm.classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "GEMM BF16"
    assert pm.classify("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert pm.classify("_mx_quantize_kernel") == "quantize + fold (adahop)"
    assert pm.classify("triton_poi_fused_mul_silu_0").startswith("other")


# ----------------------------------------------------------------------------- rows and --json


def test_rows_merge_replaces_the_same_configuration_and_appends_the_rest(tmp_path):
    from adahop.bench.rows import ROW_FIELDS, merge_rows

    path = tmp_path / "sub" / "benchmarks.json"
    a = dict(bench="model", model="m", recipe="bf16", mode="eager", tok_per_s=10.0, date="2026-12-01")
    b = dict(bench="model", model="m", recipe="mxfp4", mode="eager", tok_per_s=5.0, peak_mem_gib=float("nan"))
    assert [r["recipe"] for r in merge_rows(path, [a, b])] == ["bf16", "mxfp4"]
    again = dict(a, tok_per_s=12.0, date="2026-12-02")  # measured again: replaces, keeps its place
    other = dict(a, mode="compiled")
    rows = json.loads(path.read_text())  # strict JSON: the NaN peak is null
    assert rows[1]["peak_mem_gib"] is None and all(set(ROW_FIELDS) <= set(r) for r in rows)
    rows = merge_rows(path, [again, other])
    assert [(r["recipe"], r["mode"], r["tok_per_s"]) for r in rows] == [("bf16", "eager", 12.0), ("mxfp4", "eager", 5.0),
                                                                       ("bf16", "compiled", 10.0)]
    assert json.loads(path.read_text()) == rows
    path.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="not a list of row objects"):
        merge_rows(path, [a])


def test_bench_model_rows_have_the_row_fields_and_count_small_gemms():
    from adahop.bench.rows import ROW_FIELDS

    rows = bench_model("llama-tiny", recipes=("bf16", "mxfp4"), seq_len=32, batch=2, steps=1, modes=("eager",),
                       device="cpu", small_gemms=True)
    for r in rows:
        assert list(r)[: len(ROW_FIELDS)] == list(ROW_FIELDS) and r["peak_mem_gib"] is None
        assert r["bench"] == "model" and r["gpu"] == "cpu" and r["bf16_small_gemms"] is True
    assert json.loads(json.dumps(rows, allow_nan=False)) == rows
    # llama-tiny (128 wide, MLP 384): every one of its 14 linears is under the rule's K·N, so all
    # 42 GEMMs run BF16, and the model computes BF16's loss exactly
    bf16, mx = rows
    assert bf16["small_gemms_bf16"] == 0 and mx["small_gemms_bf16"] == 42
    assert mx["loss"] == bf16["loss"]


# ----------------------------------------------------------------------------- torchao rows


def test_torchao_rows_fail_clearly_on_the_cpu():
    rows = bench_model("llama-tiny", recipes=("torchao-fp8-rowwise", "torchao-fp8-blockwise"), seq_len=32, batch=2,
                       steps=1, modes=("eager",), device="cpu")
    assert "needs a CUDA GPU with FP8 tensor cores" in rows[0]["error"] and rows[0]["tok_per_s"] is None
    assert "unknown torchao recipe 'torchao-fp8-blockwise'" in rows[1]["error"]


def test_torchao_config_checks_the_gpu_and_picks_the_scaling(monkeypatch):
    """The capability gate (monkeypatched: no GPU here) and the torchao recipe behind each name."""
    import torch

    pytest.importorskip("torchao")
    from torchao.float8.config import ScalingGranularity

    from adahop.bench.torchao_fp8 import float8_config

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    with pytest.raises(RuntimeError, match="capability 8.9 or more.*8.0"):
        float8_config("torchao-fp8-rowwise", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    row = float8_config("torchao-fp8-rowwise", "cuda")
    ten = float8_config("torchao-fp8-tensorwise", "cuda")
    assert row.cast_config_input.scaling_granularity == ScalingGranularity.AXISWISE
    assert ten.cast_config_input.scaling_granularity == ScalingGranularity.TENSORWISE


def test_torchao_conversion_swaps_the_linears_adahop_converts(monkeypatch):
    """Conversion alone runs on the CPU: every block linear becomes torchao's Float8Linear, the LM
    head stays, as under adahop's convert_model."""
    import torch

    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from adahop.bench.torchao_fp8 import convert_float8, float8_config
    from adahop.models import build_model

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    m = build_model("llama-tiny", vocab_size=256, max_seq_len=32)
    assert convert_float8(m, float8_config("torchao-fp8-tensorwise", "cuda")) == 14
    assert not isinstance(m.lm_head, Float8Linear) and isinstance(m.model.layers[0].mlp.down_proj, Float8Linear)


def test_bench_compile_stack_dumps_name_the_frame_the_main_thread_is_in(repo_script, capsys):
    # a cold compile that outlives its timeout must still say where it was (scripts/bench_compile.py --stack-every)
    import threading
    import time

    bc = repo_script("scripts/bench_compile.py")
    stop = threading.Event()
    t = threading.Thread(target=bc._stack_dumps, args=(0.05, stop), daemon=True)
    t.start()

    def stuck_in_a_compile():
        time.sleep(0.3)

    stuck_in_a_compile()
    stop.set()
    t.join()
    err = capsys.readouterr().err
    assert "--- main thread at" in err and "stuck_in_a_compile" in err


def test_largest_fitting_doubles_then_bisects_to_the_last_batch_that_fits():
    from adahop.bench.max_batch import largest_fitting
    assert largest_fitting(lambda b: b <= 11, 4, 64) == (11, [(4, True), (8, True), (16, False), (12, False),
                                                               (10, True), (11, True)])
    assert largest_fitting(lambda b: b <= 40, 4, 20) == (20, [(4, True), (8, True), (16, True), (20, True)])
    assert largest_fitting(lambda b: b <= 2, 8, 64) == (2, [(8, False), (4, False), (2, True), (3, False)])
    assert largest_fitting(lambda b: False, 2, 8) == (0, [(2, False), (1, False)])
    for cap in range(1, 40):  # every answer is the monotone predicate's edge, never past the limit
        for edge in range(0, 45):
            assert largest_fitting(lambda b: b <= edge, 1, cap)[0] == min(edge, cap)
    with pytest.raises(ValueError, match="--max-batch 2 must be at least --batch-size 4"):
        largest_fitting(lambda b: True, 4, 2)


def _oom_model_step(real, fails):
    """``harness.model_step`` whose model's steps raise CUDA's out-of-memory error when ``fails(batch)``, asked once
    as the model is built, said True (a fake allocator)."""
    import torch

    def make(model, recipe, mode, seq_len, batch, *a, **kw):
        m, step = real(model, recipe, mode, seq_len, batch, *a, **kw)
        full = fails(batch)

        def oom(i, record=False):
            if full:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
            return step(i, record)
        oom.compile_mode, oom.first_compiled, oom.calibration_steps = step.compile_mode, step.first_compiled, step.calibration_steps
        return m, oom
    return make


def test_bench_model_max_batch_reports_the_largest_batch_that_trains(monkeypatch):
    """On the CPU nothing runs out of memory: every try up to the limit trains 3 real steps, so the largest
    batch is the limit. Out of memory is what the GPU raises: a fake allocator that fails above 5 sequences
    is found at 5."""
    import torch

    import adahop.bench.harness as harness
    (row,) = bench_model("llama-tiny", recipes=("adahop-lv2",), seq_len=16, batch=2, steps=1, modes=("eager",),
                         device="cpu", max_batch=4)
    assert row["largest_batch"] == 4 and row["batches_tried"] == [[2, True], [4, True]]
    real = harness.model_step
    monkeypatch.setattr(harness, "model_step", _oom_model_step(real, lambda batch: batch > 5))
    (row,) = bench_model("llama-tiny", recipes=("bf16",), seq_len=16, batch=2, steps=1, modes=("eager",),
                         device="cpu", max_batch=8)
    assert row["largest_batch"] == 5 and [b for b, _ in row["batches_tried"]] == [2, 4, 8, 6, 5]
    # a row that runs out of memory at its own batch still finds the largest that fits, below it
    (row,) = bench_model("llama-tiny", recipes=("bf16",), seq_len=16, batch=8, steps=1, modes=("eager",),
                         device="cpu", max_batch=8)
    assert "out of memory" in row["error"] and row["largest_batch"] == 5
    assert [b for b, _ in row["batches_tried"]] == [8, 4, 6, 5]
    with pytest.raises(ValueError, match="--max-batch 1 must be at least --batch-size 2"):
        bench_model("llama-tiny", recipes=("bf16",), seq_len=16, batch=2, device="cpu", max_batch=1)

    # A compiled row's graphs (and on a GPU their CUDA-graph pool) live until torch.compiler.reset(): the
    # search must start after it. The fake runs out of memory while an earlier model's graphs are held.
    held = []
    real_reset = torch.compiler.reset

    def crowded(batch):
        full = bool(held)
        held.append(True)
        return full
    monkeypatch.setattr(harness, "model_step", _oom_model_step(real, crowded))
    monkeypatch.setattr(torch.compiler, "reset", lambda: (held.clear(), real_reset()))
    (row,) = bench_model("llama-tiny", recipes=("bf16",), seq_len=16, batch=2, steps=1, modes=("eager",),
                         device="cpu", max_batch=4)
    assert row["largest_batch"] == 4 and "largest_batch_error" not in row
    assert row["search_start_mem_gib"] is None  # no allocator counter on the CPU
    # memory held all the same (here: every model after the row's) gives a search result below the batch the
    # row trained at: the row says so instead of reporting it as the largest batch
    built = []

    def leaking(batch):
        built.append(batch)
        return len(built) > 1 and batch > 1
    monkeypatch.setattr(harness, "model_step", _oom_model_step(real, leaking))
    (row,) = bench_model("llama-tiny", recipes=("bf16",), seq_len=16, batch=2, steps=1, modes=("eager",),
                         device="cpu", max_batch=4)
    assert row["largest_batch"] is None and row["batches_tried"] == [[2, False], [1, True]]
    assert "found 1 although the row trained at batch 2" in row["largest_batch_error"]
    from adahop.utils import is_out_of_memory, out_of_memory_error
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory")) and not is_out_of_memory(RuntimeError("shape"))
    try:  # a compiler's error that carries it (BackendCompilerFailed's cause), its own message silent on memory
        try:
            raise torch.OutOfMemoryError("Tried to allocate 4.00 GiB")
        except torch.OutOfMemoryError as e:
            raise RuntimeError("backend='inductor' raised an error") from e
    except RuntimeError as wrapped:
        assert is_out_of_memory(wrapped)
        assert isinstance(out_of_memory_error(wrapped), torch.OutOfMemoryError)  # torch's own, not the wrapper


def test_saved_census_counts_each_storage_once_and_fits_tokens_apart_from_weights():
    """BF16 under autocast saves each linear's input as a BF16 copy (2 bytes per element, per token) and the
    weight's BF16 copy (fixed); plain MXFP4 saves 1-byte FP8 codes and scales instead. The fit separates
    the two exactly: per token, llama-tiny's down_proj input is its intermediate width times 2 bytes."""
    from adahop.bench.saved_census import census, linear_fit, project
    from adahop.models import PRESETS
    d, f = PRESETS["llama-tiny"]["hidden_size"], PRESETS["llama-tiny"]["intermediate_size"]
    fits = {}
    for r in ("bf16", "mxfp4"):
        small, large = (census("llama-tiny", r, 32, b, layers=1) for b in (2, 4))
        assert small["tokens"] == 64 and large["tokens"] == 128 and small["layers"] == 1
        assert sum(small["by_kind"].values()) == small["total"] == sum(small["by_dtype"].values())
        fits[r] = linear_fit(small, large)
    fixed, per_token = fits["bf16"]["block: down_proj"]
    assert per_token == 2 * f and fixed == 2 * d * f  # X and W in BF16
    assert fits["bf16"]["block: q_proj"][1] == 2 * d
    assert fits["bf16"]["block: o_proj"][1] == 0  # its X is attention's output, saved (and counted) there first
    fixed4, per_token4 = fits["mxfp4"]["block: down_proj"]
    assert per_token4 < per_token / 1.8 and fixed4 < fixed / 1.8  # FP8 codes plus E8M0 scales
    assert project(fits["bf16"], 3, 100) - project(fits["bf16"], 2, 100) == pytest.approx(
        sum(a + b * 100 for k, (a, b) in fits["bf16"].items() if k.startswith("block")))
    with pytest.raises(ValueError, match="two different token counts"):
        linear_fit(small, small)


def test_saved_census_of_a_compiled_step_counts_the_graphs_saved_tensors_by_shape(tmp_path, capsys):
    """Compiled, autograd still sees what the graph saves, but no module runs its hooks: every byte is in one row,
    named by dtype and shape, and the FP32 logits the loss keeps are among them, as eager. Nothing says which bytes
    are a block's, so the command projects no other depth. An unknown mode is refused."""
    import json

    from adahop.bench.saved_census import COMPILED_KIND, census, main
    vocab = 32768
    main(["--model", "llama-tiny", "--recipes", "bf16", "--seq-len", "32", "--batch-size", "1", "--mode", "compiled",
          "--json", str(tmp_path / "c.json")])
    (run,) = json.loads((tmp_path / "c.json").read_text())
    assert run["projected"] is None and "compiled, 1 blocks and the head, per token: bf16" in capsys.readouterr().out
    eager, compiled = census("llama-tiny", "bf16", 32, 2, layers=1), run["large"]
    assert list(compiled["by_kind"]) == [COMPILED_KIND] and compiled["mode"] == "compiled"
    assert sum(compiled["by_shape"].values()) == compiled["total"] == sum(compiled["by_dtype"].values())
    assert sum(eager["by_shape"].values()) == eager["total"] and COMPILED_KIND not in eager["by_kind"]
    for c in (eager, compiled):
        assert c["by_shape"][f"float32[64, {vocab}]"] == 64 * vocab * 4 and c["step_peak"] is None
    assert 0 < compiled["total"] <= eager["total"] * 1.05  # the partitioner recomputes; it does not save much more
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        census("llama-tiny", "bf16", 32, 2, layers=1, mode="fast")


def test_saved_census_refuses_a_compiled_census_whose_step_ran_eagerly(monkeypatch):
    """Past dynamo's recompile limit a step runs eagerly, and a checkpointed block's tensors then pass no saved-tensor
    hook (a 6-recipe census in one process counted 138,268 B a token for adahop-lv2+recompute, its blocks' inputs
    alone): the census compiles anew each time, and refuses a compiled census in which no frame compiled."""
    import torch

    from adahop.bench.saved_census import census

    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)  # what the limit does: the frame runs eagerly
    with pytest.raises(RuntimeError, match="compiled no frame: the step ran eagerly"):
        census("llama-tiny", "bf16", 32, 1, layers=1, mode="compiled")


@pytest.mark.parametrize("first_compiled, expected_gib", [(None, 16.0), (2, 12.0)], ids=["eager", "cuda-graphs"])
def test_bench_model_peak_spans_the_compile_of_a_compiled_row(monkeypatch, first_compiled, expected_gib):
    """The peak a row reports (round 31's silent wrong number): CUDA-graph replays allocate nothing, so a compiled row's
    peak must span its compile and graph recording; an eager row's is that of its timed steps. A fake CUDA
    allocator: the compiling step reaches 12 GiB and replays 7 GiB (the parameters and optimizer state alone);
    eager warm-up steps reach 20 GiB (first-step workspaces) and timed ones 16 GiB. The compiled row's two eager
    calibration steps reach 30 GiB: not its peak, but its own field (round 34: plain Lv2's calibration at
    Llama-3.2-1B 4096 x 8 did not fit an H100 whose compiled steps would have)."""
    import torch

    import adahop.bench.harness as harness

    gib = 2**30
    mem = {"peak": 0.0}

    def use(n):
        mem["peak"] = max(mem["peak"], n * gib)

    class Event:
        def record(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    def fake_model_step(model, recipe, mode, seq_len, batch, layers=None, device="cuda", small_gemms=False):
        m = torch.nn.Linear(2, 2)
        m.config = type("Config", (), {"num_hidden_layers": 1})()

        def step(i, record=False):
            if first_compiled is None:
                use(20 if i < 5 else 16)
            else:  # eager calibration steps (9 GiB), the compile and recording, then replays
                use(30 if i < first_compiled else 12 if i == first_compiled else 7)
            return {"loss": 1.0} if record else {}
        step.compile_mode = None if first_compiled is None else "max-autotune-no-cudagraphs"
        step.first_compiled = first_compiled
        step.calibration_steps = first_compiled or 0
        return m, step

    monkeypatch.setattr(harness, "model_step", fake_model_step)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: mem.update(peak=0.0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: mem["peak"])
    monkeypatch.setattr(torch.cuda, "Event", lambda **k: Event())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "fake GPU")
    row = harness._bench_model_row_timed("llama-tiny", "mxfp4", "auto" if first_compiled else "eager", 16, 2, None, 3,
                                         "cuda", False)
    assert row["peak_mem_gib"] == expected_gib and row["gpu"] == "fake GPU" and row["step_ms"] == 1.0
    assert row["calibration_peak_mem_gib"] == (30.0 if first_compiled else None)
