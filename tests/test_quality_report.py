"""experiments/quality/report.py: each run's BF16 reference is the same seed's, of its own code revision
when there is one (docs/results.md: BF16 moved 0.04 between revisions, more than most recipe gaps)."""

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def rep(repo_script):
    return repo_script("experiments/quality/report.py")


def _run(folder: Path, recipe: str, seed: int, rev: str, loss: float, *, interrupted=False, optimizer="adamw"):
    folder.mkdir(parents=True)
    cfg = {"recipe": recipe, "seed": seed, "data_seed": None, "optimizer": optimizer,
           "master_weights": "fp32", "optimizer_states": "fp32"}
    (folder / "config.json").write_text(json.dumps({"adahop": {"config": cfg, "git_revision": rev + "0" * 33}}))
    (folder / "summary.json").write_text(json.dumps({"final_val_loss": loss, "interrupted": interrupted}))


def test_reference_prefers_the_same_revision_then_the_refs_order(rep, tmp_path):
    out, rerun, optim = tmp_path / "q", tmp_path / "rev", tmp_path / "optim"
    _run(out / "bf16-s0", "bf16", 0, "aaaaaaa", 3.90)
    _run(out / "mxfp4-s0", "mxfp4", 0, "aaaaaaa", 4.00)   # same revision as q's BF16
    _run(out / "halo-2-s0", "halo-2", 0, "ccccccc", 4.01)  # no BF16 at ccccccc: the first --refs folder's
    _run(out / "tseng-s1", "tseng", 1, "bbbbbbb", 4.10)    # only the optimizer folder has seed 1 at bbbbbbb
    _run(rerun / "bf16-s0", "bf16", 0, "ddddddd", 3.96)
    _run(rerun / "bf16-s1", "bf16", 1, "ddddddd", 4.07)
    _run(optim / "adamw-fp32-bf16-s1", "bf16", 1, "bbbbbbb", 4.06)
    _run(optim / "adamw-bf16-bf16-s0", "bf16", 0, "ccccccc", 3.99, optimizer="adamw")
    # a BF16-master row is not a reference: master weights differ
    cfg = json.loads((optim / "adamw-bf16-bf16-s0/config.json").read_text())
    cfg["adahop"]["config"]["master_weights"] = "bf16"
    (optim / "adamw-bf16-bf16-s0/config.json").write_text(json.dumps(cfg))
    _run(optim / "adamw-fp32-bf16-s9", "bf16", 9, "ccccccc", 3.0, interrupted=True)
    refs = rep._references([rerun, optim, out])
    assert {r[3].name for r in refs} == {"bf16-s0", "bf16-s1", "adamw-fp32-bf16-s1"}
    pick = {n: rep._pick(out / n, refs)[:2] for n in ("mxfp4-s0", "halo-2-s0", "tseng-s1")}
    assert pick == {"mxfp4-s0": (3.90, "aaaaaaa"), "halo-2-s0": (3.96, "ddddddd"), "tseng-s1": (4.06, "bbbbbbb")}


def test_a_run_folder_given_as_refs_is_the_only_reference_taken_from_its_launcher(rep, tmp_path):
    out, optim = tmp_path / "q", tmp_path / "optim"
    _run(out / "bf16-s1", "bf16", 1, "aaaaaaa", 4.07)
    _run(out / "mxfp4-s1", "mxfp4", 1, "bbbbbbb", 4.10)
    _run(optim / "adamw-fp32-bf16-s0", "bf16", 0, "ccccccc", 3.96)
    _run(optim / "adamw-fp32-bf16-s1", "bf16", 1, "ccccccc", 4.06)
    refs = rep._references([optim / "adamw-fp32-bf16-s0", out])  # the run, not its siblings
    assert [r[3].name for r in refs] == ["adamw-fp32-bf16-s0", "bf16-s1"]
    assert rep._pick(out / "mxfp4-s1", refs)[:2] == (4.07, "aaaaaaa")


def test_ablation_table_pairs_each_arm_with_its_full_recipe_per_seed(rep, tmp_path):
    out = tmp_path / "q"
    for name, seed, loss in [("bf16", 0, 4.00), ("bf16", 1, 4.10), ("mxfp4", 0, 4.08), ("mxfp4", 1, 4.141),
                             ("mxfp4@only-fprop", 0, 4.04), ("mxfp4@only-fprop", 1, 4.1205), ("mxfp4@only-wgrad", 0, 3.99)]:
        _run(out / f"{name}-s{seed}", name, seed, "aaaaaaa", loss)
    runs = {p.name: rep._finished(p) for p in sorted(out.iterdir())}
    refs = rep._references([out])
    base = {n: rep._pick(out / n, refs) for n in runs}
    rows = [r for r in rep._ablation(runs, base) if r.startswith("| mxfp4")]
    # fprop: +1.00% and +0.50% against full gaps of +2.00% and +1.00%: a share of 50% at both seeds
    assert rows[0] == "| mxfp4 | fprop | s0 +1.00, s1 +0.50 | +0.75 ± 0.35 | +1.50 ± 0.71 | +50.00 ± 0.00 |"
    assert rows[1] == "| mxfp4 | wgrad | s0 -0.25 | -0.25 | +2.00 | -12.50 |"  # one seed: no std
    assert rep._ablation({n: s for n, s in runs.items() if "@" not in n}, base) == []


def test_paired_differences_per_seed_and_step(repo_script, tmp_path):
    paired = repo_script("experiments/quality/paired.py")
    for name, losses in [("arm-s0", {100: 5.0, 200: 4.5}), ("arm-s1", {100: 5.2}), ("base-s0", {100: 4.9, 200: 4.6}),
                         ("base-s1", {100: 5.0, 200: 4.7})]:
        (tmp_path / name).mkdir()
        recs = [{"step": 50, "loss": 6.0}] + [{"step": s, "val_loss": v} for s, v in losses.items()]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    rows = paired.paired_rows(str(tmp_path / "arm-s{seed}"), str(tmp_path / "base-s{seed}"), [0, 1])
    assert rows[2] == "| 100 | +0.1000 | +0.2000 | +0.1500 ± 0.0707 |"
    assert rows[3] == "| 200 | -0.1000 | — | -0.1000 |"  # seed 1's arm stopped before step 200
    with pytest.raises(ValueError, match="must contain"):
        paired.paired_rows(str(tmp_path / "arm-s0"), str(tmp_path / "base-s{seed}"), [0])
