"""Patterns: the detector on synthetic tensors, orientation flips and GEMM pairs, the strategy
tables, the calibration vote, plan JSON, and a resumed run that skips calibration
(`specs/adahop.md` §1, §2, §5)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import adahop
from adahop.analysis.synthetic import LOWP_STRATEGIES, PAIRS, figure3_table
from adahop.patterns import (STRATEGY_TABLES, Calibrator, Pattern, Plan, classify, detect_pattern, gemm_pairs,
                             pattern_stats, peak_ratios, strategy_for)
from adahop.recipes.spec import CalibSpec

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


@pytest.mark.parametrize("rule", ["ratio", "significance"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pattern", [R, C], ids=str)
def test_detects_planted_rows_and_columns(shape, pattern, rule):
    hits = sum(detect_pattern(_planted(shape, pattern, seed), rule=rule) is pattern for seed in SEEDS)
    assert hits >= 0.95 * len(SEEDS), f"{pattern} detected in {hits}/{len(SEEDS)} seeds on {shape}"


def _smooth(rows: int, cols: int, seed: int, spread: float = 0.1) -> torch.Tensor:
    """N(0,1) times a smooth scale per row and per column, each ~N(1, spread): no outliers, the look
    of a trained weight."""
    g = torch.Generator().manual_seed(seed)
    r = 1 + spread * torch.randn(rows, 1, generator=g)
    c = 1 + spread * torch.randn(1, cols, generator=g)
    return torch.randn(rows, cols, generator=g) * r * c


def test_symmetric_smooth_spread_is_none_under_the_ratio_test():
    found = [detect_pattern(_smooth(512, 512, s)) for s in range(20)]
    assert found == [N] * 20, [str(p) for p in found]
    # both statistics are far above 2 (significant structure), so the old rule calls it R or C
    stats = [pattern_stats(_smooth(512, 512, s)) for s in range(20)]
    assert min(min(st) for st in stats) > 2.0, stats
    old = [detect_pattern(_smooth(512, 512, s), rule="significance") for s in range(20)]
    assert N not in old and {R, C} == set(old), [str(p) for p in old]


def test_column_outliers_over_a_mild_row_spread_are_column():
    for s in range(10):
        t = _smooth(1024, 512, s)
        t[:, torch.randperm(512, generator=torch.Generator().manual_seed(s))[:8]] *= 10
        cv_row, cv_col = pattern_stats(t)
        assert cv_row > 2.0 and cv_col > 10 * cv_row, (cv_row, cv_col)  # the rows are significant too
        assert detect_pattern(t) is C


def test_loud_rows_and_loud_columns_together_are_none_under_the_ratio_test():
    for s in range(10):
        g = torch.Generator().manual_seed(s)
        t = torch.randn(1024, 1024, generator=g)
        t[torch.randperm(1024, generator=g)[:16]] *= 10
        t[:, torch.randperm(1024, generator=g)[:16]] *= 10
        cv_row, cv_col = pattern_stats(t)
        assert min(cv_row, cv_col) > 20, (cv_row, cv_col)
        assert detect_pattern(t) is N
        assert detect_pattern(t, rule="significance") is not N  # the old rule picks whichever is larger


def test_ratio_rule_exact_boundaries_and_degenerate_stats():
    assert classify(2.0 * (1 + 1e-6), 1.0) is R and classify(2.0, 1.0) is N  # strictly greater than τ
    assert classify(1.0, 2.0 * (1 + 1e-6)) is C and classify(1.0, 2.0) is N
    assert classify(3.0, 1.0, threshold=3.5) is N and classify(3.0, 1.0, threshold=2.9) is R
    assert classify(0.0, 0.0) is N  # a constant tensor
    assert classify(1e-3, 0.0) is R  # cv_col == 0: the official guard 1e-8 decides
    assert classify(1e-9, 0.0) is N
    assert classify(float("nan"), 1.0) is N
    assert detect_pattern(torch.ones(64, 64)) is N and detect_pattern(torch.randn(1, 64)) is N
    with pytest.raises(ValueError, match="unknown detector rule 'max'"):
        classify(1.0, 1.0, rule="max")


def test_rms_normalized_input_is_column_without_a_floor_and_the_gates_turn_it_off():
    """The official test has no floor: rows normalized to unit RMS (q/k/v inputs after RMSNorm) have
    cv_row ≈ 0, so pure noise between them reads Column. The optional gates (ours) say None."""
    x = torch.randn(2048, 512, generator=torch.Generator().manual_seed(0))
    x = x / x.square().mean(dim=1, keepdim=True).sqrt()
    cv_row, cv_col = pattern_stats(x)
    assert cv_row < 0.2 and 0.7 < cv_col < 1.3, (cv_row, cv_col)
    assert detect_pattern(x) is C
    assert detect_pattern(x, floor=2.0) is N
    row_peak, col_peak = peak_ratios(x)
    assert 1.0 <= col_peak < 1.3 and row_peak == pytest.approx(1.0, abs=1e-3), (row_peak, col_peak)
    assert detect_pattern(x, min_peak=3.0) is N
    planted = _planted((2048, 512), C, seed=3)
    assert detect_pattern(planted, floor=2.0) is C and detect_pattern(planted, min_peak=3.0) is C
    with pytest.raises(ValueError, match="min_peak needs the peak ratios"):
        classify(0.0, 5.0, min_peak=3.0)


def test_pattern_stats_do_not_depend_on_the_scale_even_where_squares_overflow_fp32():
    """The CVs are scale-free, but a BF16 tensor above ~1e19 overflowed FP32 in its variances: NaN CVs, read as None
    (probe num). Scaled by a power of two first, the CVs are the same to the last bit at any scale."""
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    x[:, 5] *= 100
    x = x.bfloat16()
    ref = pattern_stats(x)
    assert ref[1] > 100 and detect_pattern(x) == Pattern.COLUMN
    for scale in (2.0 ** 70, 2.0 ** -100):  # exact in BF16
        assert pattern_stats(x * scale) == ref, scale
    for scale in (1e18, 1e30, 1e-30):  # BF16 rounds x * scale: the same verdict
        assert detect_pattern(x * scale) == Pattern.COLUMN, scale


def test_a_plan_with_an_unknown_table_is_refused():
    """A hand-edited plan.json naming a table adahop does not have loaded, and the recipe then re-derived every
    layer's strategies from its patterns under its own table, dropping the edits with a warning."""
    plan = {"table": "lv2", "layers": {"l": {"x": "C", "w": "N", "dy": "N", "fprop": "iht", "dgrad": "iht", "wgrad": "iht"}}}
    assert Plan.from_dict(plan).table == "lv2"
    with pytest.raises(ValueError, match=r"plan table 'lv3' is not one of \('lv2', 'lv1', 'iht'\)"):
        Plan.from_dict({**plan, "table": "lv3"})


