"""Patterns: the detector on synthetic tensors, orientation flips and GEMM pairs, the strategy
tables, the calibration vote, plan JSON, and a resumed run that skips calibration
(`specs/adahop.md` §1, §2, §5)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import adahop
from adahop.analysis.synthetic import LOWP_STRATEGIES, PAIRS, figure3_table
from adahop.patterns import (STRATEGY_TABLES, Calibrator, Pattern, Plan, detect_pattern, gemm_pairs, pattern_stats,
                             strategy_for)

R, C, N = Pattern.ROW, Pattern.COLUMN, Pattern.NONE
SEEDS = range(40)
SHAPES = [(256, 512), (1024, 128), (4096, 256)]



def _planted(shape, pattern: Pattern, seed: int) -> torch.Tensor:
    """i.i.d. N(0,1) with 1–5% of the rows (ROW) or columns (COLUMN) scaled by 10–50."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g)
    frac = 0.01 + 0.04 * torch.rand((), generator=g).item()
    scale = 10.0 + 40.0 * torch.rand((), generator=g).item()
    axis = 0 if pattern is R else 1
    n = max(1, round(frac * shape[axis]))
    idx = torch.randperm(shape[axis], generator=g)[:n]
    if pattern is R:
        t[idx] *= scale
    else:
        t[:, idx] *= scale
    return t


# ---- detector -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pattern", [R, C], ids=str)
def test_detects_planted_rows_and_columns(shape, pattern):
    hits = sum(detect_pattern(_planted(shape, pattern, seed)) is pattern for seed in SEEDS)
    assert hits >= 0.95 * len(SEEDS), f"{pattern} detected in {hits}/{len(SEEDS)} seeds on {shape}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pure_noise_is_none(shape):
    found = [detect_pattern(torch.randn(shape, generator=torch.Generator().manual_seed(s))) for s in SEEDS]
    # the requirement is >= 95%; for this fixed seed set it holds every time
    assert found == [N] * len(SEEDS), [str(p) for p in found]


def test_noise_statistics_are_about_one(gen):
    cv_row, cv_col = pattern_stats(torch.randn(2048, 512, generator=gen))
    assert 0.7 < cv_row < 1.3 and 0.7 < cv_col < 1.3, (cv_row, cv_col)


def test_detector_reads_storage_layout():
    t = _planted((512, 256), R, seed=0)
    assert detect_pattern(t) is R
    assert detect_pattern(t.t()) is C  # the transposed view is column-wise
    assert detect_pattern(t.reshape(4, 128, 256)) is R  # leading dims fold into rows
    with pytest.raises(ValueError, match="at least 2 dims"):
        detect_pattern(torch.randn(8))


# ---- patterns, flips, pairs -----------------------------------------------------------------


def test_str_flip_parse():
    assert [str(p) for p in (R, C, N)] == ["R", "C", "N"]
    assert (R.flipped(), C.flipped(), N.flipped()) == (C, R, N)
    for word, p in [("row", R), ("R", R), ("col", C), ("column", C), ("none", N), ("n", N), (C, C)]:
        assert Pattern.parse(word) is p
    with pytest.raises(ValueError, match="unknown pattern"):
        Pattern.parse("diagonal")


def test_gemm_pairs_orientation():
    # the ALTO unit test example: x=row and w=col give the forward pair row-row
    assert gemm_pairs(R, C, N)["fprop"] == "RR"
    # fprop (x, flip w); dgrad (dy, w); wgrad (flip dy, x)
    assert gemm_pairs(x=C, w=N, dy=R) == {"fprop": "CN", "dgrad": "RN", "wgrad": "CC"}
    assert gemm_pairs(x=N, w=R, dy=C) == {"fprop": "NC", "dgrad": "CR", "wgrad": "RN"}


# ---- strategy tables ------------------------------------------------------------------------


