"""Build the results table and plots of the quality experiment from its run folders.

    python experiments/quality/report.py OUT --docs docs/results

Writes ``table.md`` (with the zero-shot scores of runs that have an eval.json) (recipe, final val loss, gap to BF16 absolute and %, val bits per byte,
tokens/s, peak memory, saved-for-backward bytes; then, for recipes with several seeds, the gap as
mean ± std over seeds), ``loss_curves.png`` and ``loss_diff.png`` (training loss minus BF16's of
the same seed, Figure 1 of the AdaHOP paper) into --docs, and prints the table. Run folders are
``RECIPE-sSEED`` (``-ref``: the reference backend); interrupted runs are left out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from adahop.eval import report as eval_report
from adahop.plots import plot_compare
from adahop.train.metrics import read_metrics


NAME = re.compile(r"^(?P<recipe>.+)-s(?P<seed>\d+)(?P<ref>-ref)?$")


def _recipe(name: str) -> str:
    m = NAME.match(name)
    return m["recipe"] + (m["ref"] or "")


def _seed(name: str) -> str:
    return NAME.match(name)["seed"]


def _mean_std(runs: dict, base: dict) -> list[str]:
    """Per recipe with at least two seeds that have a BF16 run: final val loss and gap % to BF16 of
    the same seed, mean ± sample std over seeds."""
    by: dict[str, list[tuple[float, float]]] = {}
    for n, s in runs.items():
        b = base.get(_seed(n))
        if b:
            by.setdefault(_recipe(n), []).append((s["final_val_loss"], 100 * (s["final_val_loss"] - b) / b))
    rows = {r: v for r, v in by.items() if len(v) >= 2}
    if not rows:
        return []
    out = ["", "| recipe | seeds | final val loss (mean ± std) | gap % to BF16 (mean ± std) |", "|---|---|---|---|"]
    for r, v in sorted(rows.items(), key=lambda kv: statistics.mean(g for _, g in kv[1])):
        loss, gap = [x for x, _ in v], [g for _, g in v]
        out.append(f"| {r} | {len(v)} | {statistics.mean(loss):.4f} ± {statistics.stdev(loss):.4f} | "
                   f"{statistics.mean(gap):+.2f} ± {statistics.stdev(gap):.2f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--docs", default="docs/results")
    args = ap.parse_args()
    out, docs = Path(args.out), Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    runs = {p.name: json.loads((p / "summary.json").read_text()) for p in sorted(out.iterdir())
            if (p / "summary.json").exists() and NAME.match(p.name)}
    runs = {n: s for n, s in runs.items() if not s.get("interrupted") and s.get("final_val_loss") is not None}
    # each run is compared with the BF16 run of the same seed (same initialization and data order)
    base = {_seed(n): s["final_val_loss"] for n, s in runs.items() if _recipe(n) == "bf16"}
    lines = ["| recipe | seed | final val loss | gap to BF16 (same seed) | gap % | val bits/byte | tokens/s | peak memory GiB | "
             "saved for bwd MiB (plain linear) |", "|---|---|---|---|---|---|---|---|---|"]
    order = sorted(runs, key=lambda n: (runs[n]["final_val_loss"] - base.get(_seed(n), float("nan")), n))
    for name in order:
        s = runs[name]
        recipe, seed = _recipe(name), _seed(name)
        vl, b = s["final_val_loss"], base.get(seed)
        gap, pct = (vl - b, 100 * (vl - b) / b) if b else (float("nan"), float("nan"))
        lines.append(f"| {recipe} | {seed} | {vl:.4f} | {gap:+.4f} | {pct:+.2f} | {s['final_val_bpb']:.4f} | "
                     f"{s['tok_per_s']:,.0f} | {s['peak_memory_bytes'] / 2**30:.1f} | "
                     f"{s['saved_bytes'] / 2**20:,.0f} ({s['saved_bytes_bf16'] / 2**20:,.0f}) |")
    if len(base) > 1:  # the noise floor: the same recipe, another seed
        v = sorted(base.values())
        lines.append(f"\nBF16 across seeds: {', '.join(f'{x:.4f}' for x in base.values())} (spread {v[-1] - v[0]:.4f}, "
                     f"{100 * (v[-1] - v[0]) / v[0]:.2f}%).")
    lines += _mean_std(runs, base)
    scored = {n: json.loads((out / n / "eval.json").read_text()) for n in order if (out / n / "eval.json").exists()}
    if scored:  # zero-shot scores of the runs that have them (`run.py --eval-tasks`), chance last
        header, rows = eval_report.table_rows(scored)
        lines += ["", f"Zero-shot ({len(scored)} of {len(runs)} runs scored; accuracy %, ± the standard error):", "",
                  eval_report.markdown(header, rows)]
    table = "\n".join(lines)
    (docs / "table.md").write_text(table + "\n")
    curves = {name: read_metrics(out / name / "metrics.jsonl") for name in runs}
    pairs = {name: f"bf16-s{_seed(name)}" for name in runs}
    plot_compare(curves, docs, baseline=pairs, title="llama-60m on the main corpus: training loss")
    print(table)


if __name__ == "__main__":
    main()