def test_peak_ratios_values():
    t = torch.ones(4, 8)
    t[1] *= 4  # row 1 RMS 4, the others 1: median of (1, 4, 1, 1) is 1
    assert peak_ratios(t) == (4.0, 1.0)
    assert peak_ratios(torch.zeros(3, 3)) == (1.0, 1.0)
    z = torch.zeros(3, 4)
    z[0, 0] = 1.0
    assert peak_ratios(z) == (math.inf, math.inf)


def test_calib_spec_detector_fields_are_validated():
    assert (CalibSpec().rule, CalibSpec().threshold, CalibSpec().floor, CalibSpec().min_peak) == ("ratio", 2.0, None, None)
    for kw, msg in [({"rule": "max"}, "rule='max'"), ({"threshold": 0.5}, "threshold=0.5 must be >= 1"),
                    ({"floor": 0.0}, "floor=0.0"), ({"min_peak": 0.5}, "min_peak=0.5")]:
        with pytest.raises(ValueError, match=msg):
            CalibSpec(**kw).validate("spec")
    CalibSpec(rule="significance", threshold=0.5).validate("spec")  # τ on a CV may be below 1
    with pytest.raises(ValueError, match="Calibrator: rule='max'"):
        Calibrator(rule="max")


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
    assert set(STRATEGY_TABLES) == {"lv1", "lv2", "iht"}  # "iht": the uniform-IHT control (@bf16-calib)
    assert STRATEGY_TABLES["iht"] == {p: "iht" for p in STRATEGY_TABLES["lv2"]}


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
    with pytest.warns(UserWarning, match=r"froze with 3 of 3 layers observed on fewer than half of its 30 calibration "
                                         r"steps \(e.g. a: x 3, w 4, dy 0\)"):
        plan = cal.freeze(["a", "b", "never_seen"])
    # a: x=C, w=R, dy=N -> fprop (C, flip R)=CC, dgrad (N, R)=NR, wgrad (flip N, C)=NC
    assert {g: plan.layers["a"][f"{g}_pair"] for g in ("fprop", "dgrad", "wgrad")} == \
        {"fprop": "CC", "dgrad": "NR", "wgrad": "NC"}
    assert [plan.strategy("a", g) for g in ("fprop", "dgrad", "wgrad")] == ["bf16", "iht", "iht+oe_right"]
    assert plan.layers["never_seen"]["x"] == "N" and plan.strategy("never_seen", "fprop") == "iht"
    with pytest.warns(UserWarning, match="1 of 1 layers"):
        assert Calibrator(table="lv1").freeze(["a"]).table == "lv1"
    with pytest.raises(ValueError, match="unknown strategy table"):
        Calibrator(table="lv9")


