"""scripts/run_ptq_experiment.py without running a cell: the order of the cells, resuming, the summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def s(repo_script):
    return repo_script("scripts/run_ptq_experiment.py")


def test_cheap_cells_of_every_model_run_before_harp_and_2_bits_first(s):
    todo = s.cells(["a", "b"], [2, 4], ["rtn", "gptq", "rht-gptq", "harp-gptq"], mx=True)
    assert len(todo) == 2 * 2 * 4 + 2 * 2  # + rht-gptq and harp-gptq at MXFP4 W4 for each model
    first_harp = next(i for i, c in enumerate(todo) if c[1].startswith("harp"))
    assert all(not c[1].startswith("harp") for c in todo[:first_harp])
    assert todo[first_harp:first_harp + 2] == [("a", "harp-gptq", 2, "int", 0), ("b", "harp-gptq", 2, "int", 0)]
    assert todo[-2:] == [("a", "harp-gptq", 4, "mxfp4", 0), ("b", "harp-gptq", 4, "mxfp4", 0)]


def test_seed_repeats_rerun_the_w2_cells_that_calibrate_cheap_ones_before_harp(s):
    base = s.cells(["a"], [2, 4], ["rtn", "gptq", "rht-gptq", "harp-gptq"], mx=False)
    todo = s.cells(["a"], [2, 4], ["rtn", "gptq", "rht-gptq", "harp-gptq"], mx=False, seeds=[1])
    assert [c for c in todo if c[4] == 0] == base
    again = [c for c in todo if c[4] == 1]
    assert again == [("a", "gptq", 2, "int", 1), ("a", "rht-gptq", 2, "int", 1), ("a", "harp-gptq", 2, "int", 1)]
    assert todo.index(again[1]) < todo.index(("a", "harp-gptq", 2, "int", 0)) and todo[-1] == again[2]
    assert s.cell_dir(Path("o"), "m", "gptq", 2, "int", 1).name == "gptq-w2-int-s1"
    assert s.cell_dir(Path("o"), "m", "gptq", 2, "int").name == "gptq-w2-int"  # seed 0 keeps the old folders
    # other widths on request: W3 and W4 repeats, cheap ones of both widths before any HARP cell
    todo = s.cells(["a"], [3, 4], ["gptq", "harp-gptq"], mx=False, seeds=[1], repeat_bits=[3, 4])
    assert [c for c in todo if c[4]] == [("a", "gptq", 3, "int", 1), ("a", "gptq", 4, "int", 1),
                                         ("a", "harp-gptq", 3, "int", 1), ("a", "harp-gptq", 4, "int", 1)]
    assert todo.index(("a", "gptq", 4, "int", 1)) < todo.index(("a", "harp-gptq", 3, "int", 0))


def test_a_finished_cell_is_skipped_and_the_summary_checks_the_order(s, tmp_path, capsys):
    model = tmp_path / "m"
    out = tmp_path / "out"
    (out / "m").mkdir(parents=True)
    (out / "m" / "baseline.json").write_text(json.dumps({"perplexity": {"perplexity": 10.0}}))
    for method, ppl in (("rtn", 14.0), ("gptq", 12.0)):
        d = s.cell_dir(out, str(model), method, 2, "int")
        d.mkdir(parents=True)
        layers = {"l": {"shape": [4, 8], "stored_bits": 1}}
        d.joinpath("ptq.json").write_text(json.dumps({
            "perplexity": {"perplexity": ppl, "loss": 1.0}, "bits_per_weight": 2.125, "seconds_quantize": 1.0,
            "seconds_total": 2.0, "harp_fit_seconds_per_layer": None, "layers": layers, "device": "cpu", "calib_tokens": 64}))
    d = s.cell_dir(out, str(model), "gptq", 2, "int", 1)  # a seed repeat: its own section, not the table
    d.mkdir(parents=True)
    d.joinpath("ptq.json").write_text(json.dumps({
        "perplexity": {"perplexity": 12.5, "loss": 1.0}, "bits_per_weight": 2.125, "seconds_quantize": 1.0,
        "seconds_total": 2.0, "harp_fit_seconds_per_layer": None, "layers": layers, "device": "cpu", "calib_tokens": 64}))
    rc = s.main(["--models", str(model), "--data", str(tmp_path), "--out", str(out), "--bits", "2", "--methods", "rtn,gptq",
                 "--no-mx", "--budget-s", "60", "--repeat-seeds", "1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "skipped" in printed and "| gptq | 2 | int | 2.125 | 12.0000 | +20.00 |" in printed
    assert "- W2: gptq < rtn (gptq 12.000, rtn 14.000)" in printed
    assert "| m | gptq | 12.0000 | 12.5000 | 12.2500 | 0.5000 |" in printed
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [(r["status"], r["seed"]) for r in rows] == [("done", 0), ("done", 0), ("done", 1)]


def test_the_first_cell_of_a_model_scores_the_baseline_and_later_cells_skip_it(s, tmp_path, monkeypatch):
    """The baseline comes from `adahop ptq`'s own (BF16-rounded) baseline of the first cell run, and is
    kept in OUT/<model>/baseline.json; the other cells pass --skip-baseline."""
    model, out, cmds = tmp_path / "m", tmp_path / "out", []

    def fake_run(cmd, log, timeout):  # writes the ptq.json a cell would, with a baseline only when asked
        cmds.append(cmd)
        d = Path(cmd[cmd.index("--out") + 1])
        d.mkdir(parents=True, exist_ok=True)
        base = None if "--skip-baseline" in cmd else {"perplexity": 10.0}
        d.joinpath("ptq.json").write_text(json.dumps({
            "perplexity": {"perplexity": 12.5, "loss": 2.5}, "baseline": base, "baseline_fp32": None if base is None else {"perplexity": 9.9},
            "bits_per_weight": 4.25, "seconds_quantize": 1.0, "seconds_total": 2.0, "harp_fit_seconds_per_layer": None,
            "layers": {"l": {"shape": [4, 8], "stored_bits": 1}}, "device": "cpu", "calib_tokens": 64}))
        return 0, 0.1

    monkeypatch.setattr(s, "run", fake_run)
    rc = s.main(["--models", str(model), "--data", str(tmp_path), "--out", str(out), "--bits", "4", "--methods", "rtn,gptq",
                 "--no-mx", "--budget-s", "60"])
    assert rc == 0 and len(cmds) == 2
    assert "--skip-baseline" not in cmds[0] and "--skip-baseline" in cmds[1]
    kept = json.loads((out / "m" / "baseline.json").read_text())
    assert kept["perplexity"] == {"perplexity": 10.0} and kept["perplexity_fp32"] == {"perplexity": 9.9}
    assert "Unquantized perplexity: 10.0000" in (out / "summary.md").read_text()
    assert "+25.00" in (out / "summary.md").read_text()  # 12.5 against the BF16 baseline 10.0


def test_only_the_harp_cells_get_harp_steps(s):
    """`adahop ptq` refuses --harp-steps under a method that does not fit a rotation: the script passed
    it to every cell, so `--harp-steps 200` failed all the rtn/gptq/rht cells."""
    args = argparse.Namespace(data="d", calib_tokens=64, batch_size=2, harp_steps=200, device="cpu", seq_len=None,
                              eval_batches=None, group_size=None, theta_format="int8")
    for method in ("rtn", "gptq", "rht-gptq"):
        cmd = s.ptq_cmd(args, "m", method, 2, "int", 0, Path("o"))
        assert "--harp-steps" not in cmd and "--theta-format" not in cmd
    cmd = s.ptq_cmd(args, "m", "harp-gptq", 2, "int", 0, Path("o"))
    assert cmd[cmd.index("--harp-steps") + 1] == "200" and "--seed" not in cmd
    assert cmd[cmd.index("--theta-format") + 1] == "int8"
    args.theta_format = "fp16"  # the default passes nothing: adahop ptq's own default
    assert "--theta-format" not in s.ptq_cmd(args, "m", "harp-gptq", 2, "int", 0, Path("o"))
    cmd = s.ptq_cmd(args, "m", "gptq", 2, "int", 3, Path("o"))
    assert cmd[cmd.index("--seed") + 1] == "3"


def test_concurrent_cells_run_at_once_and_a_model_scores_its_baseline_once(s, tmp_path, monkeypatch):
    """--concurrent 2: two cells are in flight together (the barrier would time out otherwise), and
    the second cell of a model skips the baseline its first cell is scoring."""
    import threading

    model, out, cmds = tmp_path / "m", tmp_path / "out", []
    both = threading.Barrier(2, timeout=10)

    def fake_run(cmd, log, timeout):
        cmds.append(cmd)
        both.wait()  # returns only once the other cell has started too
        d = Path(cmd[cmd.index("--out") + 1])
        d.mkdir(parents=True, exist_ok=True)
        base = None if "--skip-baseline" in cmd else {"perplexity": 10.0}
        d.joinpath("ptq.json").write_text(json.dumps({
            "perplexity": {"perplexity": 11.0, "loss": 2.4}, "baseline": base, "baseline_fp32": base,
            "bits_per_weight": 4.25, "seconds_quantize": 1.0, "seconds_total": 2.0, "harp_fit_seconds_per_layer": None,
            "layers": {"l": {"shape": [4, 8], "stored_bits": 1}}, "device": "cpu", "calib_tokens": 64}))
        return 0, 0.1

    monkeypatch.setattr(s, "run", fake_run)
    rc = s.main(["--models", str(model), "--data", str(tmp_path), "--out", str(out), "--bits", "4", "--methods", "rtn,gptq",
                 "--no-mx", "--budget-s", "60", "--concurrent", "2"])
    assert rc == 0 and len(cmds) == 2
    assert sum("--skip-baseline" not in c for c in cmds) == 1
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [(r["method"], r["status"]) for r in rows] == [("rtn", "done"), ("gptq", "done")]  # todo's order
    assert json.loads((out / "m" / "baseline.json").read_text())["perplexity"] == {"perplexity": 10.0}


def test_the_smoke_model_lives_outside_the_cells_folders(s, tmp_path, monkeypatch):
    """--smoke trained its model into OUT/smoke-llama-tiny, the folder its cells go to: `adahop ptq` refused
    every cell (an --out inside MODEL)."""
    monkeypatch.setattr(s, "run", lambda cmd, log, timeout: (0, 0.1))
    model = Path(s.smoke_model(argparse.Namespace(), tmp_path))
    cell = s.cell_dir(tmp_path, str(model), "gptq", 2, "int")
    assert model not in cell.parents and cell.parent != model


def test_repeat_seeds_are_checked(s, tmp_path, capsys):
    for bad, why in (("0", "must be > 0"), ("a", "comma-separated integers")):
        with pytest.raises(SystemExit):
            s.main(["--models", "m", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--repeat-seeds", bad])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):  # repeats are W2 cells unless --repeat-bits says otherwise
        s.main(["--models", "m", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--bits", "4", "--repeat-seeds", "1"])
    assert "--bits (4) must include those widths" in capsys.readouterr().err
    for bad in ("5", "x", ""):
        with pytest.raises(SystemExit):
            s.main(["--models", "m", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--bits", "3,4",
                    "--repeat-seeds", "1", "--repeat-bits", bad])
        assert "--repeat-bits" in capsys.readouterr().err
    assert s.main(["--models", "m", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--bits", "3,4", "--no-mx",
                   "--repeat-seeds", "1", "--repeat-bits", "3,4", "--dry-run"]) == 0
    assert "('m', 'rht-gptq', 4, 'int', 1)" in capsys.readouterr().out
    todo = s.cells(["m"], [2], ["rtn", "rht-rtn", "gptq", "harp-gptq"], mx=False, seeds=[1])
    assert [c[1] for c in todo if c[4]] == ["gptq", "harp-gptq"]  # only the GPTQ methods are repeated


def test_a_table_resumed_with_other_settings_or_two_models_of_one_name_are_refused(s, tmp_path, monkeypatch, capsys):
    """A second run with --eval-batches 20 (the first had 2) kept the first run's cells and baseline and showed
    them beside new ones scored on other windows; two models named 'run' shared OUT/run/ and the second was
    summarized as done with the first's numbers (helper 29)."""
    monkeypatch.setattr(s, "run", lambda cmd, log, timeout: (2, 0.1))  # every cell fails: none is needed here
    out = tmp_path / "out"
    base = ["--models", str(tmp_path / "run"), "--data", str(tmp_path), "--out", str(out), "--bits", "4",
            "--methods", "rtn", "--no-mx", "--device", "cpu", "--eval-batches", "2"]
    assert s.main(base) == 1
    assert json.loads((out / "settings.json").read_text())["eval_batches"] == 2
    assert s.main(base) == 1  # the same settings resume
    with pytest.raises(SystemExit, match=r"other settings \(--calib-tokens 131072 then, 1024 now; --eval-batches 2 "
                                         r"then, 20 now\)"):
        s.main(base[:-1] + ["20", "--calib-tokens", "1024"])
    (tmp_path / "b").mkdir()
    with pytest.raises(SystemExit):
        s.main(["--models", f"{tmp_path / 'run'},{tmp_path / 'b' / 'run'}", "--data", str(tmp_path), "--out",
                str(tmp_path / "o2"), "--bits", "4", "--methods", "rtn", "--no-mx"])
    assert "run is the folder name of more than one model" in capsys.readouterr().err
    # a kept cell of another model under the same name is not shown as this one's
    d = s.cell_dir(out, str(tmp_path / "run"), "rtn", 4, "int")
    d.mkdir(parents=True, exist_ok=True)
    d.joinpath("ptq.json").write_text(json.dumps({"source_model": str(tmp_path / "b" / "run")}))
    with pytest.raises(SystemExit, match="holds a cell of .*b/run, not of"):
        s.main(base)


