"""Counting blocks the row exponent-range limit raises (issue 19, item 5)."""

import torch

from adahop.analysis.scale_range import range_hits, range_hits_on_captures, range_markdown
from adahop.formats import quantize_mxfp4


def _massive_token_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=g)
    x[3, 5] = 1e4  # one token with one massive activation
    x[9, 200] = -3e4
    return x


def test_hits_are_exactly_the_blocks_whose_scale_the_limit_changes():
    x = _massive_token_rows()
    r = range_hits(x, 1, iht=False)
    limited = quantize_mxfp4(x, axis=1, scale_rule="adahop", max_scale_range=8).scales
    free = quantize_mxfp4(x, axis=1, scale_rule="adahop", max_scale_range=None).scales
    changed = limited != free
    assert r.blocks_hit == int(changed.sum()) > 0
    assert r.rows_hit == int(changed.any(dim=-1).sum()) == 2  # the two massive tokens, nothing else
    assert r.rows == 16 and r.blocks == 16 * 8 and r.max_gap > 8
    # along the other axis (B's columns) the same tensor transposed counts the same
    assert range_hits(x.t(), 0, iht=False) == r


def test_no_hits_on_gaussian_operands_and_iht_spreads_the_outlier_but_keeps_the_hit():
    g = torch.Generator().manual_seed(1)
    assert range_hits(torch.randn(64, 512, generator=g), 1).rows_hit == 0
    x = _massive_token_rows()
    r = range_hits(x, 1, iht=True)
    assert r.rows_hit == 2 and r.max_gap < range_hits(x, 1, iht=False).max_gap  # 1/sqrt(32) of the spike


def test_on_captures_counts_both_operands_of_three_gemms():
    g = torch.Generator().manual_seed(2)
    cap = {"l0": {"x": _massive_token_rows()[:, :64], "w": torch.randn(32, 64, generator=g),
                  "dy": torch.randn(16, 32, generator=g)}}
    rows = range_hits_on_captures(cap)
    assert [r.name for r in rows] == ["l0/fprop/A", "l0/fprop/B", "l0/dgrad/A", "l0/dgrad/B", "l0/wgrad/A", "l0/wgrad/B"]
    assert rows[0].rows_hit == 1  # fprop A = X: the massive token left in the first 64 channels
    text = range_markdown(rows)
    assert "| l0/fprop/A | 1 / 16" in text and text.splitlines()[-1].startswith("| all |")
