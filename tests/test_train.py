"""The main job: prepare → train → checkpoint → resume → export, divergence, compare table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from adahop.train import Diverged, TrainConfig, train
from adahop.train.compare import COLUMNS, format_table
from adahop.train.metrics import read_metrics


@pytest.fixture(scope="module")
def data_dir(prepare_real_text) -> Path:
    return prepare_real_text(150_000)


def _cfg(data_dir: Path, out: Path, **kw) -> TrainConfig:
    base = dict(model="llama-tiny", data=str(data_dir), out=str(out), seq_len=32, batch_size=4, steps=8,
                lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=2, ckpt_every=4, log_every=1, device="cpu",
                recipe="adahop-lv2", calib_steps=3)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("recipe,eval_every", [("adahop-lv2", 4), ("tseng", 3)])
def test_ctrl_c_then_resume_is_bit_exact(data_dir, tmp_path, single_thread, monkeypatch, recipe, eval_every):
    """tseng (stochastic rounding) with an evaluation at step 3, which the interrupted run skips:
    the evaluation must not move the SR streams of the steps after it."""
    import os
    import signal

    import adahop.train.loop as loop

    full = train(_cfg(data_dir, tmp_path / "full", ckpt_every=0, recipe=recipe, eval_every=eval_every))
    split = _cfg(data_dir, tmp_path / "split", ckpt_every=0, recipe=recipe, eval_every=eval_every)
    real, calls = loop.F.cross_entropy, {"n": 0}

    def ctrl_c_in_step_3(*a, **k):  # Ctrl-C arrives during step 3: that step finishes, is checkpointed, run stops
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(loop.F, "cross_entropy", ctrl_c_in_step_3)
    stopped = train(split)
    monkeypatch.setattr(loop.F, "cross_entropy", real)
    assert stopped["interrupted"] and [p.name for p in (tmp_path / "split" / "checkpoints").iterdir()] == ["step_0000003"]
    # resuming must reproduce steps 4..8 exactly: data order, LR schedule, the AdaHOP plan frozen at
    # step 3, SR streams and optimizer state all come back from the checkpoint
    resumed = train(dataclasses.replace(split, resume=True))
    a = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if "loss" in r}
    b = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "split" / "metrics.jsonl") if "loss" in r}
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert all(a[s] == b[s] for s in range(1, 9)), (a, b)
    assert full["final_val_loss"] == resumed["final_val_loss"]
    if recipe != "adahop-lv2":
        return
    plan = json.loads((tmp_path / "split" / "plan.json").read_text())
    assert plan["table"] == "lv2" and len(plan["layers"]) == 14  # 2 blocks x 7 linears
    assert stopped["steps"] == 3 and resumed["steps"] == 8  # the summary counts the steps that ran
    # the finished run's folder now refuses what would mix another run into it
    with pytest.raises(ValueError, match=r"holds checkpoints of an earlier run \(up to step 8\); pass --resume"):
        train(split)
    with pytest.raises(ValueError, match=r"--recipe 'adahop-lv2' → 'mxfp4'.*--seq-len 32 → 64"):
        train(dataclasses.replace(split, resume=True, recipe="mxfp4", seq_len=64, steps=12))
    with pytest.raises(ValueError, match="already at step 8; pass --steps above 8"):
        train(dataclasses.replace(split, resume=True))


def test_loss_falls_and_run_folder_is_complete(data_dir, tmp_path, single_thread):
    s = train(_cfg(data_dir, tmp_path / "r", steps=30, eval_every=30, ckpt_every=0, lr=1e-2))
    recs = read_metrics(tmp_path / "r" / "metrics.jsonl")
    losses = [r["loss"] for r in recs if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    for f in ("config.json", "metrics.jsonl", "loss.png", "summary.json", "plan.json", "model.safetensors"):
        assert (tmp_path / "r" / f).exists(), f
    assert s["saved_bytes"] > 0 and s["saved_bytes_bf16"] > 0
    assert 0 < s["final_val_bpb"] < 10


def test_export_loads_with_transformers(data_dir, tmp_path, single_thread):
    from transformers import AutoModelForCausalLM

    train(_cfg(data_dir, tmp_path / "r", steps=2, recipe="mxfp4"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "r")
    ids = torch.tensor([[1, 2, 3]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 3, 512) and torch.isfinite(logits).all()
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["adahop"]["config"]["recipe"] == "mxfp4"
    assert model.dtype == torch.bfloat16  # the weights are BF16 and config.json says so (dtype and torch_dtype)
    from adahop.data import Manifest

    eos = Manifest.load(data_dir).tokenizer.eos_id  # generate() must stop where the training documents ended
    assert model.config.eos_token_id == model.config.bos_token_id == model.generation_config.eos_token_id == eos


def test_gpt2_config_tied_embeddings_checkpoint_and_resume(data_dir, tmp_path, single_thread):
    """A transformers config whose tied weights are not Llama's (GPT-2: transformer.wte / lm_head)
    checkpoints, resumes and exports (the tie used to be found by name only: a safetensors error at
    the first checkpoint); and a quantizing recipe on GPT-2's Conv1D layers is refused, not run as BF16."""
    from transformers import AutoModelForCausalLM

    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64,
                                "vocab_size": 512}))
    kw = dict(recipe="bf16", model_config=str(gpt2), steps=4, ckpt_every=2, eval_every=0)
    train(_cfg(data_dir, tmp_path / "g", **kw))
    s = train(_cfg(data_dir, tmp_path / "g", **dict(kw, steps=6), resume=True))
    assert s["steps"] == 6
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "g")
    assert m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()  # still tied after the export
    with pytest.raises(ValueError, match="Conv1D"):
        train(_cfg(data_dir, tmp_path / "h", **dict(kw, recipe="mxfp4")))