def test_dry_run_refuses_options_every_cell_would_fail_on(s, tmp_path, capsys):
    """--dry-run listed 14 cells for --calib-tokens -5, --group-size 0 (dropped as falsy: the default ran), a missing
    --data, a negative budget and --concurrent 0; a real run then failed every cell (helper 64). Each is now refused
    up front, in `adahop ptq`'s words where a cell's command would be refused."""
    base = ["--models", "m", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--dry-run"]
    for extra, why in ((["--calib-tokens", "-5"], "--calib-tokens -5: must be >= 1"),
                       (["--group-size", "0"], "--group-size 0 must be >= 1"),
                       (["--harp-steps", "0"], "--harp-steps 0: must be >= 1"),
                       (["--seq-len", "0"], "--seq-len 0: must be >= 1"),
                       (["--budget-s", "-3"], "--budget-s -3.0: must be > 0"),
                       (["--concurrent", "0"], "--concurrent 0: must be >= 1"),
                       (["--data", str(tmp_path / "none")], "does not exist")):
        with pytest.raises(SystemExit):
            s.main(base + extra)
        assert why in capsys.readouterr().err, extra
    assert s.main(base + ["--group-size", "7", "--bits", "3", "--no-mx"]) == 0  # an odd group size is a valid one
    assert "('m', 'harp-gptq', 3, 'int', 0)" in capsys.readouterr().out
    args = argparse.Namespace(data="d", calib_tokens=8, batch_size=2, device="cpu", harp_steps=3, theta_format="fp16",
                              seq_len=None, eval_batches=None, group_size=0)
    assert s.ptq_cmd(args, "m", "gptq", 2, "int", 0, tmp_path)[-2:] == ["--group-size", "0"]  # passed on, not dropped