def test_strategy_tables_exact():
    assert STRATEGY_TABLES["lv2"] == {
        "RR": "iht", "RN": "iht+oe_left", "RC": "iht+oe_right",
        "CR": "iht", "CN": "iht", "CC": "bf16",
        "NR": "iht", "NN": "iht", "NC": "iht+oe_right",
    }  # fmt: skip
    diff = {p for p in STRATEGY_TABLES["lv2"] if STRATEGY_TABLES["lv1"][p] != STRATEGY_TABLES["lv2"][p]}
    assert diff == {"CC"} and STRATEGY_TABLES["lv1"]["CC"] == "iht+oe_right"
    assert set(STRATEGY_TABLES) == {"lv1", "lv2"}


def test_strategy_for_wgrad_oe_left_falls_back_to_iht():
    assert strategy_for("fprop", "RN") == strategy_for("dgrad", "RN") == "iht+oe_left"
    assert strategy_for("wgrad", "RN") == "iht"
    assert strategy_for("wgrad", "NC") == "iht+oe_right"
    assert strategy_for("wgrad", "CC", "lv2") == "bf16"
    assert strategy_for("fprop", "XY") == "none"  # unknown pair: plain MX
    with pytest.raises(ValueError, match="unknown strategy table"):
        strategy_for("fprop", "RR", "lv3")


# ---- calibration vote -----------------------------------------------------------------------


def test_calibrator_majority_tie_and_missing():
    row, col, noise = _planted((256, 128), R, 1), _planted((256, 128), C, 2), torch.randn(256, 128)
    cal = Calibrator(table="lv2")
    for t in (col, row, col):  # majority C
        cal.observe("a", "x", t)
    for t in (row, col, col, row):  # tie 2-2: the pattern seen first wins
        cal.observe("a", "w", t)
    cal.observe("b", "x", noise)  # "b" never shows w or dy: they count as N
    assert cal.history["a"]["w"] == ["R", "C", "C", "R"]
    assert cal.vote() == {"a": {"x": "C", "w": "R", "dy": "N"}, "b": {"x": "N", "w": "N", "dy": "N"}}
    plan = cal.freeze(["a", "b", "never_seen"])
    # a: x=C, w=R, dy=N -> fprop (C, flip R)=CC, dgrad (N, R)=NR, wgrad (flip N, C)=NC
    assert {g: plan.layers["a"][f"{g}_pair"] for g in ("fprop", "dgrad", "wgrad")} == \
        {"fprop": "CC", "dgrad": "NR", "wgrad": "NC"}
    assert [plan.strategy("a", g) for g in ("fprop", "dgrad", "wgrad")] == ["bf16", "iht", "iht+oe_right"]
    assert plan.layers["never_seen"]["x"] == "N" and plan.strategy("never_seen", "fprop") == "iht"
    assert Calibrator(table="lv1").freeze(["a"]).table == "lv1"
    with pytest.raises(ValueError, match="unknown strategy table"):
        Calibrator(table="lv9")


# ---- plan JSON ------------------------------------------------------------------------------


def _plan() -> Plan:
    return Plan.from_patterns({"0": {"x": "C", "w": "N", "dy": "R"}, "2": {"x": "N", "w": "C", "dy": "N"}}, "lv2")