def test_divergence_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path, single_thread, monkeypatch):
    import adahop.train.loop as loop

    real = loop.F.cross_entropy
    calls = {"n": 0}

    def poisoned(*a, **k):  # the loss turns NaN in the 6th training step
        calls["n"] += 1
        out = real(*a, **k)
        return out * float("nan") if calls["n"] == 6 + 2 else out  # +2: the eval pass at step 4 (2 batches)

    monkeypatch.setattr(loop.F, "cross_entropy", poisoned)
    with pytest.raises(Diverged, match="last good checkpoint"):
        train(_cfg(data_dir, tmp_path / "r", steps=8, recipe="bf16"))
    kept = sorted((tmp_path / "r" / "checkpoints").glob("step_*"))
    assert [p.name for p in kept] == ["step_0000004"]
    weights = kept[0] / "model.safetensors"
    from safetensors.torch import load_file

    assert all(torch.isfinite(v).all() for v in load_file(weights).values())


def test_bad_options_fail_before_training(data_dir, tmp_path):
    with pytest.raises(ValueError, match="--grad-accum"):
        _cfg(data_dir, tmp_path, batch_size=4, grad_accum=3)
    with pytest.raises(ValueError, match=r"--beta2: must be in \[0, 1\)"):
        _cfg(data_dir, tmp_path, beta2=1.5)
    with pytest.raises(ValueError, match="unknown recipe"):
        train(_cfg(data_dir, tmp_path / "x", recipe="nope"))
    with pytest.raises(ValueError, match="seq"):
        train(_cfg(data_dir, tmp_path / "y", seq_len=100_000))
    with pytest.raises(ValueError, match="--data"):
        train(_cfg(data_dir, tmp_path / "z", data=str(tmp_path / "missing.txt")))
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    with pytest.raises(ValueError, match="--plan is for AdaHOP recipes"):
        train(_cfg(data_dir, tmp_path / "w", recipe="mxfp4", plan=str(plan)))
    plan.write_text("not json")
    with pytest.raises(ValueError, match=r"--plan .*plan.json: .*not valid JSON|--plan .*plan.json: Expecting value"):
        train(_cfg(data_dir, tmp_path / "v", plan=str(plan)))


def test_run_ending_inside_calibration_warns_and_says_so(data_dir, tmp_path, single_thread, capsys):
    """--steps within the calibration: every GEMM stays BF16, so the run warns and its summary
    says the plan never froze (it would otherwise pass for an AdaHOP result)."""
    s = train(_cfg(data_dir, tmp_path / "short", steps=2, calib_steps=3, eval_every=0, ckpt_every=0))
    assert "no step runs with its frozen plan" in capsys.readouterr().err and s["plan_frozen"] is False
    assert not (tmp_path / "short" / "plan.json").exists()
    s = train(_cfg(data_dir, tmp_path / "long", steps=4, calib_steps=3, eval_every=0, ckpt_every=0))
    assert s["plan_frozen"] is True and (tmp_path / "long" / "plan.json").exists()
    given = train(_cfg(data_dir, tmp_path / "given", steps=1, eval_every=0, ckpt_every=0,
                       plan=str(tmp_path / "long" / "plan.json")))
    assert given["plan_frozen"] is True and (tmp_path / "given" / "plan.json").read_text() == \
        (tmp_path / "long" / "plan.json").read_text()
    assert train(_cfg(data_dir, tmp_path / "mx", recipe="mxfp4", steps=1, eval_every=0, ckpt_every=0))["plan_frozen"] is None


