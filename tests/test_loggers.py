"""`adahop train --log-to jsonl,tensorboard,wandb`: the same numbers reach TensorBoard and W&B (offline,
no network), with the plan as a table at the freeze; a missing package names the extra to install."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from adahop.cli import main
from adahop.train.metrics import read_metrics


@pytest.fixture(scope="module")
def data_dir(prepare_real_text) -> Path:
    return prepare_real_text(150_000)


def _args(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "llama-tiny", "--data", str(data_dir), "--out", str(out), "--seq-len", "32",
            "--batch-size", "4", "--steps", "6", "--warmup-steps", "2", "--eval-every", "3", "--eval-batches", "2",
            "--ckpt-every", "0", "--log-every", "1", "--device", "cpu", "--recipe", "adahop-lv2", "--calib-steps", "2", *extra]


def test_tensorboard_and_wandb_get_the_run_and_the_plan(data_dir, tmp_path, monkeypatch, single_thread):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default: this machine has no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    out = tmp_path / "run"
    assert main(_args(data_dir, out, "--log-to", "jsonl,tensorboard,wandb")) == 0
    recs = read_metrics(out / "metrics.jsonl")
    train = {r["step"]: r for r in recs if "loss" in r}
    val = {r["step"]: r for r in recs if "val_loss" in r}
    plan = json.loads((out / "plan.json").read_text())
    counts = next(r["plan_strategies"] for r in recs if "plan_strategies" in r)
    assert sum(v for k, v in counts.items() if k.startswith("fprop/")) == len(plan["layers"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"train/loss", "train/lr", "train/grad_norm", "train/tok_per_s", "train/memory_mb", "val/loss", "val/bpb"}
    assert want <= tags
    tb_loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert tb_loss.keys() == train.keys() == set(range(1, 7))
    assert all(abs(tb_loss[s] - train[s]["loss"]) < 1e-5 for s in train)  # the very numbers of metrics.jsonl
    assert {e.step: e.value for e in acc.Scalars("val/bpb")} == pytest.approx({s: r["val_bpb"] for s, r in val.items()})
    assert all(train[s]["memory_mb"] > 0 for s in train)
    for k, v in counts.items():
        (e,) = acc.Scalars(f"adahop/{k}")
        assert (e.step, e.value) == (2, v)  # at the freeze (calibration of 2 steps)
    text = acc.Tensors("adahop/plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert all(name in text for name in plan["layers"])

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    # the offline run file holds each history row's values as JSON text: every logged number is in it
    history = next(run_dir.glob("*.wandb")).read_bytes()
    for s, r in train.items():
        assert json.dumps(r["loss"]).encode() in history and json.dumps(r["grad_norm"]).encode() in history
    assert all(json.dumps(r["val_bpb"]).encode() in history for r in val.values())
    assert b"train/tok_per_s" in history and b"train/memory_mb" in history and b"adahop/fprop/" in history
    (table,) = run_dir.glob("files/media/table/adahop/plan_2_*.table.json")  # the plan table, logged at step 2
    t = json.loads(table.read_text())
    assert t["columns"] == ["layer", "x", "w", "dy", "fprop", "dgrad", "wgrad"]
    assert {row[0]: row[4:] for row in t["data"]} == {n: [e["fprop"], e["dgrad"], e["wgrad"]] for n, e in plan["layers"].items()}
    assert (out / "wandb_id").read_text().strip() in run_dir.name  # --resume continues this W&B run


def test_unknown_or_missing_logger_is_refused_naming_the_extra(data_dir, tmp_path, monkeypatch, capsys):
    assert main(_args(data_dir, tmp_path / "a", "--log-to", "jsonl,mlflow")) == 2
    assert "--log-to: unknown logger 'mlflow'; use a comma-separated list of jsonl, tensorboard, wandb" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(_args(data_dir, tmp_path / "b", "--log-to", "wandb")) == 2
    err = capsys.readouterr().err
    assert "--log-to wandb: the 'wandb' package is not installed; install it with pip install 'adahop[wandb]'" in err
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # refused before any work


def test_the_readme_logging_command_runs(data_dir, tmp_path, monkeypatch, single_thread):
    """The README's TensorBoard/W&B command, on the test corpus and shortened (--data and --steps replaced)."""
    import re
    import shlex

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.chdir(tmp_path)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    cmd = re.search(r"\n### TensorBoard and W&B\n.*?```bash\n(.*?)\n```", readme, re.S).group(1)
    argv = shlex.split(cmd)
    assert argv[0] == "adahop"
    argv = argv[1:]
    argv[argv.index("--data") + 1] = str(data_dir)
    argv[argv.index("--steps") + 1] = "4"
    argv += ["--seq-len", "32", "--batch-size", "4", "--calib-steps", "2", "--eval-every", "4", "--eval-batches", "2",
             "--device", "cpu"]
    assert main(argv) == 0
    run = tmp_path / "runs" / "logged"
    assert list((run / "tensorboard").glob("events.out.tfevents.*")) and list((run / "wandb").glob("offline-run-*"))


def test_the_logged_strategy_counts_are_what_the_layers_run(data_dir, tmp_path, single_thread):
    """Under ``@only-wgrad`` fprop and dgrad run BF16 whatever the plan says: metrics.jsonl's counts (and the
    loggers', the same dict) are the GEMMs as they run, as ``describe`` shows them (they were the plan's)."""
    out = tmp_path / "run"
    args = _args(data_dir, out, "--steps", "3", "--eval-every", "0")
    args[args.index("adahop-lv2")] = "adahop-lv2@only-wgrad"
    assert main(args) == 0
    plan = json.loads((out / "plan.json").read_text())
    counts = next(r["plan_strategies"] for r in read_metrics(out / "metrics.jsonl") if "plan_strategies" in r)
    n = len(plan["layers"])
    assert counts["fprop/bf16"] == counts["dgrad/bf16"] == n
    assert not any(k.startswith(("fprop/", "dgrad/")) and not k.endswith("/bf16") for k in counts)
    assert sum(v for k, v in counts.items() if k.startswith("wgrad/")) == n
    assert any(e["fprop"] != "bf16" for e in plan["layers"].values())  # the plan itself quantizes some fprop
