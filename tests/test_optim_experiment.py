"""scripts/run_optim_experiment.py's report: gaps are paired with the reference run of the same seed."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def s(repo_script):
    return repo_script("scripts/run_optim_experiment.py")


def _summary(loss):
    return {"final_val_loss": loss, "peak_memory_bytes": 2**30, "bytes_per_param": 6.0, "tok_per_s": 1000.0}


def test_a_one_seed_row_is_compared_with_the_reference_of_its_own_seed(s):
    runs = {"adamw-fp32-bf16-s0": _summary(4.0), "adamw-fp32-bf16-s1": _summary(4.2),
            "madam-fp8-bf16-s0": _summary(4.4), "madam-bf16-bf16-s0": _summary(3.6), "madam-bf16-bf16-s1": _summary(4.2)}
    own, gaps = s.paired_gaps(runs, "madam-fp8", "bf16")
    assert own == {0: 4.4} and abs(gaps[0] - 10.0) < 1e-9  # not (4.4 - 4.1) / 4.1, the two-seed mean
    own, gaps = s.paired_gaps(runs, "madam-bf16", "bf16")
    assert abs(gaps[0] + 10.0) < 1e-9 and abs(gaps[1]) < 1e-9
    assert s.paired_gaps(runs, "madam-bf16", "adahop-lv2") == ({}, {})  # another recipe's runs are not read


def test_report_writes_per_seed_losses_and_mean_std_of_paired_gaps(s, tmp_path):
    for name, loss in {"adamw-fp32-bf16-s0": 4.0, "adamw-fp32-bf16-s1": 4.2, "madam-bf16-bf16-s0": 3.6,
                       "madam-bf16-bf16-s1": 4.2, "madam-fp4-bf16-s1": 6.3}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(_summary(loss)))
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": loss}) + "\n")

    class Args:
        out = str(tmp_path)

    assert s.report(Args) == 0
    table = (tmp_path / "table.md").read_text()
    assert "| madam-bf16 | bf16 | s0 3.6000, s1 4.2000 | -5.00 ± 7.07 |" in table  # gaps -10% and 0%
    assert "| madam-fp4 | bf16 | s1 6.3000 | +50.00 |" in table  # paired with seed 1's 4.2