def test_compare_refuses_earlier_runs_made_with_other_settings(data_dir, tmp_path, single_thread):
    """`compare` into a folder whose recipe runs used other settings refuses before training (their
    numbers would be mixed into the table); `--data default` and its prepared cache folder, or the
    same folder spelled two ways, are the same data."""
    from adahop.train.compare import compare
    from adahop.train.setup import RESUME_KEYS, settings_diff

    out = tmp_path / "cmp"
    cfg = _cfg(data_dir, out / "bf16", recipe="bf16", steps=2, eval_every=0, ckpt_every=0)
    train(cfg)
    assert settings_diff(cfg, out / "bf16", RESUME_KEYS) == []
    same_data = dataclasses.replace(cfg, data=str(data_dir) + "/./")
    assert settings_diff(same_data, out / "bf16", RESUME_KEYS) == []
    assert settings_diff(dataclasses.replace(cfg, seed=1), out / "bf16", RESUME_KEYS) == ["--seed 0 → 1"]
    with pytest.raises(ValueError, match=r"other settings \(--lr 0.003 → 0.001\)"):
        compare(["bf16"], dataclasses.replace(cfg, lr=1e-3, out=str(out)), out)
    with pytest.raises(ValueError, match="no recipes"):
        compare([], cfg, out)


def test_compare_exits_nonzero_when_a_recipe_fails(monkeypatch, tmp_path):
    import adahop.train.compare as cmp
    from adahop.cli import main

    monkeypatch.setattr(cmp, "compare", lambda recipes, cfg, out: {"bf16": {"final_val_loss": 1.0}, "mxfp4": {"error": "exit code 2"}})
    assert main(["compare", "--recipes", "bf16,mxfp4", "--out", str(tmp_path / "c")]) == 1
    monkeypatch.setattr(cmp, "compare", lambda recipes, cfg, out: {"bf16": {"final_val_loss": 1.0}})
    assert main(["compare", "--recipes", "bf16", "--out", str(tmp_path / "c")]) == 0


