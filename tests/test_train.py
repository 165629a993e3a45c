"""The main job: prepare → train → checkpoint → resume → export, divergence, compare table."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from adahop import get_recipe
from adahop.train import Diverged, TrainConfig, train
from adahop.train.compare import COLUMNS, _markdown, format_table
from adahop.train.metrics import read_metrics


@pytest.fixture(scope="module")
def data_dir(prepare_real_text) -> Path:
    return prepare_real_text(150_000)


def _cfg(data_dir: Path, out: Path, **kw) -> TrainConfig:
    base = dict(model="llama-tiny", data=str(data_dir), out=str(out), seq_len=32, batch_size=4, steps=8,
                lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=2, ckpt_every=4, log_every=1, device="cpu",
                recipe="adahop-lv2", calib_steps=3)
    base.update(kw)
    if base.get("plan") and "calib_steps" not in kw:  # a frozen plan: no calibration to set (refused with one)
        base["calib_steps"] = None
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


def test_a_resume_that_runs_no_step_keeps_the_measured_numbers(data_dir, tmp_path, single_thread, monkeypatch):
    """A finished run whose export was lost (a full disk at the export says: --resume) resumed at its last step:
    no step ran, and the summary (so `adahop compare`'s table) gave tokens/s null, 0 bytes saved for backward
    and the peak memory of a process that only loaded, validated and exported."""
    import adahop.train.loop as loop

    cfg = _cfg(data_dir, tmp_path / "r", recipe="mxfp4", steps=6, ckpt_every=0, eval_every=3)
    first = train(cfg)
    assert first["tok_per_s"] and first["saved_bytes"] > 0
    (tmp_path / "r" / "model.safetensors").unlink()
    monkeypatch.setattr(loop, "peak_memory", lambda device: 1)  # the resuming process's own peak: not the run's
    again = train(dataclasses.replace(cfg, resume=True))
    assert (tmp_path / "r" / "model.safetensors").exists()
    for k in ("tok_per_s", "peak_memory_bytes", "saved_bytes", "saved_bytes_bf16"):
        assert again[k] == first[k], k
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["tok_per_s"] == first["tok_per_s"]
    assert again["final_val_loss"] == first["final_val_loss"] and again["steps"] == 6


def test_a_resume_that_runs_no_step_validates_at_its_last_step(data_dir, tmp_path, single_thread, monkeypatch, capsys):
    """Stopped by SIGTERM at step 3 (a checkpoint, as Ctrl-C gives), resumed with --steps 3: no step ran, and the
    summary's final val loss was step 2's."""
    import os
    import signal

    import adahop.train.loop as loop

    cfg = _cfg(data_dir, tmp_path / "r", recipe="bf16", steps=6, ckpt_every=0, eval_every=2)
    real, calls = loop.F.cross_entropy, {"n": 0}

    def term_in_step_3(*a, **k):  # SIGTERM (timeout, SLURM, docker stop) lost the steps since the last checkpoint
        calls["n"] += 1
        if calls["n"] == 5:  # steps 1 and 2, step 2's two validation batches, then step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(loop.F, "cross_entropy", term_in_step_3)
    assert train(cfg)["interrupted"]
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step_0000003"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back
    monkeypatch.setattr(loop.F, "cross_entropy", real)
    s = train(dataclasses.replace(cfg, resume=True, steps=3))
    vals = {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "val_loss" in r}
    assert sorted(vals) == [2, 3] and s["final_val_loss"] == vals[3] and s["steps"] == 3
    assert "--resume with" not in capsys.readouterr().err
    # a resume that turns --compile on is allowed, and says that the run is then not the uninterrupted one to the bit
    from adahop.train.setup import check_run_dir

    (tmp_path / "r" / "model.safetensors").unlink()
    assert check_run_dir(dataclasses.replace(cfg, resume=True, steps=3, compile=True), tmp_path / "r") == 3
    assert "warning: --resume with --compile False → True: compiled and eager steps agree to float rounding" in \
        capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["nvfp4", "tseng"])
def test_a_resume_that_toggles_compile_of_a_stochastic_recipe_says_the_random_stream_changes(recipe, data_dir, tmp_path,
                                                                                              single_thread, capsys):
    """Compiled layers draw their stochastic-rounding bits and random signs from another stream than eager ones
    (seed_compiled_rng): the resumed run is another sample, not the uninterrupted run to float rounding."""
    from adahop.train.setup import check_run_dir

    cfg = _cfg(data_dir, tmp_path / "r", recipe=recipe, steps=2, ckpt_every=1, eval_every=0, calib_steps=None)
    train(cfg)
    (tmp_path / "r" / "model.safetensors").unlink()
    capsys.readouterr()
    assert check_run_dir(dataclasses.replace(cfg, resume=True, compile=True), tmp_path / "r") == 2
    err = capsys.readouterr().err
    assert f"recipe {recipe} draws random bits" in err and "agree to float rounding" not in err


def test_loss_falls_and_run_folder_is_complete(data_dir, tmp_path, single_thread):
    s = train(_cfg(data_dir, tmp_path / "r", steps=30, eval_every=30, ckpt_every=0, lr=1e-2))
    recs = read_metrics(tmp_path / "r" / "metrics.jsonl")
    losses = [r["loss"] for r in recs if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    for f in ("config.json", "metrics.jsonl", "loss.png", "summary.json", "plan.json", "model.safetensors"):
        assert (tmp_path / "r" / f).exists(), f
    assert s["saved_bytes"] > 0 and s["saved_bytes_bf16"] > 0
    assert 0 < s["final_val_bpb"] < 10


def test_tokens_per_second_is_null_until_measured(data_dir, tmp_path, single_thread):
    """The first two steps are warm-up (not timed): their records said tok_per_s 0.0, a speed of zero."""
    from adahop.plots import plot_run

    s = train(_cfg(data_dir, tmp_path / "r", recipe="bf16", steps=3, eval_every=0, ckpt_every=0))
    recs = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "loss" in r]
    assert [r["tok_per_s"] for r in recs[:2]] == [None, None] and recs[2]["tok_per_s"] > 0
    assert '"tok_per_s": null' in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0]
    assert s["tok_per_s"] == pytest.approx(recs[2]["tok_per_s"])
    plot_run(recs, tmp_path / "loss.png", title="t")  # the readers take the nulls
    assert (tmp_path / "loss.png").stat().st_size > 0


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
    # the same path, its file edited: --resume ran the new architecture on the old weights, silently
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64,
                                "vocab_size": 512, "activation_function": "relu"}))
    with pytest.raises(ValueError, match="--model-config .* was edited since the run \\(activation_function None → 'relu'\\)"):
        train(_cfg(data_dir, tmp_path / "g", **dict(kw, steps=8), resume=True))
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


def test_a_resumed_diverged_run_keeps_the_runs_own_loss_limit(data_dir, tmp_path, single_thread, monkeypatch):
    """The limit came from the first loss of each process: a resume after a divergence took its own, already
    diverged loss as the reference, trained on past the documented limit and pruned the last good checkpoint."""
    import adahop.train.loop as loop

    real = loop.F.cross_entropy
    calls = {"n": 0}

    def blown(*a, **k):  # from the 6th training step on, every loss is 10x: finite, far above the limit
        calls["n"] += 1
        out = real(*a, **k)
        return out * 10 if calls["n"] >= 6 + 2 else out  # +2: the eval pass at step 4 (2 batches)

    monkeypatch.setattr(loop.F, "cross_entropy", blown)
    with pytest.raises(Diverged, match="last good checkpoint"):
        train(_cfg(data_dir, tmp_path / "r", steps=12, recipe="bf16"))
    state = json.loads((tmp_path / "r" / "checkpoints" / "step_0000004" / "state.json").read_text())
    first = read_metrics(tmp_path / "r" / "metrics.jsonl")[0]
    vocab = json.loads((tmp_path / "r" / "config.json").read_text())["vocab_size"]
    assert first["step"] == 1 and state["loss_ceiling"] == pytest.approx(2 * max(math.log(vocab), first["loss"]), rel=1e-5)
    with pytest.raises(Diverged, match=f"above {state['loss_ceiling']:.3g}"):
        train(_cfg(data_dir, tmp_path / "r", steps=12, recipe="bf16", resume=True))
    kept = sorted((tmp_path / "r" / "checkpoints").glob("step_*"))
    assert [p.name for p in kept] == ["step_0000004"]  # still the last good one


def test_an_out_holding_data_a_model_or_a_finished_run_is_refused_not_overwritten(data_dir, tmp_path, single_thread):
    """Without checkpoints there, --out was trained into whatever it held: a data folder lost its tokenizer.json,
    a model folder its weights, a finished run whose checkpoints were deleted was silently retrained."""
    import shutil

    from adahop.train.setup import check_run_dir

    cfg = _cfg(data_dir, tmp_path / "x", recipe="bf16")
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    before = (data / "manifest.json").read_bytes()
    with pytest.raises(ValueError, match="is a prepared data folder"):
        check_run_dir(cfg, data)
    assert (data / "manifest.json").read_bytes() == before
    from adahop.cli import main

    # through the CLI: refused, and no error.txt left in the data folder (data prepare would then refuse it)
    assert main(["train", *TINY_ARGS, "--data", str(data), "--out", str(data), "--steps", "1"]) == 2
    assert not (data / "error.txt").exists()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="another model's config.json"):
        check_run_dir(cfg, model)
    (model / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match=r"holds a model \(model.safetensors\) and no checkpoint"):
        check_run_dir(cfg, model)
    died = tmp_path / "died"  # a start that died before its first checkpoint: its own config.json, no weights
    died.mkdir()
    (died / "config.json").write_text(json.dumps({"model_type": "llama", "adahop": {"config": {"recipe": "bf16"}}}))
    assert check_run_dir(cfg, died) is None


def test_a_prepared_folder_whose_tokenizer_changed_is_refused(data_dir, tmp_path):
    """A data folder whose tokenizer.json was replaced trained on, and the run exported a tokenizer whose ids
    were not the model's."""
    import shutil

    from adahop.data import Manifest
    from adahop.train.setup import resolve_data

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    assert resolve_data(_cfg(data, tmp_path / "r")) == data  # untouched: accepted
    spec = Manifest.load(data).tokenizer.spec
    tok_file = data / spec.split(":", 1)[-1]
    tok = json.loads(tok_file.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # two ids swapped: same size, other tokens
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_file.write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="its tokenizer .* has another vocabulary or merges than the tokens were made with"):
        resolve_data(_cfg(data, tmp_path / "r"))


def test_a_data_folder_prepared_again_during_the_run_does_not_give_the_run_its_tokenizer(data_dir, tmp_path):
    """`data prepare --overwrite` of the run's data folder while it trained: the export copied the new tokenizer
    beside weights trained on the old ids, and eval scored below chance (helper 38). The run writes its tokenizer
    at the start; the export rewrites it only while the folder's is still the recorded one."""
    import shutil
    import warnings

    from adahop.train import train
    from adahop.train.export import export_hf

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    run = tmp_path / "r"
    train(_cfg(data, run, recipe="bf16", calib_steps=None, steps=2, eval_every=0, ckpt_every=0))
    ours = (run / "tokenizer.json").read_text()
    man = json.loads((data / "manifest.json").read_text())  # the folder prepared again with another tokenizer
    man["tokenizer"]["sha256"] = "0" * 64
    (data / "manifest.json").write_text(json.dumps(man))
    (run / "tokenizer.json").write_text(ours)
    model = type("M", (), {"state_dict": lambda self: {"w": torch.zeros(2)}})()
    with pytest.warns(UserWarning, match="no longer the one this run trained with"):
        export_hf(run, model, data)
    assert (run / "tokenizer.json").read_text() == ours
    (run / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match="and has none"):
        export_hf(run, model, data)
    man["tokenizer"]["sha256"] = json.loads((run / "config.json").read_text())["adahop"]["data_identity"]["tokenizer"]["sha256"]
    (data / "manifest.json").write_text(json.dumps(man))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_hf(run, model, data)  # the recorded tokenizer again: written, no warning
    assert (run / "tokenizer.json").read_text() == ours


def test_a_full_disk_at_the_final_export_is_one_line_naming_resume(data_dir, tmp_path, monkeypatch, capsys):
    """The export's write on a full disk ended in a SafetensorError traceback (helper 38); a checkpoint's gives one
    line with the way on, and so does the export now; the resume then writes it."""
    import errno

    from adahop.cli import main
    from adahop.train import export

    real = export.save_file

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(export, "save_file", full)
    out = tmp_path / "r"
    args = ["train", *TINY_ARGS, "--data", str(data_dir), "--out", str(out), "--steps", "2", "--ckpt-every", "0"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error: the final weights could not be exported to" in err and "No space left on device" in err, err
    assert "then run the same command with --resume to write the export" in err and "Traceback" not in err
    assert not list(out.glob(".model.safetensors.tmp")) and not (out / "model.safetensors").exists()
    monkeypatch.setattr(export, "save_file", real)
    assert main([*args, "--resume"]) == 0 and (out / "model.safetensors").exists()


def test_vocab_size_with_a_tokenizer_of_its_own_is_refused_where_the_text_is_prepared(tmp_path):
    """`train --data a.txt --tokenizer tiktoken:... --vocab-size 5000` was accepted: the config recorded 5000 for a
    50,257-id model and the cache folder was named after it (`data prepare` refuses the same; helper 32)."""
    from adahop.train.setup import resolve_data

    (tmp_path / "a.txt").write_text("some text\n" * 100)
    cfg = TrainConfig(data=str(tmp_path / "a.txt"), tokenizer="gpt2", vocab_size=5000, out=str(tmp_path / "r"))
    with pytest.raises(ValueError, match="--vocab-size 5000 is for --tokenizer bpe; --tokenizer gpt2 brings its own"):
        resolve_data(cfg)


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
    with pytest.raises(ValueError, match="--calib-steps: 3 with --plan: the plan is frozen, so no calibration runs"):
        _cfg(data_dir, tmp_path / "u", plan=str(plan), calib_steps=3)  # the start-up table announced 3 steps


def test_reschedule_without_resume_is_refused(tmp_path, capsys):
    """--reschedule only changes the schedule a resumed run keeps: alone it did nothing, silently."""
    from adahop.cli import main

    with pytest.raises(ValueError, match="--reschedule: only applies with --resume"):
        TrainConfig(out=str(tmp_path / "r"), reschedule=True)
    assert TrainConfig(out=str(tmp_path / "r"), resume=True, reschedule=True).reschedule
    assert main(["train", "--reschedule", "--steps", "20", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["adahop train: error: --reschedule: only applies with --resume (it stretches a resumed run's cosine "
                   "decay over a larger --steps); add --resume to continue the run in --out, or drop --reschedule"]


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
    # a resume may not change the val windows either: its curve would mix two val sets
    assert settings_diff(dataclasses.replace(cfg, eval_batches=cfg.eval_batches + 1), out / "bf16", RESUME_KEYS) == [
        f"--eval-batches {cfg.eval_batches} → {cfg.eval_batches + 1}"]
    with pytest.raises(ValueError, match=r"other settings \(--lr 0.003 → 0.001\)"):
        compare(["bf16"], dataclasses.replace(cfg, lr=1e-3, out=str(out)), out)
    with pytest.raises(ValueError, match="no recipes"):
        compare([], cfg, out)


def test_compare_refuses_a_recipe_named_twice_and_calib_steps_no_recipe_uses(tmp_path, capsys, monkeypatch):
    """`--recipes bf16,bf16` trained bf16 once and then reused it as the "second" run, without a word;
    `--calib-steps` with recipes that all have fixed strategies did nothing, also without a word."""
    import adahop.train.compare as cmp
    from adahop.cli import main

    def no(*a, **k):
        raise AssertionError("compare went on to prepare data and train")

    monkeypatch.setattr(cmp, "resolve_data", no)
    monkeypatch.setattr(cmp, "_run_child", no)
    assert main(["compare", "--recipes", "bf16,mxfp4,bf16", "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"adahop compare: error: compare: --recipes names bf16 more than once; each recipe trains once, into "
        f"{tmp_path / 'c' / 'bf16'}: drop the repeat (for another seed, run compare again with --seed and a new --out)"]
    assert not (tmp_path / "c").exists()  # refused before anything is made
    assert main(["compare", "--recipes", "bf16,mxfp4", "--calib-steps", "5", "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "adahop compare: error: --calib-steps 5: none of --recipes bf16,mxfp4 has an AdaHOP calibration (their GEMM "
        "strategies are fixed), so it would do nothing; drop --calib-steps, or add a calibrating recipe such as adahop-lv2"]


def _stub_compare_children(tmp_path, monkeypatch) -> dict:
    """compare's recipe runs replaced by a stub that records each one's argv (by recipe) and "fails"."""
    import adahop.train.compare as cmp

    argvs = {}

    def child(argv):
        argvs[Path(argv[argv.index("--out") + 1]).name] = argv
        return 1, 0

    monkeypatch.setattr(cmp, "resolve_data", lambda cfg: tmp_path)
    monkeypatch.setattr(cmp, "_run_child", child)
    return argvs


def test_compare_passes_a_plan_to_the_calibrating_recipes_only(tmp_path, capsys, monkeypatch):
    """`compare --recipes bf16,adahop-lv2 --plan P` gave --plan to bf16 too, whose run refused it after the
    AdaHOP run had trained: the baseline row failed and the gap column was empty (helper 30)."""
    from adahop.cli import main

    argvs = _stub_compare_children(tmp_path, monkeypatch)
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    main(["compare", "--recipes", "bf16,adahop-lv2,mxfp4", "--plan", str(plan), "--out", str(tmp_path / "c")])
    assert "--plan" not in argvs["bf16"] and "--plan" not in argvs["mxfp4"]
    assert argvs["adahop-lv2"][argvs["adahop-lv2"].index("--plan") + 1] == str(plan)
    assert "note: --plan is for the calibrating recipes; bf16, mxfp4 (fixed strategies) run without it" in capsys.readouterr().out
    assert main(["compare", "--recipes", "bf16,mxfp4", "--plan", str(plan), "--out", str(tmp_path / "d")]) == 2
    assert "none of --recipes bf16,mxfp4 is an AdaHOP recipe" in capsys.readouterr().err


def test_compare_passes_calib_steps_to_the_calibrating_recipes_only(tmp_path, monkeypatch):
    """`compare --recipes bf16,mxfp4,adahop-lv2 --calib-steps 3` gave --calib-steps to bf16 and mxfp4 too (each
    warned "does nothing; drop --calib-steps") and recorded it in their runs; re-tabling bf16,mxfp4 alone was
    then refused both ways: with --calib-steps (no recipe calibrates) and without ("--calib-steps 3 → None")."""
    import adahop.train.compare as cmp
    from adahop.cli import main

    argvs = _stub_compare_children(tmp_path, monkeypatch)
    out = tmp_path / "c"
    main(["compare", "--recipes", "bf16,adahop-lv2", "--calib-steps", "3", "--out", str(out)])
    assert "--calib-steps" not in argvs["bf16"]
    assert argvs["adahop-lv2"][argvs["adahop-lv2"].index("--calib-steps") + 1] == "3"
    # a bf16 run an earlier adahop made with --calib-steps 3 is this comparison's, with or without the flag
    cfg = TrainConfig(recipe="bf16", calib_steps=3, out=str(out / "bf16"))
    (out / "bf16" / "config.json").write_text(json.dumps({"adahop": {"config": cfg.to_dict()}}))
    # settings_diff skips it for a recipe without calibration (it changes no number), as train --resume does
    assert cmp.settings_diff(cmp._recipe_cfg(TrainConfig(), "bf16"), out / "bf16", ["calib_steps"]) == []
    assert cmp.settings_diff(TrainConfig(recipe="adahop-lv2"), out / "bf16", ["calib_steps"]) == ["--calib-steps 3 → None"]
    # the preset's own 30 named or not: the same steps run (helper 61)
    assert cmp.settings_diff(TrainConfig(recipe="adahop-lv2", calib_steps=30), out / "bf16", ["calib_steps"]) == [
        "--calib-steps 3 → 30"]
    (out / "bf16" / "config.json").write_text(json.dumps({"adahop": {"config": TrainConfig(recipe="adahop-lv2").to_dict()}}))
    assert cmp.settings_diff(TrainConfig(recipe="adahop-lv2", calib_steps=30), out / "bf16", ["calib_steps"]) == []
    argvs.clear()
    assert main(["compare", "--recipes", "bf16", "--out", str(out)]) == 1  # the stub child "fails": but it ran
    assert "bf16" in argvs


def test_a_run_of_another_definition_of_its_recipe_is_neither_resumed_nor_reused(tmp_path, monkeypatch):
    """compare reused, and --resume went on with, a run whose preset an earlier adahop defined otherwise (e.g. the
    'ceil' scale rule of mxfp4 before 51bd110): the row was tabled as today's recipe (probe rivals). The recipe's
    definition recorded in config.json is now compared; its description's words are not."""
    import adahop.train.compare as cmp
    from adahop.train.setup import settings_diff

    run = tmp_path / "c" / "mxfp4"
    run.mkdir(parents=True)
    cfg = TrainConfig(recipe="mxfp4", out=str(run))
    now = repr(get_recipe("mxfp4"))

    def record(recipe_repr):
        (run / "config.json").write_text(json.dumps({"adahop": {"config": cfg.to_dict(), "recipe": recipe_repr}}))

    record(now.replace("description='", "description='reworded: ", 1))
    assert settings_diff(cfg, run, ("recipe",), definition=True) == []
    record(now.replace("scale_rule='floor'", "scale_rule='ceil'"))
    diff = settings_diff(cfg, run, ("recipe",), definition=True)
    assert len(diff) == 1 and "the mxfp4 recipe's definition changed since the run (scale_rule='ceil' → " \
        "scale_rule='floor'" in diff[0], diff
    assert settings_diff(cfg, run, ("recipe",)) == []  # definition=False: the compile toggle's check
    # a run of an adahop before Recipe.saved_operands: that field at its default changes no number
    record(now.replace(", saved_operands='mxfp4'", ""))
    assert settings_diff(cfg, run, ("recipe",), definition=True) == []
    fp8 = TrainConfig(recipe="mxfp4@saved-fp8", out=str(run))  # a field the run lacks, not at its default: a change
    (run / "config.json").write_text(json.dumps({"adahop": {"config": fp8.to_dict(), "recipe": repr(
        get_recipe("mxfp4@saved-fp8")).replace(", saved_operands='fp8'", "")}}))
    assert "→ saved_operands='fp8'" in settings_diff(fp8, run, ("recipe",), definition=True)[0]
    # a run of an adahop that had Recipe.dual_layout (removed): at its default it ran today's numbers; set, it did not
    assert "dual_layout" not in now
    record(now[:-1] + ", dual_layout=False)")
    assert settings_diff(cfg, run, ("recipe",), definition=True) == []
    record(now[:-1] + ", dual_layout=True)")
    diff = settings_diff(cfg, run, ("recipe",), definition=True)
    assert len(diff) == 1 and "the mxfp4 recipe's definition changed since the run (dual_layout=True;" in diff[0], diff
    # another --calib-steps is the flag's change, not a definition of another adahop version (probe user)
    lv2_4 = TrainConfig(recipe="adahop-lv2", calib_steps=4, out=str(run))
    from adahop.train.setup import _configured_recipe
    (run / "config.json").write_text(json.dumps({"adahop": {"config": lv2_4.to_dict(),
                                                            "recipe": repr(_configured_recipe(lv2_4))}}))
    lv2_5 = dataclasses.replace(lv2_4, calib_steps=5)
    assert settings_diff(lv2_5, run, ("recipe", "calib_steps"), definition=True) == ["--calib-steps 4 → 5"]
    record(now.replace("scale_rule='floor'", "scale_rule='ceil'"))
    monkeypatch.setattr(cmp, "resolve_data", lambda c: tmp_path)
    monkeypatch.setattr(cmp, "_run_child", lambda argv: pytest.fail("the stale run was reused or retrained"))
    with pytest.raises(ValueError, match="definition changed since the run"):
        cmp.compare(["mxfp4"], cfg, tmp_path / "c")


def test_compare_exits_nonzero_when_a_recipe_fails(monkeypatch, tmp_path):
    import adahop.train.compare as cmp
    from adahop.cli import main

    monkeypatch.setattr(cmp, "compare", lambda recipes, cfg, out: {"bf16": {"final_val_loss": 1.0}, "mxfp4": {"error": "exit code 2"}})
    assert main(["compare", "--recipes", "bf16,mxfp4", "--out", str(tmp_path / "c")]) == 1
    monkeypatch.setattr(cmp, "compare", lambda recipes, cfg, out: {"bf16": {"final_val_loss": 1.0}})
    assert main(["compare", "--recipes", "bf16", "--out", str(tmp_path / "c")]) == 0


def test_under_torchrun_the_first_rank_to_fail_keeps_error_txt(tmp_path, monkeypatch):
    """Every rank wrote error.txt, so the rank whose peer had failed (its "Connection closed by peer") overwrote
    the cause that compare shows (probe dist). Under torchrun the first rank to fail writes it, naming itself."""
    from argparse import Namespace

    from adahop.cli import _leave_error

    args = Namespace(cmd="train", out=str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    _leave_error(args, "adahop train: error: unexpected RuntimeError: ROOT CAUSE\n\nTraceback ...")
    monkeypatch.setenv("RANK", "0")
    _leave_error(args, "adahop train: error: unexpected RuntimeError: Connection closed by peer")
    lines = (tmp_path / "error.txt").read_text().splitlines()
    assert lines[:2] == ["adahop train: error: unexpected RuntimeError: ROOT CAUSE", "(rank 1 of 2, the first rank to fail)"]
    assert lines[3] == "Traceback ..."
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: the newest error, as before
    _leave_error(args, "adahop train: error: another")
    assert (tmp_path / "error.txt").read_text() == "adahop train: error: another\n"
    # a rank other than 0 starting (late) leaves the error in place; rank 0 and a single process clear it
    from adahop.train.setup import check_run_dir

    cfg = TrainConfig(out=str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    check_run_dir(cfg, tmp_path)
    assert (tmp_path / "error.txt").exists()
    monkeypatch.delenv("RANK")
    check_run_dir(cfg, tmp_path)
    assert not (tmp_path / "error.txt").exists()


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


def test_a_refused_resume_leaves_a_finished_run_as_it_was_and_a_no_op_calib_steps_does_not_block_it(data_dir, tmp_path,
                                                                                                      capsys):
    """helper 60: `train --recipe mxfp4 --calib-steps 10` warns that the flag does nothing and says to drop it; the
    resume without it was refused (--calib-steps 10 → None), and the refusal was written into the finished run's
    folder as error.txt, which means "the run failed". An empty --out wrote the run into the working directory."""
    from adahop.cli import main

    out = tmp_path / "run"
    args = ["train", "--model", "llama-tiny", "--data", str(data_dir), "--seq-len", "32", "--batch-size", "4",
            "--recipe", "mxfp4", "--device", "cpu", "--eval-every", "0", "--out", str(out)]
    assert main([*args, "--steps", "2", "--calib-steps", "10"]) == 0
    assert "--calib-steps 10 does nothing" in capsys.readouterr().out
    assert main([*args, "--steps", "3", "--resume"]) == 0  # as the warning advised: the flag dropped
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert main([*args, "--steps", "3", "--resume", "--lr", "1e-2"]) == 2  # refused: the run is left as it was
    assert "these settings differ" in capsys.readouterr().err and not (out / "error.txt").exists()
    assert main([*args, "--steps", "3"]) == 2  # its checkpoints, without --resume
    assert "holds checkpoints of an earlier run" in capsys.readouterr().err and not (out / "error.txt").exists()
    assert main([*args, "--steps", "4", "--resume", "--lr", "-1"]) == 2  # a bad option (helper 61)
    assert "--lr: must be > 0" in capsys.readouterr().err and not (out / "error.txt").exists()
    (out / "error.txt").write_text("adahop train: error: an earlier attempt\n")  # kept through a refusal too
    assert main([*args, "--steps", "3", "--resume", "--lr", "1e-2"]) == 2
    assert (out / "error.txt").read_text() == "adahop train: error: an earlier attempt\n"
    # an unfinished run (compare reruns those, and shows error.txt's first line): the refusal is left there
    (out / "summary.json").unlink()
    assert main([*args, "--steps", "3", "--resume"]) == 2
    assert "is already at step 3" in (out / "error.txt").read_text()
    with pytest.raises(ValueError, match="--out: is empty; pass the run folder"):
        _cfg(data_dir, "")
    assert main([*args[:-2], "--steps", "1", "--out", ""]) == 2
    assert "--out: is empty" in capsys.readouterr().err
    assert main(["ptq", str(out), "--method", "rtn", "--bits", "4", "--calib-data", str(data_dir), "--out", ""]) == 2
    assert "adahop ptq: error: --out is empty; pass a folder path" in capsys.readouterr().err
    assert main(["eval", str(out), "--tasks", "none", "--data", str(data_dir), "--out", ""]) == 2
    assert "adahop eval: error: --out is empty; pass a file path" in capsys.readouterr().err
    for cmd in (["data", "prepare", "--source", str(data_dir), "--out", " "],
                ["analyze", "--synthetic", "--synthetic-size", "64", "--synthetic-seeds", "0", "--out", ""]):
        assert main(cmd) == 2 and f"adahop {cmd[0]}: error: --out is empty" in capsys.readouterr().err
    assert not (Path.cwd() / " ").exists()


def test_a_second_compare_into_the_same_out_is_refused(data_dir, tmp_path):
    """Two compares into one --out each trained one recipe and tabled the other's, complete, as failed (helper 38)."""
    from adahop.train import TrainConfig
    from adahop.train.compare import compare
    from adahop.utils import lock_folder

    out = tmp_path / "c"
    held = lock_folder(out, "adahop compare")  # the first compare, still training
    cfg = TrainConfig(model="llama-tiny", data=str(data_dir), seq_len=32, batch_size=4, steps=2, device="cpu")
    with pytest.raises(ValueError, match=rf"--out {out}: another adahop compare is writing to this folder"):
        compare(["bf16"], cfg, out)
    held.close()
    assert not (out / "bf16").exists()  # nothing trained by the refused one


def test_compare_plots_draw_only_runs_that_logged_a_loss(tmp_path):
    """A recipe that failed before logging a loss gets no line; with none, no empty figure is written (it was,
    with matplotlib's "No artists with labels" warning), and an earlier comparison's plots are removed."""
    from adahop.plots import plot_compare

    (tmp_path / "loss_diff.png").write_bytes(b"old")
    paths = plot_compare({"bf16": [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}], "mxfp4": [{"step": 1}]}, tmp_path)
    assert [p.name for p in paths] == ["loss_curves.png"] and not (tmp_path / "loss_diff.png").exists()
    assert plot_compare({"bf16": [], "mxfp4": [{"step": 1, "val_loss": None}]}, tmp_path) == []
    assert not (tmp_path / "loss_curves.png").exists()


def test_compare_table_fields():
    summaries = {
        "bf16": dict(final_val_loss=4.0, final_val_bpb=1.5, tok_per_s=1000.0, peak_memory_bytes=2**30,
                     saved_bytes=2**20, saved_bytes_bf16=2**20, bytes_per_param=16.0),
        "adahop-lv2": dict(final_val_loss=4.02, final_val_bpb=1.51, tok_per_s=900.0, peak_memory_bytes=2**29,
                           saved_bytes=2**18, saved_bytes_bf16=2**20),
        "broken": {"error": "exit code 1"},
        "halo-2": dict(final_val_loss=4.1, unquantizable_layers=2),
        "nvfp4": dict(final_val_loss=4.05, bf16_layers={"a": "shape 100->64", "b": "in a BF16 block of the recipe",
                                                        "c": "in a BF16 block of the recipe"}),
        "adahop-lv1": dict(final_val_loss=4.0, plan_frozen=False),
        "mxfp4": dict(final_val_loss=4.03, recompute=True, unquantizable_layers=1),
    }
    rows = format_table(summaries)
    assert len(COLUMNS) == 8 and all(len(r) == 8 for r in rows)
    assert rows[0][7] == "16.00" and rows[1][7] == "-"
    assert rows[0][:5] == ["bf16", "4.0000", "+0.00", "1.5000", "1,000"]
    assert rows[1][2] == "+0.50" and rows[1][6] == "0.25 (1.00)"
    assert rows[3][0] == "halo-2 (2 layers BF16: shape)" and rows[3][2] == "+2.50"
    assert rows[2][1] == "failed: exit code 1" and set(rows[2][2:]) == {"-"}  # the reason in no other column
    assert rows[4][0] == "nvfp4 (1 layers BF16: shape; 2 layers BF16: the recipe's BF16 blocks)"
    assert rows[5][0] == "adahop-lv1 (plan never froze: all BF16)" and rows[5][2] == "+0.00"
    assert rows[6][0] == "mxfp4 (1 layers BF16: shape; selective recompute)"  # adahop compare --recompute says so
    # a long, multi-line reason with a '|': one line cut at 160 characters with a pointer, and one Markdown row
    long = format_table({"x": {"error": "a|b\n" + "y" * 300}})[0][1]
    assert long.startswith("failed: a|b " + "y" * 148) and long.endswith("(whole: compare.json, or the run's error.txt)")
    md = _markdown([["x", long]], header=("recipe", "final val loss")).splitlines()
    assert len(md) == 3 and md[2].count(" | ") == 1 and "a\\|b" in md[2]


def test_compiled_run_reports_no_graph_break_after_the_plan_freeze(data_dir, tmp_path, single_thread, monkeypatch):
    """`--compile` with AdaHOP-Lv2: calibration runs eagerly, uncompiled; at the freeze the model
    compiles whole, once, in the final mode (made CUDA graphs'
    ``reduce-overhead`` here, as on one GPU; issue 18). summary.json counts the graph breaks and the
    frames recompiled after the first step of the final graphs (0 and 0; the counter sees a real
    break), and every step's loss is eager mode's, bit for bit. (Dynamo only, for speed: the layers
    go through AOTAutograd in tests/test_compile.py, through Inductor in tests/test_kernels.py.)"""
    import adahop.train.loop as loop
    from adahop.compile_modes import frozen_mode

    assert (frozen_mode("cuda"), frozen_mode("cpu"), frozen_mode("cuda", "ddp")) == ("reduce-overhead", "default", "default")
    real, modes = torch.compile, []

    def recording(m, **kw):  # dynamo only: fast, no toolchain
        modes.append(kw.get("mode"))
        return real(m, backend="eager")

    monkeypatch.setattr(torch, "compile", recording)
    monkeypatch.setattr(loop, "frozen_mode", lambda device_type, parallel="none": "reduce-overhead")
    kw = dict(steps=4, calib_steps=2, eval_every=0, ckpt_every=0)
    s = train(_cfg(data_dir, tmp_path / "c", compile=True, **kw))
    assert s["graph_breaks_steady_state"] == 0 and s["recompiles_steady_state"] == 0 and s["steps"] == 4
    assert modes == ["reduce-overhead"] and s["compile_mode"] == "reduce-overhead" and s["plan_frozen"]
    e = train(_cfg(data_dir, tmp_path / "e", **kw))
    assert e["graph_breaks_steady_state"] is None and e["recompiles_steady_state"] is None and e["compile_mode"] is None
    losses = [[r["loss"] for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
              for d in ("c", "e")]
    assert len(losses[0]) == 4 and losses[0] == losses[1]


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
    from safetensors.torch import load_file, save_file

    good, sd = newest.read_bytes(), load_file(newest)  # NaN in a checkpoint read as a divergence: "lower --lr"
    sd[next(iter(sorted(sd)))].view(-1)[0] = float("nan")
    save_file(sd, newest, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"step_0000004 holds NaN or inf in .*damaged after it was written.*resume from step_0000002"):
        train(dataclasses.replace(cfg, resume=True, steps=6))
    newest.write_bytes(good[:100])
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

    def nested(cfg, rank, world, live):  # while the run holds its folder, start another into it
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


# ---- issue 24: fail before training, interrupts, disk faults, schedules, start-up ----------------

TINY_ARGS = ["--model", "llama-tiny", "--seq-len", "32", "--batch-size", "4", "--device", "cpu", "--recipe", "bf16",
             "--eval-every", "0", "--log-every", "1"]


def test_data_too_small_for_the_run_is_refused_before_training(data_dir, tmp_path):
    """A validation split short of --eval-batches batches surfaced at the first evaluation (step 50
    by default, before any checkpoint) or silently evaluated fewer batches; a training split under
    one batch trained on repeated windows."""
    with pytest.raises(ValueError, match=r"--eval-batches 1000: the validation split holds \d+ windows of --seq-len \+ 1 "
                                         r"= 33 tokens .*; pass --eval-batches \d+ or fewer"):
        train(_cfg(data_dir, tmp_path / "a", eval_batches=1000))
    with pytest.raises(ValueError, match=r"--eval-batches 2: .* 0 batch\(es\) of --batch-size 512; lower --batch-size "
                                         r"or --seq-len, prepare the data with a larger --val-fraction"):
        train(_cfg(data_dir, tmp_path / "b", batch_size=512))
    with pytest.raises(ValueError, match=r"--data: the training split holds \d+ windows .* fewer than one batch of "
                                         r"--batch-size 4096"):
        train(_cfg(data_dir, tmp_path / "c", batch_size=4096, eval_every=0))
    assert not any((tmp_path / d / "metrics.jsonl").exists() for d in "abc")  # refused before the first step


@pytest.mark.parametrize("flag,value", [("grad_clip", float("nan")), ("weight_decay", float("nan")), ("lr", float("inf"))])
def test_non_finite_hyper_parameters_are_refused(data_dir, tmp_path, flag, value):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')}: must be a finite number, got {value}"):
        _cfg(data_dir, tmp_path, **{flag: value})


def test_a_gradient_of_exactly_zero_is_a_divergence_and_lr_times_decay_above_one_is_refused(
        data_dir, tmp_path, single_thread, monkeypatch, capsys):
    """--lr 1000 (weight decay 0.1) flipped the weights' sign each step until every prediction was flat: loss ln V,
    gradient norm exactly 0, under the loss ceiling; the run stopped late and called a dead checkpoint the last
    good one (helper 38). lr x decay >= 1 is refused now, and a zero gradient norm stops the run."""
    from adahop.cli import main

    monkeypatch.setenv("TQDM_DISABLE", "1")
    with pytest.raises(ValueError, match=r"--weight-decay: --lr 1000 x --weight-decay 0.1 = 100 >= 1"):
        _cfg(data_dir, tmp_path / "x", lr=1000.0, weight_decay=0.1)
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def dies_at_step_5(params, max_norm, *a, **k):  # what the dead model gave: a norm of exactly 0 from step 5 on
        norm = real(params, max_norm, *a, **k)
        calls.append(1)
        return norm * 0 if len(calls) >= 5 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", dies_at_step_5)
    out = tmp_path / "r"
    assert main(["train", *TINY_ARGS, "--data", str(data_dir), "--out", str(out), "--steps", "8", "--ckpt-every", "2",
                 "--keep-ckpts", "3", "--log-every", "8"]) == 1
    err = capsys.readouterr().err
    assert "the gradient norm was exactly 0 at or before step 6" in err, err  # found at the next checkpoint
    # step 5's gradient judged the weights of step 4's checkpoint: set aside; step 2's is the last good one
    assert [p.name for p in sorted((out / "checkpoints").glob("step_*"))] == ["step_0000002"]
    assert [p.name for p in (out / "checkpoints").glob("diverged_step_*")] == ["diverged_step_0000004"]
    assert "The last good checkpoint (step 2) is kept" in err, err


def test_a_loss_far_above_its_start_is_a_divergence(data_dir, tmp_path, single_thread, monkeypatch, capsys):
    """--lr 10 used to finish with exit 0 at loss 645 and export the model."""
    from adahop.cli import main
    from adahop.train.setup import loss_ceiling

    assert loss_ceiling(8192, 9.2) == pytest.approx(18.4) and loss_ceiling(512, 6.0) == pytest.approx(2 * 6.2383, abs=1e-3)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    out = tmp_path / "r"
    assert main(["train", *TINY_ARGS, "--data", str(data_dir), "--out", str(out), "--steps", "8", "--lr", "10", "--weight-decay", "0",
                 "--warmup-steps", "4", "--ckpt-every", "1", "--keep-ckpts", "1"]) == 1
    err = capsys.readouterr().err
    assert "the training loss rose to" in err and "above 12.5 (2 x the larger of ln(vocab 512) = 6.24" in err, err
    assert (out / "error.txt").read_text().startswith("adahop train: the training loss rose to")
    assert not (out / "model.safetensors").exists()  # no export of a diverged model
    # the one checkpoint (step 1) holds the weights whose next loss passed the ceiling; it is set aside (kept as
    # diverged_step_*), and the message says that no checkpoint could have been good: the bad loss is step 2's
    assert not sorted((out / "checkpoints").glob("step_*")) and "No good checkpoint can exist" in err
    m = re.search(r"the first bad loss was step (\d+)'s, so only the initial weights are good", err)
    assert m and int(m[1]) == 2 and int(m[1]) > max(r["step"] for r in read_metrics(out / "metrics.jsonl"))
    aside = sorted((out / "checkpoints").glob("diverged_step_*"))
    assert len(aside) == 1 and (aside[0] / "model.safetensors").exists()
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    n = int(aside[0].name.rsplit("_", 1)[1])
    assert losses[0] < 7 and all(v < 12.5 for v in losses[:n])
    assert f"at or before step {n + 1}," in err  # the next step's loss, from its weights, passed the ceiling


def test_a_divergence_at_step_2_advises_a_lower_lr_not_checkpoints(tmp_path):
    """Step 2's loss comes from step 1's weights: no checkpoint can be good, so the advice is the learning
    rate (it said "set --ckpt-every below 2" to a run that checkpointed every step)."""
    from adahop.train.loop import _kept

    (tmp_path / "checkpoints" / "step_0000001").mkdir(parents=True)
    msg = _kept(tmp_path, 1, torch.tensor(2), True, 0)
    assert (tmp_path / "checkpoints" / "diverged_step_0000001").is_dir()
    assert "only the initial weights are good" in msg and "lower --lr" in msg and "--ckpt-every below" not in msg
    # later, with --keep-ckpts 1: the advice follows from the first bad step (it once said "--ckpt-every below the
    # step it diverged at" to a run that already checkpointed below it)
    (tmp_path / "checkpoints" / "step_0000005").mkdir()
    msg = _kept(tmp_path, 5, torch.tensor(6), True, 0)
    assert "No good checkpoint is kept: the first bad loss was step 6's, so only a checkpoint of step 4 or earlier" in msg
    assert "set --ckpt-every below 5 and --keep-ckpts 2 or more" in msg


def test_second_ctrl_c_aborts_at_once_and_keeps_the_last_complete_checkpoint(data_dir, tmp_path, single_thread,
                                                                              monkeypatch):
    """The first Ctrl-C (in step 3) asks for a checkpoint at the end of the step; a second one while it
    is written aborts at once: the partial folder goes, step 2's checkpoint stays and resumes."""
    import os
    import signal

    import adahop.train.checkpoint as ck
    import adahop.train.loop as loop

    real_ce, real_save, calls = loop.F.cross_entropy, ck.save_file, {"ce": 0, "save": 0}

    def ctrl_c_in_step_3(*a, **k):
        calls["ce"] += 1
        if calls["ce"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_ce(*a, **k)

    def ctrl_c_while_writing(tensors, path, *a, **k):  # files 1-2: step 2's checkpoint; 3-4: step 3's
        calls["save"] += 1
        if calls["save"] == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return real_save(tensors, path, *a, **k)

    monkeypatch.setattr(loop.F, "cross_entropy", ctrl_c_in_step_3)
    monkeypatch.setattr(ck, "save_file", ctrl_c_while_writing)
    cfg = _cfg(data_dir, tmp_path / "r", recipe="bf16", steps=6, ckpt_every=2, eval_every=0)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    assert signal.getsignal(signal.SIGINT) is before  # the run's handler is gone with it
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step_0000002"]
    monkeypatch.undo()
    assert train(dataclasses.replace(cfg, resume=True, steps=3))["steps"] == 3


def test_ctrl_c_reaches_a_compare_child_once_per_press(tmp_path):
    """compare runs each recipe in its own process group and passes each Ctrl-C on: the child sees
    two presses as two (not four, as when the terminal's signal reached both), and its exit code comes back."""
    import os
    import signal
    import sys
    import threading
    import time

    from adahop.train.compare import _run_child

    ready, seen = tmp_path / "ready", tmp_path / "seen"
    child = (f"import signal, time, pathlib\nn = []\n"
             f"signal.signal(signal.SIGINT, lambda *_: n.append(1))\npathlib.Path({str(ready)!r}).touch()\n"
             f"t = time.time()\nwhile len(n) < 2 and time.time() - t < 60: time.sleep(0.05)\n"
             f"time.sleep(0.5)\npathlib.Path({str(seen)!r}).write_text(str(len(n)))\nraise SystemExit(130)\n")

    def press_twice():
        while not ready.exists():
            time.sleep(0.05)
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)  # what the terminal sends to compare's process group
            time.sleep(0.3)

    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job
    threading.Thread(target=press_twice, daemon=True).start()
    assert _run_child([sys.executable, "-c", child]) == (130, 2)
    assert seen.read_text() == "2"
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_in_compare_checkpoints_the_running_recipe_and_says_how_to_resume(data_dir, tmp_path):
    """It used to exit 130 at once: the running recipe was killed before it could write a checkpoint."""
    import os
    import signal
    import threading
    import time

    from adahop.train.compare import Interrupted, compare

    out = tmp_path / "cmp"
    cfg = _cfg(data_dir, out, recipe="bf16", steps=400, ckpt_every=0, eval_every=0)
    metrics = out / "bf16" / "metrics.jsonl"

    def press_ctrl_c():  # once the first recipe trains
        t = time.time()
        while time.time() - t < 300 and not (metrics.exists() and '"loss"' in metrics.read_text()):
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    try:
        compare(["bf16", "mxfp4"], cfg, out)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended compare with KeyboardInterrupt: the running recipe was killed without a checkpoint")
    except Interrupted as e:
        msg = str(e)
    else:
        pytest.fail("compare was not interrupted")
    kept = [p.name for p in (out / "bf16" / "checkpoints").iterdir()]
    assert len(kept) == 1 and 0 < int(kept[0][5:]) < 400, kept
    assert msg == (f"interrupted during bf16: its checkpoint {out / 'bf16' / 'checkpoints' / kept[0]} is kept. Run the "
                   f"same `adahop compare` command again (same --out and settings) to resume bf16 and train mxfp4; the "
                   f"table is written when every recipe is done")
    assert not (out / "mxfp4").exists() and not (out / "compare.md").exists()


_DISK_ARGS = ["--steps", "4", "--ckpt-every", "2"]


def test_disk_full_during_a_checkpoint_keeps_the_last_complete_one(data_dir, tmp_path, single_thread, monkeypatch, capsys):
    """An injected ENOSPC while the second checkpoint is written: a raw traceback and a leftover
    temporary folder before; now one line naming the kept checkpoint, error.txt, and a clean resume."""
    import errno
    import os

    import adahop.train.checkpoint as ck
    from adahop.cli import main

    real, calls = ck.save_file, {"n": 0}

    def full_disk(tensors, path, *a, **k):  # files 1-2: step 2's checkpoint; 4: step 4's optimizer state
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(ck, "save_file", full_disk)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    out = tmp_path / "r"
    args = ["train", *TINY_ARGS, "--data", str(data_dir), "--out", str(out), *_DISK_ARGS]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = (f"adahop train: error: the checkpoint of step 4 could not be written to {out / 'checkpoints'} (No space left on "
            f"device); its partial folder was removed and the last complete checkpoint, {out / 'checkpoints' / 'step_0000002'}, "
            f"is kept. Free space (or fix the disk), then continue with --resume")
    assert err == [line]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_0000002"]
    assert (out / "error.txt").read_text() == line + "\n" and not (out / "model.safetensors").exists()
    monkeypatch.setattr(ck, "save_file", real)
    assert main([*args, "--resume"]) == 0
    assert not (out / "error.txt").exists() and (out / "model.safetensors").exists()


def test_disk_full_on_a_real_small_filesystem(data_dir, tmp_path):
    """The same on a real 9 MiB tmpfs, mounted in a user + mount namespace (``unshare -rm``) where the
    machine allows one: one checkpoint of llama-tiny (6.3 MB: FP32 weights and two AdamW moments)
    fits, the second does not (safetensors' own I/O error, not an OSError)."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"], capture_output=True).returncode:
        pytest.skip("no tmpfs mount in a user namespace on this machine (unshare -rm)")
    fs, run = tmp_path / "fs", tmp_path / "fs" / "run"
    fs.mkdir()
    train_cmd = " ".join([sys.executable, "-m", "adahop", "train", *TINY_ARGS, "--data", str(data_dir), "--out", str(run),
                          *_DISK_ARGS])
    script = (f"mount -t tmpfs -o size=9m tmpfs {fs} || exit 99; {train_cmd}; echo rc=$?; ls -a {run / 'checkpoints'}; "
              f"cat {run / 'error.txt'}")  # the tmpfs goes with the namespace: look inside it here
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TQDM_DISABLE": "1"})
    assert "rc=2" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
    listing = r.stdout.split("rc=2", 1)[1].split()
    assert [n for n in listing if n.startswith(("step_", ".tmp"))] == ["step_0000002"]
    expect = (f"adahop train: error: the checkpoint of step 4 could not be written to {run / 'checkpoints'} (No space left "
              f"on device); its partial folder was removed and the last complete checkpoint")
    assert expect in r.stdout and r.stderr.strip().splitlines()[-1].startswith(expect) and "Traceback" not in r.stderr


def test_resume_with_more_steps_keeps_the_lr_schedule_unless_rescheduled(data_dir, tmp_path, single_thread, capsys):
    """Growing --steps on resume re-stretched the cosine (the lr jumped from 0.00037 to 0.00086)."""
    from adahop.train.setup import lr_at

    run = tmp_path / "r"
    cfg = _cfg(data_dir, run, recipe="bf16", steps=6, ckpt_every=2, eval_every=0)  # lr 3e-3, warm-up 2, final 3e-4
    train(cfg)
    assert "estimate: " in capsys.readouterr().out  # once 3 steps are timed
    s = train(dataclasses.replace(cfg, resume=True, steps=8))
    out = capsys.readouterr().out
    assert ("--resume: keeping the run's lr schedule (cosine decay ending at step 6; steps 7..8 run at its final lr "
            "0.0003); pass --reschedule to fit the decay to --steps 8") in out
    lrs = {r["step"]: r["lr"] for r in read_metrics(run / "metrics.jsonl") if "lr" in r}
    assert lrs[7] == lrs[8] == pytest.approx(3e-4) and s["lr_schedule_steps"] == 6
    # the start-up line gives the lr of the step that ends this run (step 8: the final 3e-4), not of step 6's
    assert "cosine decay toward 0.1 x --lr 0.003 over 6 steps (its last step runs at lr 0.0003)" in out
    s = train(dataclasses.replace(cfg, resume=True, steps=10, reschedule=True))
    assert "--reschedule: the cosine decay now ends at step 10 instead of 6" in capsys.readouterr().out
    lrs = {r["step"]: r["lr"] for r in read_metrics(run / "metrics.jsonl") if "lr" in r}
    assert lrs[9] == pytest.approx(lr_at(cfg, 8, 10)) and lrs[9] > 1.5 * 3e-4 and s["lr_schedule_steps"] == 10


def _llama_json(path: Path, hidden: int, inter: int) -> str:
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
                                "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                                "vocab_size": 512, "max_position_embeddings": 64}))
    return str(path)


def test_a_recipe_that_converts_no_layer_is_refused_and_a_partial_one_lists_the_rest(data_dir, tmp_path, single_thread,
                                                                                      capsys):
    """A Llama whose dims fit no MXFP4 block trained all in BF16 with only a warning (GPT-2 was refused)."""
    odd = _llama_json(tmp_path / "odd.json", 48, 80)  # no dim a multiple of 32
    with pytest.warns(UserWarning, match="cannot quantize"), \
            pytest.raises(ValueError, match=r"recipe mxfp4: none of the model's 14 linear layers can run it "
                                            r"\(model.layers.0.self_attn.q_proj: shape 48->48;"):
        train(_cfg(data_dir, tmp_path / "a", recipe="mxfp4", model_config=odd, steps=1, eval_every=0))
    part = _llama_json(tmp_path / "part.json", 64, 80)  # attention (64 wide) quantizes, the MLP (80) cannot
    with pytest.warns(UserWarning, match="cannot quantize"):
        s = train(_cfg(data_dir, tmp_path / "b", recipe="mxfp4", model_config=part, steps=1, eval_every=0, ckpt_every=0))
    mlp = {f"model.layers.{i}.mlp.{p}_proj": f"shape {io}" for i in range(2)
           for p, io in (("gate", "64->80"), ("up", "64->80"), ("down", "80->64"))}
    assert s["bf16_layers"] == mlp and s["unquantizable_layers"] == 6
    assert "6 converted layers run BF16 GEMMs: model.layers.0.mlp.gate_proj (shape 64->80), " in capsys.readouterr().out


def test_start_up_summary_says_what_the_run_does_and_warns_above_one_epoch(data_dir, tmp_path, single_thread, capsys,
                                                                           monkeypatch):
    import adahop.train.loop as loop
    from adahop.data import Manifest, TokenStream
    from adahop.recipes.table import gemm_table
    from adahop.train.setup import resolve_recipe

    def stop(*a, **k):  # right after the summary: the steps themselves are not what this checks
        raise RuntimeError("stop here")

    monkeypatch.setattr(loop, "write_config", stop)
    cfg = _cfg(data_dir, tmp_path / "r", batch_size=64, steps=40, eval_every=0)
    with pytest.raises(RuntimeError, match="stop here"):
        train(cfg)
    cap = capsys.readouterr()
    windows = TokenStream(data_dir, "train", 32, 64).n_windows
    epochs = 40 * 64 / windows
    assert epochs > 1
    block = 128 * 128 * 2 + 128 * 64 * 2 + 128 * 384 * 3  # llama-tiny: q, o; k, v (2 KV heads of 32); gate, up, down
    total = 2 * block + 2 * 512 * 128 + 5 * 128  # + embeddings, LM head, 5 RMSNorm gains
    m = Manifest.load(data_dir)
    for text in (f"{total:,} total; {2 * block:,} ({100 * 2 * block / total:.1f}%) in the 14 linear layers that run "
                 f"adahop-lv2's GEMMs", f"{m.train.tokens:,} training tokens, {m.val.tokens:,} validation tokens",
                 f"tokens per step 2,048 (--batch-size 64 x --seq-len 32); 81,920 tokens in all = {epochs:.2f} epochs",
                 *("    " + ln for ln in gemm_table(resolve_recipe(cfg)[0]).splitlines())):  # --calib-steps 3
        assert text in cap.out, text
    assert f"makes {epochs:.2f} passes over the training split ({windows:,} windows of --seq-len 32)" in cap.err


def test_resume_compares_the_data_order_a_data_seed_gives_not_its_spelling(tmp_path):
    """`--data-seed 0` on a run of `--seed 0` (no --data-seed) is the same data order: it was refused
    ('--data-seed None → 0'); a different order is still refused."""
    from adahop.train.setup import RESUME_KEYS, settings_diff

    def saved(**kw):
        run = tmp_path / "_".join(f"{k}{v}" for k, v in kw.items())
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"adahop": {"config": TrainConfig(**kw).to_dict()}}))
        return run

    run = saved(seed=0)
    assert settings_diff(TrainConfig(seed=0, data_seed=0), run, RESUME_KEYS) == []
    assert settings_diff(TrainConfig(seed=0, data_seed=2), run, RESUME_KEYS) == ["--data-seed None → 2"]
    run = saved(seed=1, data_seed=1)
    assert settings_diff(TrainConfig(seed=1), run, RESUME_KEYS) == []
    assert settings_diff(TrainConfig(seed=0, data_seed=1), run, RESUME_KEYS) == ["--seed 1 → 0"]
    assert settings_diff(TrainConfig(seed=1, data_seed=0), run, RESUME_KEYS) == ["--data-seed 1 → 0"]


def test_startup_summary_warns_when_the_warmup_outlasts_the_run():
    """`--steps 4` with the default 30 warm-up steps: the lr never reaches --lr, and nothing said so (fresh-user pass)."""
    from adahop.train.config import TrainConfig
    from adahop.train.setup import _short_run_note

    note = _short_run_note(TrainConfig(steps=4, warmup_steps=30, lr=3e-3), 4)
    assert "--warmup-steps 30 >= the schedule's 4 steps: the lr peaks at 0.0004, never --lr 0.003" in note
    assert _short_run_note(TrainConfig(steps=100, warmup_steps=30), 100) == ""
    # warm-up as long as the run: --lr is reached at the last step ("never --lr 0.003" was said while it was)
    assert "the lr reaches --lr 0.003 only at the last step and never decays" in \
        _short_run_note(TrainConfig(steps=30, warmup_steps=30, lr=3e-3), 30)


def test_startup_notes_name_a_given_plan_and_packed_masters_under_round_to_nearest():
    """Fresh-user pass: with --plan the GEMM table still printed "calibration: 30 BF16 steps", and FP4
    masters trained under the default rounding (nearest) with no word, though they stall."""
    from adahop.train.config import TrainConfig
    from adahop.train.setup import _gemm_lines, _run_notes

    assert _run_notes(TrainConfig()) == []
    (plan,) = _run_notes(TrainConfig(plan="runs/a/plan.json"))
    assert "frozen from runs/a/plan.json: no calibration runs" in plan
    lv2 = get_recipe("adahop-lv2")  # helper 60: the table still said "calibration: 30 BF16 steps" above that note
    assert any(line.startswith("calibration: 30 BF16 steps") for line in _gemm_lines(TrainConfig(), lv2))
    given = _gemm_lines(TrainConfig(plan="runs/a/plan.json"), lv2)
    assert not any("calibration:" in line for line in given) and any("calibrated" in line for line in given)
    for master, rounding in (("fp4", "auto"), ("fp8", "nearest"), ("nvfp4", "auto")):
        (warn,) = _run_notes(TrainConfig(master_weights=master, master_rounding=rounding))
        assert f"--master-weights {master} with round to nearest" in warn and "--master-rounding stochastic" in warn
    assert _run_notes(TrainConfig(master_weights="fp4", master_rounding="stochastic")) == []
    assert _run_notes(TrainConfig(optimizer="sr-adamw", master_weights="fp8")) == []  # auto is stochastic there
    assert _run_notes(TrainConfig(master_weights="bf16")) == []


def test_calib_steps_with_a_recipe_without_calibration_warns_at_start_up():
    """Fresh-user pass: `--recipe bf16 --calib-steps 10` was taken without a word, though no step calibrates."""
    from adahop.recipes import get_recipe
    from adahop.train.config import TrainConfig
    from adahop.train.setup import _run_notes

    (warn,) = _run_notes(TrainConfig(recipe="bf16", calib_steps=10), get_recipe("bf16"))
    assert warn.split() == ["warning", "--calib-steps", "10", "does", "nothing:", "recipe", "bf16", "has", "no", "AdaHOP",
                            "calibration", "(its", "GEMM", "strategies", "are", "fixed);", "drop", "--calib-steps,", "or",
                            "use", "a", "calibrating", "recipe", "such", "as", "adahop-lv2"]
    assert _run_notes(TrainConfig(recipe="mxfp4"), get_recipe("mxfp4")) == []  # not given: nothing to say
    assert _run_notes(TrainConfig(calib_steps=10), get_recipe("adahop-lv2")) == []


def test_a_plan_folder_is_refused_with_the_file_to_pass(tmp_path):
    from adahop.train.config import TrainConfig
    from adahop.train.setup import resolve_recipe

    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(ValueError, match=f"--plan {tmp_path} is a folder; pass the plan file itself \\(--plan {tmp_path}/plan.json\\)"):
        resolve_recipe(TrainConfig(recipe="adahop-lv2", plan=str(tmp_path)))


def test_a_device_that_names_nothing_is_a_clear_error():
    # `adahop ptq/eval/train --device tpu` ended in torch's RuntimeError traceback (found by a new-user probe)
    from adahop.train.setup import resolve_device

    with pytest.raises(ValueError, match="--device 'tpu' is not a device; use auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_checkpoint_whose_weights_diverged_at_the_next_step_is_set_aside(data_dir, tmp_path, single_thread, monkeypatch):
    """The loss of step N comes from the weights after step N-1: when N-1 was just checkpointed, that checkpoint
    holds the diverged weights. It was kept as "the last good one", and --resume from it diverged at once
    (new-user probe). It is moved aside, not deleted, and the one before it is named."""
    import adahop.train.loop as loop

    real = loop.F.cross_entropy
    calls = {"n": 0}

    def poisoned(*a, **k):  # the loss of training step 5 (from step 4's weights) is NaN
        calls["n"] += 1
        out = real(*a, **k)
        return out * float("nan") if calls["n"] == 5 else out

    monkeypatch.setattr(loop.F, "cross_entropy", poisoned)
    with pytest.raises(Diverged, match=r"checkpoint of step 4 holds the weights whose next loss diverged.*last good checkpoint \(step 3\)"):
        train(_cfg(data_dir, tmp_path / "r", steps=8, recipe="bf16", calib_steps=None, eval_every=0, ckpt_every=1, keep_ckpts=3))
    ck = tmp_path / "r" / "checkpoints"
    assert [p.name for p in sorted(ck.glob("step_*"))] == ["step_0000002", "step_0000003"]
    assert (ck / "diverged_step_0000004" / "model.safetensors").exists()  # set aside, nothing deleted
    from adahop.train.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path / "r").name == "step_0000003"  # what --resume starts from


def test_perplexity_of_a_diverged_model_is_inf_not_an_overflow(data_dir, monkeypatch):
    """`adahop eval` of a model with a val loss past ~709.8 nats died in math.exp with an OverflowError."""
    import adahop.eval.perplexity as pp
    import adahop.train.loop as loop

    monkeypatch.setattr(loop, "evaluate", lambda *a, **k: (800.0, 1154.2))
    res = pp.perplexity(torch.nn.Linear(2, 2), data_dir, split="val", seq_len=32, batch_size=2, max_batches=1,
                        device=torch.device("cpu"), bf16=False)
    assert res["loss"] == 800.0 and res["perplexity"] == float("inf")


def test_validation_under_grad_accum_runs_micro_batches_with_the_same_loss(data_dir, tmp_path, monkeypatch):
    """With --grad-accum the validation ran the whole --batch-size in one forward: its activations set the run's
    peak memory (1112 vs 652 MiB at 64 / 16, helper 30) and could run out of memory where training fits. It now
    runs the micro-batches, and their mean loss is the batch's."""
    import adahop.train.loop as loop
    from adahop.data import Manifest, TokenStream
    from adahop.models import build_model

    seen = []
    orig = loop.evaluate

    def spy(model, *a, **kw):
        h = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                            with_kwargs=True)
        try:
            return orig(model, *a, **kw)
        finally:
            h.remove()

    monkeypatch.setattr(loop, "evaluate", spy)
    train(_cfg(data_dir, tmp_path / "acc", recipe="bf16", calib_steps=None, batch_size=4, grad_accum=2, steps=2,
               eval_every=2, eval_batches=2, ckpt_every=0))
    assert seen and set(seen) == {2}  # 2 windows per forward, not 4

    model = build_model("llama-tiny", vocab_size=Manifest.load(data_dir).tokenizer.vocab_size, max_seq_len=32).eval()
    val = TokenStream(data_dir, "val", 32, 4, seed=0)
    whole = orig(model, val, torch.device("cpu"), contextlib.nullcontext(), 2)
    halves = orig(model, val, torch.device("cpu"), contextlib.nullcontext(), 2, 2)
    assert halves[0] == pytest.approx(whole[0], rel=1e-6) and halves[1] == pytest.approx(whole[1], rel=1e-6)


def test_cpu_peak_memory_starts_at_the_reset_not_at_the_process_start():
    """On the CPU the peak was the process's lifetime maximum RSS, so a run that trained its tokenizer first
    reported 594 MiB where the same run from the cache reported 520 (helper 30); the reset now restarts it
    (Linux: /proc/self/clear_refs)."""
    import os

    from adahop.train.metrics import peak_memory, reset_peak_memory

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("no /proc/self/clear_refs to reset the peak RSS with (not Linux)")
    cpu = torch.device("cpu")
    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    before = peak_memory(cpu)
    del big
    reset_peak_memory(cpu)
    after = peak_memory(cpu)
    assert before - after > 200 * 2**20, (before, after)


def test_a_curve_of_one_logged_point_is_drawn(tmp_path, monkeypatch):
    """A 10-step compare logs one training-loss point per recipe (--log-every 10): the curves, lines without
    markers, left loss_curves.png and loss_diff.png with a legend over empty axes (probe rivals)."""
    import adahop.plots as plots

    figs = []
    monkeypatch.setattr(plots.plt, "close", lambda fig: figs.append(fig))
    plots._line_plot({"bf16": ([10], [7.47]), "mxfp4": (list(range(100)), [7.0] * 100)}, tmp_path / "c.png",
                     ylabel="loss", title="t")
    one, many = figs[0].axes[0].get_lines()
    assert one.get_marker() == "o" and many.get_marker() in ("None", None, "")


def test_eager_gpu_note_goes_to_low_precision_runs_on_a_gpu_without_compile():
    """The start-up note that points GPU users at --compile: only a converted recipe, on CUDA, eager."""
    from adahop.train import TrainConfig
    from adahop.train.loop import EAGER_GPU_NOTE, _eager_gpu

    lv2, bf16 = get_recipe("adahop-lv2"), get_recipe("bf16")
    assert _eager_gpu("cuda", TrainConfig(), lv2)
    assert not _eager_gpu("cuda", TrainConfig(compile=True), lv2)
    assert not _eager_gpu("cpu", TrainConfig(), lv2)  # the CPU has no launch overhead to hide
    assert not _eager_gpu("cuda", TrainConfig(), bf16)
    assert "--compile" in EAGER_GPU_NOTE and "docs/benchmarks.md" in EAGER_GPU_NOTE


def test_out_of_gpu_memory_says_the_phase_what_fits_and_the_checkpoint_kept(data_dir, tmp_path, single_thread,
                                                                            monkeypatch, capsys):
    """Round 34: plain Lv2 at Llama-3.2-1B 4096 x 8 ran out of memory on an H100 in its eager BF16 calibration, where
    its compiled steps would have fit. torch's OutOfMemoryError is raised on the CPU here, in the gradient clip of a
    chosen step: train says whether the plan was calibrating, what takes less memory, and which checkpoint is kept."""
    from adahop.cli import main
    from adahop.train.loop import OutOfGPUMemory

    real, calls = torch.nn.utils.clip_grad_norm_, {"n": 0}

    def oom_at(step):
        def clip(*a, **k):
            calls["n"] += 1
            if calls["n"] == step:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB (fake)")
            return real(*a, **k)
        calls["n"] = 0
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)

    oom_at(2)  # step 2 of 3 calibration steps, after step 1's checkpoint
    with pytest.raises(OutOfGPUMemory) as e:
        train(_cfg(data_dir, tmp_path / "a", ckpt_every=1, eval_every=0))
    msg = str(e.value)
    assert msg.startswith("out of GPU memory during adahop-lv2's calibration (CUDA out of memory. Tried to allocate 4.00")
    assert "run eagerly in BF16, also under --compile, and need more memory than the compiled steps" in msg
    assert "--recompute (selective" in msg
    assert "--grad-accum 2 (micro-batches of 2 sequences a rank, the same 4 a step" in msg
    assert "--compile (" not in msg  # calibration runs eagerly under --compile too
    assert f"The checkpoint of step 1 is kept: `adahop train --out {tmp_path / 'a'} --resume` goes on from it (and may " \
           f"add --recompute and --compile)." in msg
    assert isinstance(e.value, torch.OutOfMemoryError) and isinstance(e.value.__cause__, torch.OutOfMemoryError)
    oom_at(6)  # after the freeze (step 3), no checkpoint written, under recompute: neither is offered again
    with pytest.raises(OutOfGPUMemory) as e:
        train(_cfg(data_dir, tmp_path / "b", ckpt_every=0, eval_every=0, recompute=True, grad_accum=4))
    msg = str(e.value)
    assert msg.startswith("out of GPU memory (CUDA out of memory") and "calibration" not in msg
    assert "--recompute" not in msg and "a shorter --seq-len" in msg and "--compile (" in msg
    assert "No checkpoint had been written yet." in msg
    oom_at(2)  # --batch-size 6 --grad-accum 2: the next --grad-accum that divides it is 3; an OOM a compiler wrapped
    real_clip = torch.nn.utils.clip_grad_norm_

    def wrapped(*a, **k):
        try:
            return real_clip(*a, **k)
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("backend='inductor' raised:") from oom
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", wrapped)
    with pytest.raises(OutOfGPUMemory, match=r"^out of GPU memory \(CUDA out of memory.*--grad-accum 3 \(micro-batches of 2"):
        train(_cfg(data_dir, tmp_path / "d", batch_size=6, grad_accum=2, recipe="bf16", calib_steps=None,
                   ckpt_every=0, eval_every=0))
    from adahop.train.loop import _oom_message
    from adahop.recipes import get_recipe as recipe_of
    two_ranks = _oom_message(_cfg(data_dir, tmp_path / "d", recipe="bf16", batch_size=4, grad_accum=2, compile=True),
                             recipe_of("bf16"), tmp_path / "d", 2, torch.OutOfMemoryError("x"))
    assert "a shorter --seq-len" in two_ranks and "--grad-accum" not in two_ranks  # 4 = 2 ranks x 2: no room left
    assert "--compile (" not in two_ranks
    # on a GPU the calibration steps already run under selective recompute: --recompute would not help there
    gpu = _oom_message(_cfg(data_dir, tmp_path / "a"), recipe_of("adahop-lv2"), tmp_path / "a", 1,
                       torch.OutOfMemoryError("x"), calib_recompute=True)
    assert gpu.startswith("out of GPU memory during adahop-lv2's calibration (x). Its train steps run eagerly in BF16 "
                          "under selective recompute, also under --compile. To fit, try --grad-accum 2"), gpu
    assert gpu.endswith("goes on from it (and may add --compile).")
    # the command line: one line, exit 1, no traceback, and the run folder's error.txt says the same
    monkeypatch.setenv("TQDM_DISABLE", "1")
    oom_at(1)
    out = tmp_path / "c"
    assert main(["train", *TINY_ARGS, "--data", str(data_dir), "--out", str(out), "--steps", "2"]) == 1
    err = capsys.readouterr().err
    assert "adahop train: out of GPU memory (CUDA out of memory" in err and "Traceback" not in err, err
    assert "out of GPU memory" in (out / "error.txt").read_text()