def test_plan_json_round_trip(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.table == plan.table and back.layers == plan.layers
    assert Plan.from_json(plan.to_json()).layers == plan.layers
    assert back.strategy("0", "dgrad") == "iht+oe_left"  # dy=R, w=N -> RN
    with pytest.raises(KeyError, match="no strategy for layer"):
        back.strategy("missing", "fprop")


def test_plan_from_json_rejects_bad_input():
    d = json.loads(_plan().to_json())
    d["layers"]["0"]["wgrad"] = "fp8"
    with pytest.raises(ValueError, match="'0'.*wgrad='fp8'"):
        Plan.from_json(json.dumps(d))
    del d["layers"]["0"]["wgrad"]
    with pytest.raises(ValueError, match="wgrad=None"):
        Plan.from_json(json.dumps(d))
    with pytest.raises(ValueError, match="not an adahop plan"):
        Plan.from_json(json.dumps({"layers": {}}))


# ---- a resumed run skips calibration --------------------------------------------------------


def test_resumed_run_uses_plan_without_calibrating(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    plan = Plan.from_json(_plan().to_json())
    adahop.convert_model(model, "adahop-lv2", plan=plan)
    observed = []
    monkeypatch.setattr(adahop.LowPrecisionLinear, "observe", lambda self, name, t: observed.append((self.name, name)))

    text = adahop.describe(model)
    assert "step 0, plan frozen" in text.splitlines()[0]
    for name, layer in (("0", model[0]), ("2", model[2])):
        assert layer.strategies() == {g: plan.strategy(name, g) for g in ("fprop", "dgrad", "wgrad")}
        assert layer.patterns == {k: plan.layers[name][k] for k in ("x", "w", "dy")}
    # x=C, w=N, dy=R: fprop CN -> iht, dgrad RN -> iht+oe_left, wgrad CC -> bf16
    assert model[0].strategies() == {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "bf16"}
    assert adahop.get_controller(model).calibrator is None

    x = torch.randn(128, 64, requires_grad=True)
    model(x).square().sum().backward()
    assert observed == []  # no BF16 calibration GEMM ran (they are the only callers of observe)
    assert adahop.on_step(model, 30) is False  # nothing left to freeze
    assert adahop.get_controller(model).plan is plan


# ---- the Lv2 table against measurement (synthetic Figure 3, docs/figure3_synthetic.md) -------

# 512³ with k = 16 keeps k/M = 1/32, the ratio of the main harness (M = N = 2048, K = 512, k = 64)
# at 1/16 of the cost; with k = 64 at 512³ OE would route 1/8 of every matrix through BF16 and
# beat IHT by ~10% on every pair for that reason alone (see the doc's "Choices" section).
FIG3 = dict(m=512, k=512, n=512, n_out=16, scale=10.0, seeds=(0, 1, 2), oe_rank=16)
RR_XFAIL = pytest.mark.xfail(strict=True, reason=(
    "Lv2 assigns IHT to RR, but OE-Left+IHT is ~2.1x better here (IHT 0.152 vs OE-L+IHT 0.073; 1.35x at "
    "M=N=2048, k=64): A's outlier rows dominate the output and OE+IHT <= IHT always. Reported to the lead; "
    "see docs/figure3_synthetic.md"))


@pytest.fixture(scope="module")
def fig3():
    return {r.pair: r for r in figure3_table(**FIG3, strategies=LOWP_STRATEGIES)}


@pytest.mark.parametrize("pair", [pytest.param(p, marks=RR_XFAIL) if p == "RR" else p for p in PAIRS])
def test_lv2_choice_within_10pct_of_best(pair, fig3):
    row = fig3[pair]
    s = row.assigned("lv2")
    assert row.within(s, 0.10), (f"{pair}: lv2 {s} error {row.error(s):.4f} is {row.ratio(s):.3f}x the best "
                                 f"({row.best} {row.errors[row.best]:.4f}); all: {row.errors}")


def test_lv1_cc_choice_within_10pct_of_best(fig3):
    assert fig3["CC"].assigned("lv1") == "iht+oe_right" and fig3["CC"].within("iht+oe_right", 0.10), fig3["CC"].errors


def test_fig3_directions(fig3):
    """IHT helps inner-dimension outliers; OE helps outer ones; OE+IHT never loses to IHT."""
    e = {p: r.errors for p, r in fig3.items()}
    for p in ("CN", "NR", "CR"):
        assert e[p]["iht"] < 0.9 * e[p]["none"], (p, e[p])
    assert e["RN"]["iht+oe_left"] < 0.6 * e["RN"]["iht"], e["RN"]
    assert e["NC"]["iht+oe_right"] < 0.6 * e["NC"]["iht"], e["NC"]
    for p in PAIRS:
        assert e[p]["iht+oe_left"] <= e[p]["iht"] and e[p]["iht+oe_right"] <= e[p]["iht"], (p, e[p])


def test_fig3_x50_cr_is_bad_for_every_strategy():
    (row,) = figure3_table(**{**FIG3, "scale": 50.0, "seeds": (0,)}, pairs=("CR",), strategies=LOWP_STRATEGIES)
    assert min(row.errors.values()) > 0.5, row.errors
