"""The figures of `adahop analyze` (matplotlib, headless Agg backend).

- :func:`plot_patterns_over_steps`: one row per tensor (layer × X/W/∇Y), one column per recorded
  step, coloured by pattern (the paper's Figures 4 and 8).
- :func:`plot_patterns_by_depth`: share of R/C/N per block index for X, W, ∇Y.
- :func:`plot_iht_gain`: error reduction of IHT and IHT+OE against plain MXFP4 per pair, on
  real operands (Figure 3, right); :func:`plot_synthetic`: errors on synthetic operands (left).
- :func:`plot_tensor_3d`: 3-D magnitude surfaces (Figure 2).
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .census import PAIRS, TENSOR_LABELS, TENSORS, block_index  # noqa: E402

__all__ = ["PATTERN_COLORS", "short_name", "downsample_abs", "plot_patterns_over_steps", "plot_patterns_by_depth",
           "plot_iht_gain", "plot_synthetic", "plot_tensor_3d"]

#: Row-wise red, column-wise blue, none light grey.
PATTERN_COLORS = {"R": "#d62728", "C": "#1f77b4", "N": "#dddddd"}
_PATTERN_NAMES = {"R": "Row-wise (R)", "C": "Column-wise (C)", "N": "None (N)"}
_STRAT_LABELS = {"none": "MXFP4", "iht": "IHT", "iht+oe_left": "OE-L+IHT", "iht+oe_right": "OE-R+IHT", "bf16": "BF16"}
_STRAT_COLORS = {"none": "#7f7f7f", "iht": "#2ca02c", "iht+oe_left": "#ff7f0e", "iht+oe_right": "#9467bd"}


def short_name(layer: str) -> str:
    """``model.layers.3.self_attn.q_proj`` → ``L3.self_attn.q_proj`` (axis labels)."""
    return re.sub(r"^(?:.*\.)?(?:layers|h|blocks|layer)\.(\d+)\.", r"L\1.", layer)


def _save(fig, path: Path, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def _pattern_legend(ax, **kw) -> None:
    ax.legend(handles=[Patch(facecolor=PATTERN_COLORS[p], edgecolor="k", lw=0.5, label=_PATTERN_NAMES[p]) for p in "RCN"],
              **kw)


def plot_patterns_over_steps(steps: list[int], history: dict[str, dict[str, list[str]]], path: Path, *,
                             calib_steps: int | None = None, title: str = "") -> Path:
    """Pattern map: rows = layer × (X, W, ∇Y), columns = recorded steps, colour = pattern.

    Args:
        steps: recorded step numbers (column labels). history: ``{layer: {tensor: [pattern per step]}}``.
        calib_steps: the last optimizer step of the vote window; a line is drawn after the last
            column at or before it.
    """
    rows, labels = [], []
    code = {"R": 0, "C": 1, "N": 2}
    for layer, ts in history.items():
        for t in TENSORS:
            seq = ts.get(t, [])
            rows.append([code.get(p, 2) for p in seq] + [2] * (len(steps) - len(seq)))
            labels.append(f"{short_name(layer)} · {TENSOR_LABELS[t]}")
    grid = np.array(rows, dtype=float).reshape(len(rows), len(steps))
    height = min(60.0, max(3.5, 0.16 * len(rows) + 1.5))
    width = min(24.0, max(7.0, 0.12 * len(steps) + 4.5))
    fig, ax = plt.subplots(figsize=(width, height))
    ax.imshow(grid, aspect="auto", interpolation="nearest", vmin=0, vmax=2,
              cmap=ListedColormap([PATTERN_COLORS[p] for p in "RCN"]))
    per_row_pt = 72 * (height - 1.5) / max(len(rows), 1)
    ax.set_yticks(range(len(labels)), labels, fontsize=max(4.0, min(8.0, 0.6 * per_row_pt)))
    every = max(1, len(steps) // 20)
    ax.set_xticks(range(0, len(steps), every), [str(steps[i]) for i in range(0, len(steps), every)], fontsize=8)
    for i in range(3, len(rows), 3):  # separate layers
        ax.axhline(i - 0.5, color="white", lw=0.8)
    inside = sum(s <= calib_steps for s in steps) if calib_steps is not None else 0
    if 0 < inside < len(steps):
        ax.axvline(inside - 0.5, color="k", lw=1.2, ls="--")
        ax.text(inside - 0.5, -0.8, f" vote window (steps 1–{calib_steps})", fontsize=8, va="bottom")
    ax.set(xlabel="recorded training step", ylabel="layer · tensor",
           title=title or "Outlier pattern of X, W, ∇Y per layer over training")
    _pattern_legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="pattern")
    return _save(fig, path)


def plot_patterns_by_depth(voted: dict[str, dict[str, str]], path: Path, *, title: str = "") -> Path:
    """Stacked bars: share of layers of each block whose voted X / W / ∇Y pattern is R, C or N."""
    blocks = sorted({b for name in voted if (b := block_index(name)) is not None})
    if not blocks:  # models without numbered blocks: one bar for all layers
        blocks = [None]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    x = np.arange(len(blocks))
    for ax, t in zip(axes, TENSORS):
        bottom = np.zeros(len(blocks))
        for p in "RCN":
            frac = []
            for b in blocks:
                pats = [v[t] for n, v in voted.items() if block_index(n) == b]
                frac.append(sum(q == p for q in pats) / len(pats) if pats else 0.0)
            ax.bar(x, frac, bottom=bottom, color=PATTERN_COLORS[p], edgecolor="k", lw=0.4, label=_PATTERN_NAMES[p])
            bottom += np.array(frac)
        ax.set_xticks(x, ["all" if b is None else str(b) for b in blocks], fontsize=8 if len(blocks) < 20 else 6)
        ax.set(xlabel="block index (depth)", title=f"{TENSOR_LABELS[t]}", ylim=(0, 1))
    axes[0].set_ylabel("share of layers in block")
    _pattern_legend(axes[-1], loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, title="voted pattern")
    fig.suptitle(title or "Voted outlier pattern by depth")
    return _save(fig, path)


def plot_iht_gain(by_pair: dict[str, dict], path: Path, *, rows=None, title: str = "") -> Path:
    """Grouped bars per pair: mean relative error reduction (%) of IHT, OE-L+IHT and OE-R+IHT
    against plain MXFP4, with each GEMM as a dot when ``rows`` (the :class:`GainRow` list) is given.

    Args:
        by_pair: :func:`adahop.analysis.census.gain_by_pair` output.
    """
    strategies = ("iht", "iht+oe_left", "iht+oe_right")
    pairs = [p for p in PAIRS if p in by_pair]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(pairs) + 3), 4.5))
    x = np.arange(len(pairs))
    w = 0.26
    for i, s in enumerate(strategies):
        vals = [100 * by_pair[p]["reduction"][s] for p in pairs]
        ax.bar(x + (i - 1) * w, vals, w, color=_STRAT_COLORS[s], edgecolor="k", lw=0.4, label=_STRAT_LABELS[s])
        if rows is not None:
            for j, p in enumerate(pairs):
                pts = [100 * r.reduction(s) for r in rows if r.pair == p]
                ax.plot(np.full(len(pts), x[j] + (i - 1) * w), pts, "k.", ms=3, alpha=0.6)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, [f"{p}\n(n={by_pair[p]['n']})" for p in pairs])
    ax.set(xlabel="pattern pair (A, B) of the GEMM", ylabel="error reduction vs plain MXFP4 (%)",
           title=title or "IHT / OE error reduction on real GEMM operands")
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if rows is not None:
        handles.append(plt.Line2D([], [], color="k", marker=".", ls="", label="one GEMM"))
        labels.append("one GEMM")
    ax.legend(handles, labels, fontsize=8, loc="best")
    return _save(fig, path)


def plot_synthetic(errors: dict[str, dict[str, float]], assigned: dict[str, str], path: Path, *, title: str = "") -> Path:
    """Grouped bars per pair of the relative GEMM error of each low-precision strategy on
    synthetic operands; a star marks the strategy the table assigns (BF16 = exact, no bar).

    Args:
        errors: ``{pair: {strategy: error}}``. assigned: ``{pair: strategy}`` (e.g. the Lv2 table).
    """
    strategies = [s for s in ("none", "iht", "iht+oe_left", "iht+oe_right") if any(s in e for e in errors.values())]
    pairs = [p for p in PAIRS if p in errors]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(pairs) + 3), 4.5))
    x = np.arange(len(pairs))
    w = 0.8 / len(strategies)
    for i, s in enumerate(strategies):
        off = (i - (len(strategies) - 1) / 2) * w
        vals = [errors[p].get(s, np.nan) for p in pairs]
        ax.bar(x + off, vals, w, color=_STRAT_COLORS[s], edgecolor="k", lw=0.4, label=_STRAT_LABELS[s])
        for j, p in enumerate(pairs):
            if assigned.get(p) == s:
                ax.plot(x[j] + off, vals[j] * 1.04 + 0.002, marker="*", color="k", ms=9)
    for j, p in enumerate(pairs):
        if assigned.get(p) == "bf16":  # exact: no bar to star, so label the group
            top = max(v for s in strategies if (v := errors[p].get(s)) is not None)
            ax.text(x[j], top * 1.04 + 0.002, "★ BF16 (exact)", ha="center", va="bottom", fontsize=7)
    ax.plot([], [], "k*", ms=9, ls="", label="table's choice")
    ax.set_xticks(x, pairs)
    ax.set(xlabel="pattern pair (A, B)", ylabel="relative error ‖Ĉ − AB‖_F / ‖AB‖_F",
           title=title or "Synthetic GEMM error per strategy and pattern pair")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def downsample_abs(t: torch.Tensor, max_size: int = 128) -> np.ndarray:
    """``|t|`` of a 2-D tensor max-pooled to at most ``max_size × max_size`` (outliers survive)."""
    a = t.detach().float().abs()
    if a.ndim != 2:
        a = a.reshape(-1, a.shape[-1])
    h, w = min(a.shape[0], max_size), min(a.shape[1], max_size)
    a = torch.nn.functional.adaptive_max_pool2d(a[None, None], (h, w))[0, 0]
    return a.cpu().numpy()


def plot_tensor_3d(panels: list[tuple[str, torch.Tensor, tuple[str, str]]], path: Path, *, ncols: int = 3,
                   title: str = "", max_size: int = 128) -> Path:
    """3-D magnitude surfaces, one per panel.

    Args:
        panels: ``(title, 2-D tensor, (row-axis label, column-axis label))`` per panel.
        ncols: panels per row. max_size: each surface is max-pooled to at most this many points a side.
    """
    nrows = (len(panels) + ncols - 1) // ncols
    fig = plt.figure(figsize=(5.2 * ncols, 4.6 * nrows))
    for i, (name, t, (row_lbl, col_lbl)) in enumerate(panels):
        z = downsample_abs(t, max_size)
        ax = fig.add_subplot(nrows, ncols, i + 1, projection="3d")
        rr, cc = np.meshgrid(np.linspace(0, t.shape[0], z.shape[0]), np.linspace(0, t.shape[-1], z.shape[1]),
                             indexing="ij")
        ax.plot_surface(cc, rr, z, cmap="viridis", linewidth=0, antialiased=False, rcount=z.shape[0], ccount=z.shape[1])
        ax.set_xlabel(col_lbl, fontsize=8)
        ax.set_ylabel(row_lbl, fontsize=8)
        ax.set_zlabel("|value|", fontsize=8)
        ax.tick_params(labelsize=6)
        ax.set_title(name, fontsize=9)
        ax.view_init(elev=28, azim=-60)
    if title:
        fig.suptitle(title)
    return _save(fig, path, dpi=100)