def test_a_calibration_whose_loop_never_calls_on_step_is_warned_about_once():
    """Without on_step an AdaHOP model calibrates forever in BF16; nothing said so."""
    import warnings

    cal, t = Calibrator(steps=2), torch.randn(64, 64)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(Calibrator.REPEATS_WARN + 50):
            for layer in ("a", "b"):
                cal.observe(layer, "x", t, step=0)
    msgs = [str(w.message) for w in got]
    assert len(msgs) == 1 and msgs[0].startswith(f"adahop: layer a has run {Calibrator.REPEATS_WARN} forwards at optimizer step 0")
    quiet = Calibrator(steps=2)  # steps that advance: no warning, and both steps' observations count
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in (0, 1):
            for _ in range(Calibrator.REPEATS_WARN - 1):
                quiet.observe("a", "x", t, step=step)
        for k in ("w", "dy"):
            quiet.observe("a", k, t, step=0), quiet.observe("a", k, t, step=1)
        quiet.freeze(["a"])
    assert len(quiet.history["a"]["x"]) == 2


def test_calibrator_one_observation_per_step():
    row, col = _planted((256, 128), R, 1), _planted((256, 128), C, 2)
    cal = Calibrator()
    assert cal.observe("a", "x", row, step=0) is R
    assert cal.observe("a", "x", col, step=0) is None  # a second micro-batch of step 0: no vote
    assert cal.observe("a", "w", col, step=0) is C  # another tensor of the same step still counts
    assert cal.observe("a", "x", col, step=1) is C
    assert cal.observe("a", "x", torch.empty(0, 128), step=2) is None  # empty: nothing recorded
    assert cal.history == {"a": {"x": ["R", "C"], "w": ["C"]}}
    assert cal.observe("a", "x", row, step=2) is R  # the empty call did not use up step 2


def _calibrating_model(steps: int = 3):
    import dataclasses

    r = adahop.get_recipe("adahop-lv2")
    recipe = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, steps=steps))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64))
    return adahop.convert_model(model, recipe)


def test_calibration_votes_once_per_optimizer_step():
    """Gradient accumulation (two micro-batches), an evaluation call and an empty call inside one
    step add no votes: one observation of X, W and ∇Y per step, from the step's first call."""
    model = _calibrating_model(steps=3)
    cal = adahop.get_controller(model).calibrator
    rows, cols = _planted((256, 128), R, 4), _planted((256, 128), C, 5)
    for step in range(3):
        first, second = (rows, cols) if step < 2 else (cols, rows)
        for x in (first, second):  # two micro-batches
            model(x.clone().requires_grad_()).square().sum().backward()
        with torch.no_grad():
            model(cols)  # evaluation
        model(torch.empty(0, 128, requires_grad=True)).sum().backward()  # no tokens
        assert {k: len(v) for k, v in cal.history["0"].items()} == {"x": step + 1, "w": step + 1, "dy": step + 1}
        frozen = adahop.on_step(model, step + 1)
    assert frozen and cal.history["0"]["x"] == ["R", "R", "C"]  # the first micro-batch of each step
    plan = adahop.get_controller(model).plan
    assert plan.layers["0"]["x"] == "R" and plan.calibration["steps"] == [1, 3]
    assert plan.calibration["rule"] == "ratio" and Plan.from_json(plan.to_json()).calibration == plan.calibration


def test_a_call_without_tokens_records_nothing_not_even_the_weight():
    model = _calibrating_model()
    cal = adahop.get_controller(model).calibrator
    model(torch.empty(2, 0, 128, requires_grad=True)).sum().backward()  # an MoE expert that got no tokens
    assert cal.history == {} and model[0].patterns == {}
    model(torch.randn(64, 128, requires_grad=True)).sum().backward()
    assert set(cal.history["0"]) == {"x", "w", "dy"}


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