def test_machine_and_folder_errors_name_the_option_and_are_left_in_the_run_folder(data_dir, tmp_path, monkeypatch, capsys):
    from adahop.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "run"
    out.mkdir()  # as compare makes it before each recipe's run
    args = ["train", "--model", "llama-tiny", "--data", str(data_dir), "--seq-len", "32", "--batch-size", "4",
            "--steps", "2", "--recipe", "mxfp4", "--device", "cpu"]
    assert main([*args, "--backend", "triton", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--backend triton: backend='triton' needs a CUDA device" in err and "Traceback" not in err
    assert "--backend triton" in (out / "error.txt").read_text()
    (tmp_path / "afile").write_text("")
    assert main([*args, "--out", str(tmp_path / "afile" / "run")]) == 2
    assert "cannot create the run folder" in capsys.readouterr().err
    assert main([*args, "--out", str(out)]) == 0  # a new attempt that succeeds clears the stale error
    assert not (out / "error.txt").exists() and (out / "summary.json").exists()


def test_compare_table_fields():
    summaries = {
        "bf16": dict(final_val_loss=4.0, final_val_bpb=1.5, tok_per_s=1000.0, peak_memory_bytes=2**30,
                     saved_bytes=2**20, saved_bytes_bf16=2**20, bytes_per_param=16.0),
        "adahop-lv2": dict(final_val_loss=4.02, final_val_bpb=1.51, tok_per_s=900.0, peak_memory_bytes=2**29,
                           saved_bytes=2**18, saved_bytes_bf16=2**20),
        "broken": {"error": "exit code 1"},
        "halo-2": dict(final_val_loss=4.1, unquantizable_layers=2),
    }
    rows = format_table(summaries)
    assert len(COLUMNS) == 8 and all(len(r) == 8 for r in rows)
    assert rows[0][7] == "16.00" and rows[1][7] == "-"
    assert rows[0][:5] == ["bf16", "4.0000", "+0.00", "1.5000", "1,000"]
    assert rows[1][2] == "+0.50" and rows[1][6] == "0.25 (1.00)"
    assert rows[3][0] == "halo-2 (2 layers BF16: shape)" and rows[3][2] == "+2.50"
    assert rows[2][1] == "failed"


def test_compiled_run_reports_no_graph_break_after_the_plan_freeze(data_dir, tmp_path, single_thread, monkeypatch):
    """`--compile` with AdaHOP-Lv2: calibration runs eagerly (graph breaks by design), the frozen
    model recompiles whole; summary.json counts the breaks after that (0); its counter sees a real one."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend="eager"))  # dynamo only: fast, no toolchain
    s = train(_cfg(data_dir, tmp_path / "c", steps=4, calib_steps=2, eval_every=0, ckpt_every=0, compile=True))
    assert s["graph_breaks_steady_state"] == 0 and s["steps"] == 4
    assert train(_cfg(data_dir, tmp_path / "e", steps=2, eval_every=0, ckpt_every=0))["graph_breaks_steady_state"] is None


    from adahop.train.loop import _graph_breaks

    def f(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    before = _graph_breaks()
    torch.compile(f, backend="eager")(torch.ones(3))
    assert _graph_breaks() == before + 1  # the counter the summary reads sees a real break


def test_nan_gradient_with_a_finite_loss_is_a_divergence(data_dir, tmp_path, single_thread, monkeypatch):
    """A step whose gradient norm is NaN while its loss is still finite (lr far too high) stops the
    run before that step is checkpointed: the kept checkpoint is the one before, all finite."""
    real = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def poisoned(params, max_norm, *a, **k):  # the 3rd step's gradients turn NaN
        params = list(params)
        calls["n"] += 1
        if calls["n"] == 3:
            params[0].grad.fill_(float("nan"))
        return real(params, max_norm, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned)
    with pytest.raises(Diverged, match="gradient norm became non-finite"):
        train(_cfg(data_dir, tmp_path / "r", steps=6, recipe="bf16", ckpt_every=1, keep_ckpts=1, eval_every=0))
    kept = sorted((tmp_path / "r" / "checkpoints").glob("step_*"))
    assert [p.name for p in kept] == ["step_0000002"]
    from safetensors.torch import load_file

    assert all(torch.isfinite(v).all() for v in load_file(kept[0] / "model.safetensors").values())


def test_resume_repairs_what_an_interruption_left(data_dir, tmp_path, single_thread):
    """The export missing after the final checkpoint: --resume writes it. A damaged newest checkpoint:
    the error names it and the older one to fall back to. Changed optimizer settings are refused.
    Files are written with the umask's mode (not mkstemp's 0600)."""
    import os

    run = tmp_path / "r"
    cfg = _cfg(data_dir, run, recipe="bf16", steps=4, ckpt_every=2, eval_every=0)
    train(cfg)
    (run / "model.safetensors").unlink()
    s = train(dataclasses.replace(cfg, resume=True))
    assert s["steps"] == 4 and (run / "model.safetensors").exists()
    umask = os.umask(0)
    os.umask(umask)
    assert (run / "config.json").stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(ValueError, match=r"--lr 0.003 → 0.01"):
        train(dataclasses.replace(cfg, resume=True, steps=6, lr=1e-2))
    newest = run / "checkpoints" / "step_0000004" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"step_0000004 cannot be read .*resume from step_0000002"):
        train(dataclasses.replace(cfg, resume=True, steps=6))


def test_compare_csv_quotes_cells_with_commas(tmp_path):
    import csv

    from adahop.train.compare import write_csv

    rows = [["bf16", "5.4426", "+0.00", "1.6897", "1,663", "1,775", "18.00 (19.50)"]]
    write_csv(tmp_path / "c.csv", rows)
    with open(tmp_path / "c.csv", newline="") as f:
        got = list(csv.reader(f))
    assert got == [list(COLUMNS), rows[0]]


def test_a_given_plan_of_the_other_level_is_saved_as_it_ran(data_dir, tmp_path, single_thread):
    from adahop.patterns import Plan

    lv2 = train(_cfg(data_dir, tmp_path / "lv2", steps=4, calib_steps=3, eval_every=0, ckpt_every=0))
    assert lv2["plan_frozen"] is True
    with pytest.warns(UserWarning, match="re-derived"):
        train(_cfg(data_dir, tmp_path / "lv1", recipe="adahop-lv1", steps=1, eval_every=0, ckpt_every=0,
                   plan=str(tmp_path / "lv2" / "plan.json")))
    assert Plan.load(tmp_path / "lv1" / "plan.json").table == "lv1"


def test_a_second_run_into_the_same_out_is_refused_while_the_first_runs(data_dir, tmp_path, monkeypatch):
    import adahop.train.loop as loop

    seen = {}

    def nested(cfg, rank, world):  # while the run holds its folder, start another into it
        with pytest.raises(ValueError, match="another adahop run is writing to this folder"):
            train(cfg)
        seen["refused"] = True
        raise RuntimeError("stop here")

    monkeypatch.setattr(loop, "_train", nested)
    with pytest.raises(RuntimeError, match="stop here"):
        train(_cfg(data_dir, tmp_path / "r"))
    assert seen["refused"]
    monkeypatch.undo()
    assert train(_cfg(data_dir, tmp_path / "r", recipe="bf16", steps=1, eval_every=0, ckpt_every=0))["steps"] == 1  # released
