"""Text outputs of `adahop analyze`: the census (markdown and CSV, the paper's Table 1 layout),
per-tensor patterns and stability, per-step records, the IHT gain table, and ``report.md``."""

from __future__ import annotations

import csv
import io
import math

from ..patterns import STRATEGY_TABLES, Pattern, gemm_pairs, strategy_for
from .census import GAIN_STRATEGIES, PAIRS, PATHS, TENSOR_LABELS, TENSORS, Census, GainRow

__all__ = ["census_markdown", "census_csv", "patterns_csv", "records_csv", "gain_csv", "gain_markdown", "report_markdown"]

_COLUMNS = ("fprop", "dgrad", "wgrad", "total")
_LABELS = {"none": "MXFP4", "iht": "IHT", "iht+oe_left": "OE-L+IHT", "iht+oe_right": "OE-R+IHT", "bf16": "BF16"}


def _csv(rows: list[list]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def _census_table(c: Census, table: str) -> list[str]:
    head = ["pair (A,B)", *_COLUMNS, f"{table} strategy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in PAIRS:
        cells = [f"{c.counts[col][p]} ({100 * c.share(col, p):.1f}%)" for col in _COLUMNS]
        strategy = STRATEGY_TABLES[table][p]
        if strategy_for("wgrad", p, table) != strategy:  # wgrad's OE-Left runs as IHT (specs/adahop.md §4)
            strategy += f" (wgrad: {strategy_for('wgrad', p, table)})"
        lines.append(f"| **{p}** | " + " | ".join(cells) + f" | {strategy} |")
    lines.append("| all | " + " | ".join(str(sum(c.counts[col].values())) for col in _COLUMNS) + " | |")
    per_path = [f"{path}: {', '.join(p for p in PAIRS if c.counts[path][p] == 0) or '—'}" for path in PATHS]
    lines += ["", "Pairs that never occur: " + (", ".join(c.never) if c.never else "none (all nine occur)") + ".",
              "", "Absent per path — " + "; ".join(per_path) + ".", ""]
    return lines


def census_markdown(c: Census, *, table: str = "lv2", title: str = "", window: str = "") -> str:
    """Table 1 layout: rows = the nine pairs, columns = fprop / dgrad / wgrad / total as
    ``count (share %)``, plus the strategy ``table`` assigns; then the pairs that never occur.
    ``window`` (a sentence: which steps were voted over, with which detector) follows the intro."""
    lines = [f"# {title or 'Outlier-pattern pair census'}", "",
             f"{c.layers} layers × 3 GEMMs. Each cell: number of GEMMs whose voted (A, B) pair is the row's pair, "
             "and its share of the column (pairs in the orientation each GEMM consumes its operands, "
             "`specs/adahop.md` §1).", ""]
    if window:
        lines += [window, ""]
    return "\n".join(lines + _census_table(c, table))


def census_csv(c: Census) -> str:
    """``pair, fprop, fprop_pct, dgrad, dgrad_pct, wgrad, wgrad_pct, total, total_pct``."""
    rows = [["pair", *(f"{col}{suf}" for col in _COLUMNS for suf in ("", "_pct"))]]
    for p in PAIRS:
        rows.append([p, *(v for col in _COLUMNS for v in (c.counts[col][p], f"{100 * c.share(col, p):.2f}"))])
    return _csv(rows)


def patterns_csv(voted: dict[str, dict[str, str]], stab: dict[str, dict[str, float]], plan_layers: dict[str, dict]) -> str:
    """Per layer: voted X/W/∇Y patterns, their stability, the three pairs and strategies."""
    rows = [["layer", "x", "w", "dy", "x_stability", "w_stability", "dy_stability",
             "fprop_pair", "dgrad_pair", "wgrad_pair", "fprop", "dgrad", "wgrad"]]
    for layer, v in voted.items():
        e = plan_layers[layer]
        rows.append([layer, v["x"], v["w"], v["dy"], *(f"{stab[layer][t]:.3f}" for t in TENSORS),
                     *(e[f"{g}_pair"] for g in PATHS), *(e[g] for g in PATHS)])
    return _csv(rows)


def records_csv(records) -> str:
    """Every classified tensor: ``step, layer, tensor, pattern, cv_row, cv_col, row_peak, col_peak``
    (the statistics every rule and gate of :func:`adahop.patterns.classify` reads)."""
    rows = [["step", "layer", "tensor", "pattern", "cv_row", "cv_col", "row_peak", "col_peak"]]
    rows += [[r.step, r.layer, r.tensor, r.pattern, f"{r.cv_row:.4f}", f"{r.cv_col:.4f}", f"{r.row_peak:.4f}",
              f"{r.col_peak:.4f}"] for r in records]
    return _csv(rows)


def gain_csv(rows: list[GainRow], table: str = "lv2") -> str:
    """One line per real GEMM: shape, pair, error of each strategy, reductions vs plain MXFP4."""
    out = [["layer", "path", "pair", "m", "kc", "n", "oe_left_rank", "oe_right_rank",
            *(f"err_{s}" for s in GAIN_STRATEGIES), *(f"reduction_{s}" for s in GAIN_STRATEGIES[1:]), f"{table}_strategy"]]
    for r in rows:
        out.append([r.layer, r.path, r.pair, r.m, r.kc, r.n, r.oe_left_rank, r.oe_right_rank,
                    *(f"{r.errors[s]:.6g}" for s in GAIN_STRATEGIES), *(f"{r.reduction(s):.4f}" for s in GAIN_STRATEGIES[1:]),
                    strategy_for(r.path, r.pair, table)])
    return _csv(out)


def gain_markdown(by_pair: dict[str, dict], table: str = "lv2") -> str:
    """Per pair: GEMM count, mean error of plain MXFP4, mean reduction of each strategy (best in
    bold), and the mean reduction of the strategy the table assigns."""
    strategies = GAIN_STRATEGIES[1:]
    head = ["pair", "GEMMs", "MXFP4 error", *(f"{_LABELS[s]} reduction" for s in strategies), f"{table} choice reduction"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, d in by_pair.items():
        best = max(strategies, key=lambda s: d["reduction"][s])
        cells = [f"**{100 * d['reduction'][s]:.1f}%**" if s == best else f"{100 * d['reduction'][s]:.1f}%" for s in strategies]
        lines.append(f"| {p} | {d['n']} | {d['error']['none']:.4f} | " + " | ".join(cells) + f" | {100 * d['assigned']:.1f}% |")
    return "\n".join(lines) + "\n"


def _pct(v: float) -> str:
    return "n/a" if v != v or math.isinf(v) else f"{100 * v:.1f}%"


def report_markdown(*, info: dict, census_: Census, voted: dict[str, dict[str, str]], stab: dict[str, dict[str, float]],
                    mean_stab: dict[str, float], gain_by_pair: dict[str, dict] | None, figures: dict[str, str],
                    table: str = "lv2") -> str:
    """``report.md``: what was run, links to every output, the census, stability per tensor and
    its summary, and the IHT gain per pair.

    Args:
        info: ``{"title": ..., "lines": [bullet strings]}`` describing the run.
        figures: ``{description: relative file name}`` of the written figures.
    """
    L = [f"# {info.get('title', 'adahop analyze')}", ""]
    L += [f"- {line}" for line in info.get("lines", [])]
    L += ["", "## Files", ""]
    L += [f"- [{desc}]({name})" for desc, name in figures.items()]
    L += ["", "## Census (voted pattern pairs per GEMM path)", ""]
    L += _census_table(census_, table)
    L += ["## Pattern stability", "",
          "Stability of a tensor = share of the steps of the patterns-over-steps figure (--record-every) whose "
          "detected pattern equals its voted pattern (the vote over the window that built plan.json).", "",
          "| tensor | mean stability | voted R / C / N (layers) |", "|---|---|---|"]
    for t in TENSORS:
        n = {p: sum(v[t] == p for v in voted.values()) for p in "RCN"}
        L.append(f"| {TENSOR_LABELS[t]} | {_pct(mean_stab[t])} | {n['R']} / {n['C']} / {n['N']} |")
    L += ["", "| layer | X | W | ∇Y | pairs fprop / dgrad / wgrad |", "|---|---|---|---|---|"]
    for layer, v in voted.items():
        pairs = gemm_pairs(*(Pattern.parse(v[t]) for t in TENSORS))
        cells = [f"{v[t]} ({_pct(stab[layer][t])})" for t in TENSORS]
        L.append(f"| {layer} | " + " | ".join(cells) + f" | {pairs['fprop']} / {pairs['dgrad']} / {pairs['wgrad']} |")
    if gain_by_pair:
        L += ["", "## IHT / OE error reduction on real operands", "",
              "Relative GEMM error ‖Ĉ − AB‖_F / ‖AB‖_F of plain MXFP4, and the mean reduction of each strategy "
              "against it, over the captured GEMMs of each pair (pair = the patterns at the captured step).", ""]
        L.append(gain_markdown(gain_by_pair, table))
    return "\n".join(L) + "\n"
