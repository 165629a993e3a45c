"""FOID (Fast Outlier Index Detection, issue 18): OE's indices from the first 64 elements along Kc."""

import pytest
import torch

from adahop.analysis.foid import foid_compare, foid_markdown, foid_synthetic
from adahop.gemm import TOPK_CHUNK, TOPK_TWO_PASS, gemm, lowp_matmul, oe_indices, top_indices
from adahop.recipes import GemmSpec, get_recipe
from adahop.recipes.table import gemm_table


def test_oe_indices_exact_is_topk_of_full_norm_and_foid_of_the_prefix():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(40, 200, generator=g)
    t[7, 100:] *= 50  # large only past the prefix: exact finds it, FOID cannot
    t[3, :64] *= 20  # large only inside the prefix
    exact = oe_indices(t, 1, 2)
    assert exact.tolist() == torch.topk(t.norm(dim=1), 2).indices.tolist()
    assert exact[0] == 7
    foid = oe_indices(t, 1, 2, prefix=64)
    assert foid.tolist() == torch.topk(t[:, :64].norm(dim=1), 2).indices.tolist()
    assert foid[0] == 3 and 7 not in foid.tolist()
    # a prefix at least Kc long is the exact rule; columns (kc_axis 0) the same on the transpose
    assert oe_indices(t, 1, 5, prefix=500).tolist() == oe_indices(t, 1, 5).tolist()
    assert oe_indices(t.t(), 0, 5, prefix=64).tolist() == oe_indices(t, 1, 5, prefix=64).tolist()


@pytest.mark.parametrize("n", [TOPK_CHUNK, TOPK_TWO_PASS[0], 16384 + 77, TOPK_TWO_PASS[1], TOPK_TWO_PASS[1] + 1])
@pytest.mark.parametrize("k", [1, 64, 256])
def test_top_indices_in_two_passes_are_topks_indices(n, k):
    """The two-pass top-k (a long vector: OE over 16,384 tokens) picks exactly torch.topk's values, largest first;
    distinct values leave no tie, so the indices are torch.topk's too. 256 is the most a 1,024-long first pass
    keeps; one more goes back to torch.topk."""
    g = torch.Generator().manual_seed(n + k)
    v = torch.randperm(n, generator=g).float()  # distinct
    assert top_indices(v, k).tolist() == torch.topk(v, k).indices.tolist()
    ties = torch.randint(0, 40, (n,), generator=g).float()  # many ties: the values, not the indices, are fixed
    got = top_indices(ties, k)
    assert got.unique().numel() == k and ties[got].tolist() == torch.topk(ties, k).values.tolist()
    if n > TOPK_CHUNK:  # NaN counts as largest, in any slice, as in torch.topk
        v[n - 3] = float("nan")
        assert top_indices(v, k)[0] == n - 3
    assert top_indices(v, min(n, 257)).tolist() == torch.topk(v, min(n, 257)).indices.tolist()
    floor = torch.full((n,), float("-inf"))  # ties at -inf: every index picked is one of v's, none twice
    got = top_indices(floor, k)
    assert got.unique().numel() == k and int(got.max()) < n


def test_top_indices_refuses_what_topk_cannot_take():
    with pytest.raises(ValueError, match="1-D tensor and 1 <= k <= its length"):
        top_indices(torch.zeros(4, 8), 1)
    with pytest.raises(ValueError, match="got shape \\(3000,\\), k=3001"):
        top_indices(torch.zeros(3000), 3001)


def test_oe_takes_float64_operands():
    # vector_norm(dtype=float32) refused a float64 operand, so a float64 model crashed once its plan froze
    g = torch.Generator().manual_seed(1)
    t = torch.randn(40, 200, generator=g, dtype=torch.float64)
    assert oe_indices(t, 1, 5).tolist() == torch.topk(t.norm(dim=1), 5).indices.tolist()
    a, b = torch.randn(32, 64, generator=g, dtype=torch.float64), torch.randn(64, 48, generator=g, dtype=torch.float64)
    for strategy in ("iht+oe_left", "iht+oe_right"):
        c = lowp_matmul(a, b, strategy=strategy)
        assert c.dtype == torch.float64
        torch.testing.assert_close(c, lowp_matmul(a.float(), b.float(), strategy=strategy).double(), rtol=0, atol=1e-4)


def test_oe_indices_rejects_bad_rank():
    with pytest.raises(ValueError, match="must be in"):
        oe_indices(torch.zeros(4, 8), 1, 5)


def test_foid_equals_exact_on_row_and_column_patterns_and_loses_on_tail_outliers():
    rows = foid_synthetic(256, n_out=8, rank=16, seeds=(0,), prefix=64)
    by = {(r.name.split("/")[0], r.strategy): r for r in rows}
    for side in ("iht+oe_left", "iht+oe_right"):
        full, tail = by[("full", side)], by[("tail", side)]
        # whole-length outliers (a Row/Column pattern): FOID keeps all their energy, the same error
        assert full.energy > 0.95
        assert abs(full.err_foid - full.err_exact) < 0.1 * full.err_exact
        # outliers past the prefix: FOID misses them and the error grows
        assert tail.energy < 0.5
        assert tail.err_foid > 1.3 * tail.err_exact
    assert "mean of 6" in foid_markdown(rows)


def test_foid_gemm_through_the_spec_matches_lowp_matmul():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 128, generator=g), torch.randn(128, 48, generator=g)
    a[5] *= 30
    spec = GemmSpec(strategy="iht+oe_left", oe_rank=4, oe_select="foid")
    spec.validate("test")
    y = gemm(a, b, spec)
    ref = lowp_matmul(a, b, strategy="iht+oe_left", oe_rank=4, oe_select="foid", scale_rule="floor")
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    row = foid_compare(a, b, "iht+oe_left", rank=1, scale_rule="floor", max_scale_range=None)
    assert row.overlap == 1.0 and row.err_foid == row.err_exact  # the outlier row is large from its start


def test_foid_variant_and_validation():
    r = get_recipe("adahop-lv2@foid")
    assert {r.gemm(g).oe_select for g in ("fprop", "dgrad", "wgrad")} == {"foid"}
    assert get_recipe("adahop-lv2").fprop.oe_select == "exact"
    assert "FOID first 64" in gemm_table(r)
    with pytest.raises(ValueError, match="oe_select"):
        GemmSpec(strategy="iht+oe_left", oe_select="approx").validate("x")
    with pytest.raises(ValueError, match="FOID applies"):
        foid_compare(torch.zeros(4, 4), torch.zeros(4, 4), "iht")