def test_wgrad_oe_left_in_a_hand_written_plan_runs_iht_as_the_official_code(recwarn):
    """OE-Left is not supported on wgrad: whatever the plan's source, the GEMM runs plain IHT
    (`specs/adahop.md` §4), with one warning per model."""
    entry = {"x": "C", "w": "N", "dy": "R", "fprop": "iht", "dgrad": "iht"}
    grads = {}
    for wgrad in ("iht+oe_left", "iht"):
        plan = Plan(table="lv2", layers={n: {**entry, "wgrad": wgrad} for n in ("0", "1")})
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        recwarn.clear()
        adahop.convert_model(model, "adahop-lv2", plan=Plan.from_json(plan.to_json()))
        msgs = [str(w.message) for w in recwarn if "runs as 'iht'" in str(w.message)]
        assert len(msgs) == (1 if wgrad == "iht+oe_left" else 0), msgs
        assert [m.strategies()["wgrad"] for m in model] == ["iht", "iht"]
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
        x[:, :4] *= 30  # outlier channels, so OE-Left would change the result
        model(x).square().sum().backward()
        grads[wgrad] = [m.weight.grad for m in model]
    for a, b in zip(grads["iht+oe_left"], grads["iht"]):
        assert torch.equal(a, b)


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


def test_strategy_table_names_are_the_ones_calib_spec_accepts():
    """CalibSpec checks the name against recipes.spec.STRATEGY_TABLE_NAMES (it cannot import patterns)."""
    from adahop.patterns import STRATEGY_TABLES
    from adahop.recipes.spec import OE_STRATEGY_TABLES, STRATEGY_TABLE_NAMES

    assert sorted(STRATEGY_TABLES) == sorted(STRATEGY_TABLE_NAMES)
    # the 'foid' variant's check: the tables where some pattern pair extracts outliers
    assert sorted(OE_STRATEGY_TABLES) == sorted(t for t, tab in STRATEGY_TABLES.items() if any("oe" in s for s in tab.values()))


@pytest.mark.parametrize("kw, what", [(dict(seeds=()), "no seed"), (dict(n_out=0), "--synthetic-n-out 0"),
                                      (dict(scale=float("nan")), "--synthetic-scale nan"),
                                      (dict(m=64, k=64, n=64, oe_rank=64), "--oe-rank 64 with 64×64·64×64")])
def test_figure3_table_refuses_settings_that_make_its_numbers_meaningless(kw, what):
    """At 64³ with OE rank 64 OE sent the whole matrix through BF16 and read 0.0000 in every row; no seed
    divided by zero; a NaN scale gave a NaN table (helper 27)."""
    with pytest.raises(ValueError, match=what):
        figure3_table(**{**FIG3, **kw}, strategies=LOWP_STRATEGIES)


def test_a_hand_written_plan_with_strategies_only_runs_them():
    """Plan.from_dict asks each layer for its three strategies, not its patterns: such a plan converts (it was
    refused as "made for another model", the layer being named in it) and describe shows no patterns."""
    plan = Plan.from_dict({"table": "lv2", "layers": {"0": {"fprop": "iht", "dgrad": "iht+oe_right", "wgrad": "bf16"}}})
    model = nn.Sequential(nn.Linear(64, 64))
    adahop.convert_model(model, "adahop-lv2", plan=plan)
    assert model[0].strategies() == {"fprop": "iht", "dgrad": "iht+oe_right", "wgrad": "bf16"}
    assert model[0].patterns == {}
    row = adahop.describe(model).splitlines()[3].split()
    assert row[:5] == ["0", "64->64", "-", "-", "-"] and row[5:8] == ["iht", "iht+oe_right", "bf16"]


def test_a_non_finite_observation_is_not_a_vote_and_the_step_is_observed_again():
    """An overflowing iteration (one a GradScaler skips, then repeats at the same optimizer step) voted None
    from its NaN statistics and, being the step's first call, kept the repeat's finite tensor out of the vote."""
    cal = Calibrator(steps=1)
    rows = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    rows[:4] *= 30
    bad = rows.clone()
    bad[0, 0] = float("inf")
    with pytest.warns(UserWarning, match="NaN or Inf"):
        assert cal.observe("l", "dy", bad, step=0) is None
    assert cal.observe("l", "dy", rows, step=0) is Pattern.ROW
    assert cal.observe("l", "dy", rows * 0, step=0) is None  # the step is observed now: later calls add nothing
    assert cal.history == {"l": {"dy": ["R"]}} and cal.vote()["l"]["dy"] == "R"
