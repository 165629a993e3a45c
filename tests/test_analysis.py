"""`adahop analyze`: the census on hand-made pattern sequences (votes, flips, counts, stability),
the recorder's hooks, the IHT gain on real-shaped operands, the plan round trip against a
converted model, every figure writer, and tiny end-to-end runs (fresh, --run, --synthetic)."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest
import torch
from torch import nn

import adahop
from adahop.analysis import census as cs
from adahop.analysis import figures, report
from adahop.analysis.cli import add_arguments, capture_layers, pick_layer, record_steps, run, vote_window
from adahop.analysis.recorder import PatternRecorder, linear_names
from adahop.hadamard import block_hadamard
from adahop.models import build_model
from adahop.nn import LowPrecisionLinear
from adahop.patterns import Plan, detect_pattern, pattern_stats

PNG = b"\x89PNG\r\n\x1a\n"

# Three layers, four recorded steps. Votes (ties go to the pattern seen first):
#   L0: x C (3 of 4), w R (R,R,N,N: tie, R first), dy R  → fprop (C, flip R=C) CC, dgrad RR, wgrad (flip R=C, C) CC
#   L1: x N,           w C,                       dy C (tie) → fprop (N, flip C=R) NR, dgrad CC, wgrad (R, N) RN
#   L2: x R,           w N,                       dy N       → fprop RN, dgrad NN, wgrad NR
HISTORY = {
    "model.layers.0.mlp.up_proj": {"x": list("CCRC"), "w": list("RRNN"), "dy": list("RRRC")},
    "model.layers.1.mlp.up_proj": {"x": list("NNNC"), "w": list("CNCC"), "dy": list("CCNN")},
    "model.layers.1.mlp.down_proj": {"x": list("RRRR"), "w": list("NNNN"), "dy": list("NNNN")},
}


# ---- census ----------------------------------------------------------------------------------


def test_vote_ties_go_to_the_first_pattern_and_respect_the_window():
    v = cs.vote(HISTORY, calib_steps=4)
    assert v["model.layers.0.mlp.up_proj"] == {"x": "C", "w": "R", "dy": "R"}
    assert v["model.layers.1.mlp.up_proj"] == {"x": "N", "w": "C", "dy": "C"}
    # a window of 1 step takes the first pattern of each tensor
    assert cs.vote(HISTORY, calib_steps=1)["model.layers.0.mlp.up_proj"] == {"x": "C", "w": "R", "dy": "R"}
    assert cs.vote({"a": {"x": list("NCCC"), "w": [], "dy": list("R")}}, calib_steps=2)["a"] == {"x": "N", "w": "N", "dy": "R"}
    with pytest.raises(ValueError, match="calib-steps"):
        cs.vote(HISTORY, calib_steps=0)


def test_census_counts_with_orientation_flips():
    c = cs.census(cs.vote(HISTORY, calib_steps=4))
    nonzero = {col: {p: n for p, n in c.counts[col].items() if n} for col in c.counts}
    assert nonzero == {
        "fprop": {"CC": 1, "NR": 1, "RN": 1},
        "dgrad": {"RR": 1, "CC": 1, "NN": 1},
        "wgrad": {"CC": 1, "RN": 1, "NR": 1},
        "total": {"RR": 1, "RN": 2, "CC": 3, "NR": 2, "NN": 1},
    }
    assert c.never == ("RC", "CR", "CN", "NC")
    assert c.layers == 3
    assert c.share("total", "CC") == pytest.approx(3 / 9)


def test_stability_is_the_share_of_steps_agreeing_with_the_vote():
    v = cs.vote(HISTORY, calib_steps=4)
    s = cs.stability(HISTORY, v)
    assert s["model.layers.0.mlp.up_proj"] == {"x": 0.75, "w": 0.5, "dy": 0.75}
    assert s["model.layers.1.mlp.down_proj"] == {"x": 1.0, "w": 1.0, "dy": 1.0}
    m = cs.mean_stability(s)
    assert m["x"] == pytest.approx((0.75 + 0.75 + 1.0) / 3)
    assert m["w"] == pytest.approx((0.5 + 0.75 + 1.0) / 3)


def test_census_files_have_table_1_layout():
    c = cs.census(cs.vote(HISTORY, calib_steps=4))
    md = report.census_markdown(c)
    assert "| pair (A,B) | fprop | dgrad | wgrad | total |" in md
    assert "| **CC** | 1 (33.3%) | 1 (33.3%) | 1 (33.3%) | 3 (33.3%) | bf16 |" in md
    assert "Pairs that never occur: RC, CR, CN, NC." in md
    assert "| iht+oe_left (wgrad: iht) |" in md  # the RN row: wgrad's OE-Left runs as IHT, as the plan has it
    rows = report.census_csv(c).splitlines()
    assert rows[0] == "pair,fprop,fprop_pct,dgrad,dgrad_pct,wgrad,wgrad_pct,total,total_pct"
    assert [r.split(",")[0] for r in rows[1:]] == list(cs.PAIRS)
    assert "CC,1,33.33,1,33.33,1,33.33,3,33.33" in rows


def test_plan_round_trip_matches_a_converted_model(tmp_path):
    model = build_model("llama-tiny", vocab_size=300, max_seq_len=32)
    names = linear_names(model)
    voted = {n: {"x": "C", "w": "N", "dy": "R"} for n in names}
    voted[names[0]] = {"x": "C", "w": "R", "dy": "C"}  # a CC pair on fprop and wgrad
    plan = Plan.from_patterns(voted, "lv2")
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.layers == plan.layers and loaded.table == "lv2"
    adahop.convert_model(model, "adahop-lv2", plan=loaded)
    converted = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
    assert [m.name for m in converted] == names and "model.layers.0.self_attn.q_proj" in names
    for m in converted:
        assert m.strategies() == {g: loaded.layers[m.name][g] for g in ("fprop", "dgrad", "wgrad")}
    assert converted[0].strategies() == {"fprop": "bf16", "dgrad": "iht", "wgrad": "iht+oe_right"}


# ---- recorder ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"rule": "significance"}, {"floor": 3.0, "min_peak": 2.0}], ids=str)
def test_recorder_classifies_as_detect_pattern(gen, kw):
    """The recorder computes each tensor's statistics once and classifies them with the training
    detector: same pattern as detect_pattern, under every rule and gate."""
    model = nn.Sequential(nn.Linear(96, 64))
    rec = PatternRecorder(model, **kw)
    for i in range(12):
        x = torch.randn(64, 96, generator=gen)
        if i % 3 == 0:
            x[:, i % 96] *= 1 + i
        elif i % 3 == 1:
            x[i % 64] *= 1 + i
        rec.start(i + 1)
        model(x).sum().backward()
        rec.stop()
        r = [r for r in rec.records if r.step == i + 1 and r.tensor == "x"][0]
        assert r.pattern == str(detect_pattern(x, **kw)), i
        assert (r.cv_row, r.cv_col) == pytest.approx(pattern_stats(x)) and r.row_peak >= 1 and r.col_peak >= 1


def test_recorder_records_no_call_without_tokens(gen):
    """An empty call (an MoE expert that got no tokens) records nothing, not even W; the step's
    next call with tokens is its observation."""
    model = nn.Sequential(nn.Linear(64, 32))
    rec = PatternRecorder(model)
    rec.start(1)
    model(torch.empty(0, 64, requires_grad=True)).sum().backward()
    assert rec.records == []
    x = torch.randn(50, 64, generator=gen)
    x[:, 3] *= 30
    model(x).square().sum().backward()
    rec.stop()
    assert sorted(r.tensor for r in rec.records) == ["dy", "w", "x"]
    assert [r.pattern for r in rec.records if r.tensor == "x"] == ["C"]


def test_census_votes_over_the_window_not_the_first_recorded_steps(gen):
    """Steps 1-3 carry column-outlier inputs, steps 4-10 row-outlier ones. With the figure sampled
    every 5 steps the window 1-3 is still recorded in full and votes C; voting over the first 3
    *recorded* steps of the figure (1, 5, 10), as the census once did, would say R."""
    model = nn.Sequential(nn.Linear(64, 32))
    rec = PatternRecorder(model)
    figure, window = record_steps(10, 5, None), vote_window(10, 3)
    assert figure == [1, 5, 10] and window == [1, 2, 3] and vote_window(2, 30) == [1, 2]
    for step in range(1, 11):
        x = torch.randn(128, 64, generator=gen)
        if step <= 3:
            x[:, 5] *= 40
        else:
            x[7] *= 40
        if step in set(figure) | set(window):
            rec.start(step)
        model(x).square().sum().backward()
        rec.stop()
    steps, in_window = rec.history(window)
    assert steps == [1, 2, 3] and cs.vote(in_window, len(window))["0"]["x"] == "C"
    fsteps, fig_hist = rec.history(figure)
    assert fsteps == figure and fig_hist["0"]["x"] == ["C", "R", "R"]
    assert cs.vote(rec.history()[1], 3)["0"]["x"] == "C"
    assert cs.vote(fig_hist, 3)["0"]["x"] == "R"  # the old protocol
    with pytest.raises(ValueError, match="calib-steps"):
        vote_window(10, 0)


def test_recorder_hooks_x_w_dy_in_storage_layout(gen, tmp_path):
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32))
    rec = PatternRecorder(model, capture=["0"], capture_tokens=40, dump_dir=tmp_path / "dumps")
    assert rec.names == ["0", "2"]
    x = torch.randn(2, 50, 64, generator=gen)
    x[..., 5] *= 30  # a column-outlier input: X [T, K] has pattern C
    for step in (1, 2, 3):
        if step != 2:  # step 2 is not recorded
            rec.start(step, capture=step == 3)
        model(x).square().sum().backward()
        rec.stop()
    rec.close()
    steps, hist = rec.history()
    assert steps == [1, 3]
    assert {(r.layer, r.tensor) for r in rec.records} == {(n, t) for n in ("0", "2") for t in ("x", "w", "dy")}
    assert hist["0"]["x"] == ["C", "C"]
    assert rec.capture_step == 3 and set(rec.captures) == {"0"}
    cap = rec.captures["0"]
    assert cap["x"].shape == (40, 64) and cap["w"].shape == (96, 64) and cap["dy"].shape == (40, 96)
    assert {p.name for p in (tmp_path / "dumps").iterdir()} == {"step_0000001.safetensors", "step_0000003.safetensors"}
    model(x).sum().backward()  # hooks removed: nothing more is recorded
    assert len(rec.records) == 12


def test_record_steps_layers_and_choices():
    assert record_steps(10, None, None) == list(range(1, 11))
    assert record_steps(12, 5, None) == [1, 5, 10, 12]
    assert record_steps(12, None, [3, 7]) == [3, 7]
    with pytest.raises(ValueError, match="--record-steps 0,99: outside the run's steps 1..12"):
        record_steps(12, None, [3, 7, 99, 0])  # they were dropped silently
    assert record_steps(12, 5, [3]) == [1, 3, 5, 10, 12]
    with pytest.raises(ValueError, match="record-every"):
        record_steps(10, 0, None)
    names = [f"model.layers.{i}.{s}" for i in range(4) for s in ("self_attn.q_proj", "mlp.down_proj")]
    assert pick_layer(names, None) == "model.layers.2.mlp.down_proj"
    assert pick_layer(names, "layers.1.mlp.down_proj") == "model.layers.1.mlp.down_proj"
    with pytest.raises(ValueError, match="matches 4 layers"):
        pick_layer(names, "down_proj")
    assert capture_layers(names, 16, names[3]) == names
    picked = capture_layers(names, 3, names[3])
    assert picked[:3] == [names[0], names[4], names[7]] and names[3] in picked


# ---- IHT gain on real-shaped operands -------------------------------------------------------------


def test_iht_gain_runs_each_gemm_and_groups_by_pair(gen, single_thread):
    x = torch.randn(128, 64, generator=gen)
    x[:, 3] *= 20  # X column outliers
    w = torch.randn(32, 64, generator=gen) * 0.1
    dy = torch.randn(128, 32, generator=gen) * 1e-4
    dy[7] *= 30  # ∇Y row outliers
    rows = cs.iht_gain({"l": {"x": x, "w": w, "dy": dy}}, oe_rank=64)
    assert [(r.path, r.pair, r.m, r.kc, r.n) for r in rows] == [
        ("fprop", "CN", 128, 64, 32), ("dgrad", "RN", 128, 32, 64), ("wgrad", "CC", 32, 128, 64)]
    assert rows[0].oe_left_rank == 32 and rows[0].oe_right_rank == 8  # capped at a quarter of M and N
    for r in rows:
        assert set(r.errors) == set(cs.GAIN_STRATEGIES) and all(0 < e < 1 for e in r.errors.values())
    assert rows[1].reduction("iht+oe_left") > 0.3  # OE-Left removes ∇Y's outlier row on dgrad
    by_pair = cs.gain_by_pair(rows)
    assert list(by_pair) == ["RN", "CC", "CN"] and by_pair["CC"]["assigned"] == 1.0  # Lv2: CC → BF16
    assert report.gain_csv(rows).splitlines()[0].startswith("layer,path,pair,m,kc,n,")
    assert "| RN | 1 |" in report.gain_markdown(by_pair)


# ---- figures -------------------------------------------------------------------------------------


def _is_png(path) -> bool:
    return path.exists() and path.stat().st_size > 5000 and path.read_bytes()[:8] == PNG


def test_plot_functions_write_pngs(tmp_path, gen):
    voted = cs.vote(HISTORY, calib_steps=2)
    p = figures.plot_patterns_over_steps([1, 5, 10, 15], HISTORY, tmp_path / "a.png", calib_steps=2)
    assert _is_png(p)
    assert _is_png(figures.plot_patterns_by_depth(voted, tmp_path / "b.png"))
    x, w, dy = torch.randn(64, 32, generator=gen), torch.randn(32, 32, generator=gen), torch.randn(64, 32, generator=gen)
    rows = cs.iht_gain({"l": {"x": x, "w": w, "dy": dy}}, oe_rank=8)
    assert _is_png(figures.plot_iht_gain(cs.gain_by_pair(rows), tmp_path / "c.png", rows=rows))
    errors = {"RR": {"none": 0.2, "iht": 0.15, "iht+oe_left": 0.07, "iht+oe_right": 0.14, "bf16": 0.0},
              "CC": {"none": 0.2, "iht": 0.16, "iht+oe_left": 0.15, "iht+oe_right": 0.07, "bf16": 0.0}}
    assert _is_png(figures.plot_synthetic(errors, {"RR": "iht", "CC": "bf16"}, tmp_path / "d.png"))
    panels = [("|X|", x, ("token", "channel")), ("|H·X|", block_hadamard(x, block_size=32, axis=0), ("t", "c"))]
    assert _is_png(figures.plot_tensor_3d(panels, tmp_path / "e.png", ncols=2, title="t"))
    big = torch.randn(300, 200, generator=gen)
    big[17, 33] = 100.0
    z = figures.downsample_abs(big, 128)
    assert z.shape == (128, 128) and z.max() == 100.0  # max-pooling keeps the outlier
    assert figures.short_name("model.layers.3.self_attn.q_proj") == "L3.self_attn.q_proj"


# ---- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """~100 KB of word salad, prepared with a 512-token byte-level BPE."""
    rnd = random.Random(0)
    words = [w for w in "the of and to in a is that for it as was with be by on not he this are or his from at which "
             "but have an they you were her she there been one all we their has would when if so no will".split()]
    text = "\n".join(" ".join(rnd.choice(words) for _ in range(rnd.randint(8, 20))).capitalize() + "." for _ in range(900))
    root = tmp_path_factory.mktemp("an")
    (root / "corpus.txt").write_text(text * 2)
    from adahop.data import prepare

    prepare([str(root / "corpus.txt")], root / "prep", tokenizer="bpe", vocab_size=512, val_fraction=0.05)
    return root / "prep"


def _args(*argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


TINY = ("--model", "llama-tiny", "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "1", "--device", "cpu",
        "--gain-tokens", "64")


def test_a_compare_folder_as_run_lists_its_runs(compare_folder):
    with pytest.raises(ValueError, match=rf"--run {compare_folder} holds 2 runs \(a folder of runs, such as `adahop compare`'s: one per "
                                         rf"recipe\), not one run; pass one of them: {compare_folder / 'bf16'}, "):
        run(_args("--run", str(compare_folder), "--steps", "2", "--out", str(compare_folder / "an")))


def test_end_to_end_writes_every_output(data_dir, tmp_path, single_thread, capsys):
    out = tmp_path / "an"
    paths = run(_args(*TINY, "--data", str(data_dir), "--steps", "4", "--record-every", "2", "--calib-steps", "2",
                      "--out", str(out)))
    names = {p.name for p in out.iterdir()}
    assert {"census.md", "census.csv", "patterns_over_steps.png", "patterns_by_depth.png", "iht_gain.png",
            "iht_gain.csv", "plan.json", "report.md", "patterns.csv", "records.csv", "analysis.json",
            "tensor_3d_model.layers.1.mlp.down_proj.png"} <= names, names
    for p in paths.values():
        if p.suffix == ".png":
            assert _is_png(p), p
    meta = json.loads((out / "analysis.json").read_text())
    assert meta["recorded_steps"] == [1, 2, 4]
    plan = Plan.load(out / "plan.json")
    model = build_model("llama-tiny", vocab_size=512, max_seq_len=32)
    assert set(plan.layers) == set(linear_names(model))  # the names `adahop train --plan` looks up
    mods = dict(model.named_modules())  # and their shapes: a model of other widths under the same names is refused
    assert plan.shapes == {n: [mods[n].in_features, mods[n].out_features] for n in plan.layers}
    import transformers

    import adahop

    cfg = dict(model.config.to_dict(), hidden_size=64, intermediate_size=192)  # same names, half the widths
    narrow = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    with pytest.raises(ValueError, match="the plan was frozen on another model: layer .* is 64->"):
        adahop.convert_model(narrow, "adahop-lv2", plan=str(out / "plan.json"))
    csv_rows = (out / "census.csv").read_text().splitlines()[1:]
    assert sum(int(r.split(",")[1]) for r in csv_rows) == 14  # 14 layers on fprop
    rep = (out / "report.md").read_text()
    assert "](census.md)" in rep and "](patterns_over_steps.png)" in rep and "mean stability" in rep
    assert len((out / "records.csv").read_text().splitlines()) == 1 + 3 * 14 * 3
    assert "Outlier-pattern pair census" in capsys.readouterr().out


def test_end_to_end_census_window_is_recorded_in_full(data_dir, tmp_path, single_thread):
    """--record-every governs only the figure: the vote window (steps 1-3) is recorded every step,
    the vote is over it, and plan.json, census.md and analysis.json say so."""
    out = tmp_path / "an_window"
    run(_args(*TINY, "--data", str(data_dir), "--steps", "6", "--record-every", "5", "--calib-steps", "3",
              "--gain-layers", "2", "--out", str(out)))
    meta = json.loads((out / "analysis.json").read_text())
    assert meta["recorded_steps"] == [1, 2, 3, 5, 6] and meta["figure_steps"] == [1, 5, 6]
    assert meta["vote_window"] == [1, 3]
    rows = [line.split(",") for line in (out / "records.csv").read_text().splitlines()]
    assert rows[0] == ["step", "layer", "tensor", "pattern", "cv_row", "cv_col", "row_peak", "col_peak"]
    assert sorted({int(r[0]) for r in rows[1:]}) == [1, 2, 3, 5, 6]
    history: dict = {}
    for r in rows[1:]:
        if int(r[0]) <= 3:
            history.setdefault(r[1], {}).setdefault(r[2], []).append(r[3])
    plan = Plan.load(out / "plan.json")
    assert {n: {k: e[k] for k in ("x", "w", "dy")} for n, e in plan.layers.items()} == cs.vote(history, 3)
    assert plan.calibration["steps"] == [1, 3] and plan.calibration["rule"] == "ratio"
    md = (out / "census.md").read_text()
    assert "Voted over optimizer steps 1–3, every step recorded" in md and "rule ratio, τ = 2.0, no gates" in md
    assert "Voted over optimizer steps 1–3" in (out / "report.md").read_text()


def test_run_folder_continues_from_its_checkpoint(data_dir, tmp_path, single_thread):
    from adahop.train import TrainConfig
    from adahop.train.checkpoint import save_checkpoint
    from adahop.train.export import write_config
    from adahop.train.setup import build_optimizer, make_model, make_streams

    run_dir = tmp_path / "runs" / "tiny"
    cfg = TrainConfig(recipe="bf16", model="llama-tiny", data=str(data_dir), seq_len=32, batch_size=4, steps=10,
                      device="cpu", out=str(run_dir))
    train_s, _ = make_streams(cfg, data_dir)
    model = adahop.convert_model(make_model(cfg, train_s.manifest, torch.device("cpu")), "bf16")
    opt = build_optimizer(cfg, model)
    x, y = train_s.batch(0)
    nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()
    opt.step()
    write_config(run_dir, cfg, model, data_dir, adahop.get_recipe("bf16"))
    save_checkpoint(run_dir, 7, model, opt)
    out = tmp_path / "an_run"
    run(_args("--run", str(run_dir), "--steps", "2", "--device", "cpu", "--gain-layers", "2", "--out", str(out)))
    meta = json.loads((out / "analysis.json").read_text())
    assert meta["start_step"] == 7 and meta["checkpoint"].endswith("step_0000007")
    assert meta["config"]["seq_len"] == 32 and meta["recorded_steps"] == [1, 2]
    assert (out / "census.md").exists() and (out / "plan.json").exists()
    # a truncated checkpoint: a clear error naming the file, not safetensors' traceback (helper 38)
    import shutil

    bad_run = tmp_path / "runs" / "truncated"
    shutil.copytree(run_dir, bad_run)
    w = bad_run / "checkpoints" / "step_0000007" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"the checkpoint's weights in .*step_0000007/model.safetensors cannot be read"):
        run(_args("--run", str(bad_run), "--steps", "2", "--device", "cpu", "--out", str(tmp_path / "an_bad")))
    # a training flag beside --run would be ignored (the run's config is used): refused, named
    with pytest.raises(ValueError, match=r"drop --model, --lr"):
        run(_args("--run", str(run_dir), "--steps", "2", "--model", "llama-20m", "--lr", "0.5", "--out", str(out)))
    # the data folder is recorded absolute (a relative one named another folder from another working directory),
    # and a folder under that name holding other data is refused, not analyzed (helper 32)
    section = json.loads((run_dir / "config.json").read_text())
    assert section["adahop"]["data_dir"] == str(Path(data_dir).resolve())
    section["adahop"]["data_identity"]["sources"][0]["sha256"] = "0" * 64  # as if trained on other text
    (run_dir / "config.json").write_text(json.dumps(section))
    with pytest.raises(ValueError, match=rf"--run {run_dir}: {data_dir} is not the data the run trained on \(.*sha256"):
        run(_args("--run", str(run_dir), "--steps", "2", "--device", "cpu", "--out", str(tmp_path / "an2")))


def test_run_folder_continues_with_the_runs_own_lr_schedule(data_dir, tmp_path, single_thread):
    """A run resumed with another --steps keeps its schedule (state.json's schedule_steps), while config.json
    records the new --steps: analyze --run took the lr from config.json's, so its steps were not the ones
    `adahop train --resume` takes (here the final lr at once, against the cosine's 4.5x higher one)."""
    import dataclasses
    import shutil

    from adahop.train import TrainConfig, train
    from adahop.train.metrics import read_metrics

    run_dir = tmp_path / "runs" / "short"
    cfg = TrainConfig(recipe="bf16", model="llama-tiny", data=str(data_dir), seq_len=32, batch_size=4, steps=8,
                      warmup_steps=1, device="cpu", eval_every=0, ckpt_every=4, log_every=1, out=str(run_dir))
    train(cfg)
    shutil.rmtree(run_dir / "checkpoints" / "step_0000008")
    (run_dir / "model.safetensors").unlink()
    train(dataclasses.replace(cfg, resume=True, steps=5))  # keeps the schedule of 8 steps; config.json says 5
    longer = tmp_path / "runs" / "longer"
    shutil.copytree(run_dir, longer)
    cfg_json = longer / "config.json"
    cfg_json.write_text(cfg_json.read_text().replace(str(run_dir), str(longer)))
    train(dataclasses.replace(cfg, out=str(longer), resume=True, steps=7))
    want = {r["step"]: r["loss"] for r in read_metrics(longer / "metrics.jsonl") if "loss" in r}
    out = tmp_path / "an_short"
    run(_args("--run", str(run_dir), "--steps", "2", "--calib-steps", "1", "--device", "cpu", "--gain-layers", "1",
              "--out", str(out)))
    got = [loss for _, loss in json.loads((out / "analysis.json").read_text())["losses"]]
    assert got == [want[6], want[7]]  # step 7's loss follows step 6's update, at the schedule's lr


def test_synthetic_writes_figure3(tmp_path, single_thread):
    pytest.importorskip("adahop.analysis.synthetic")
    out = tmp_path / "syn"
    run(_args("--synthetic", "--out", str(out), "--synthetic-size", "64", "--synthetic-n-out", "4", "--oe-rank", "8",
              "--synthetic-seeds", "0"))
    assert "| RR |" in (out / "figure3_synthetic.md").read_text()
    assert (out / "figure3_synthetic.csv").read_text().startswith("pair,")
    assert _is_png(out / "figure3_synthetic.png")


def test_low_precision_masters_train_as_adahop_train_does_and_a_packed_run_continues(data_dir, tmp_path,
                                                                                     single_thread):
    """--master-weights was ignored (FP32 masters trained, SR of sr-adamw rounding nothing), and a run
    with packed FP8/FP4 masters could not be continued ('checkpoint ... does not fit the model')."""
    from adahop.train import TrainConfig, train
    from adahop.train.metrics import read_metrics

    common = dict(recipe="bf16", model="llama-tiny", data=str(data_dir), seq_len=32, batch_size=4, warmup_steps=1,
                  device="cpu", optimizer="sr-adamw", master_weights="bf16", eval_every=0, log_every=1)
    run_dir = tmp_path / "runs" / "sr"
    train(TrainConfig(steps=3, out=str(run_dir), **common))
    want = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    out = tmp_path / "an_sr"
    run(_args(*TINY, "--data", str(data_dir), "--steps", "3", "--calib-steps", "2", "--gain-layers", "2",
              "--optimizer", "sr-adamw", "--master-weights", "bf16", "--out", str(out)))
    got = [loss for _, loss in json.loads((out / "analysis.json").read_text())["losses"]]
    assert got == want  # the same BF16 masters and stochastic rounding, bit for bit
    packed = tmp_path / "runs" / "fp8"
    train(TrainConfig(steps=2, out=str(packed), **{**common, "optimizer": "adamw", "master_weights": "fp8"}))
    out = tmp_path / "an_fp8"
    run(_args("--run", str(packed), "--steps", "1", "--calib-steps", "1", "--device", "cpu", "--gain-layers", "2",
              "--out", str(out)))
    meta = json.loads((out / "analysis.json").read_text())
    assert meta["start_step"] == 2 and meta["config"]["master_weights"] == "fp8"
    assert 0 < meta["losses"][0][1] < 1.5 * math.log(512)


def test_a_val_split_shorter_than_a_window_is_no_error_for_analyze(tmp_path, single_thread):
    """analyze never validates, yet a val split shorter than --seq-len + 1 tokens stopped it, with advice to
    raise --val-fraction (helper 32)."""
    from adahop.data import Manifest, prepare

    rnd = random.Random(1)
    text = "\n".join(" ".join(rnd.choice("the of and to in a is that for it".split()) for _ in range(12)) for _ in range(600))
    (tmp_path / "c.txt").write_text(text)
    prepare([str(tmp_path / "c.txt")], tmp_path / "prep", tokenizer="bpe", vocab_size=300, val_fraction=0.001)
    assert Manifest.load(tmp_path / "prep").val.tokens < 129  # no window of --seq-len 128 fits in val
    run(_args("--model", "llama-tiny", "--data", str(tmp_path / "prep"), "--seq-len", "128", "--batch-size", "2",
              "--steps", "2", "--calib-steps", "2", "--gain-layers", "1", "--out", str(tmp_path / "an")))
    assert (tmp_path / "an" / "plan.json").exists()
