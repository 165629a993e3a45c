"""Build the results table and plots of the quality experiment from its run folders.

    python experiments/quality/report.py OUT --docs docs/results

Writes ``table.md`` (recipe, final val loss, gap to BF16 absolute and %, val bits per byte,
tokens/s, peak memory, saved-for-backward bytes), ``loss_curves.png`` and ``loss_diff.png``
(training loss minus BF16's, Figure 1 of the AdaHOP paper) into --docs, and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adahop.plots import plot_compare
from adahop.train.metrics import read_metrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--docs", default="docs/results")
    args = ap.parse_args()
    out, docs = Path(args.out), Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    runs = {p.name: json.loads((p / "summary.json").read_text()) for p in sorted(out.iterdir()) if (p / "summary.json").exists()}
    # each run is compared with the BF16 run of the same seed (same initialization and data order)
    base = {n.rsplit("-s", 1)[1]: s["final_val_loss"] for n, s in runs.items() if n.rsplit("-s", 1)[0] == "bf16"}
    lines = ["| recipe | seed | final val loss | gap to BF16 (same seed) | gap % | val bits/byte | tokens/s | peak memory GiB | "
             "saved for bwd MiB (plain linear) |", "|---|---|---|---|---|---|---|---|---|"]
    order = sorted(runs, key=lambda n: (runs[n]["final_val_loss"] - base.get(n.rsplit("-s", 1)[1], float("nan")), n))
    for name in order:
        s = runs[name]
        recipe, seed = name.rsplit("-s", 1)
        vl, b = s["final_val_loss"], base.get(seed)
        gap, pct = (vl - b, 100 * (vl - b) / b) if b else (float("nan"), float("nan"))
        lines.append(f"| {recipe} | {seed} | {vl:.4f} | {gap:+.4f} | {pct:+.2f} | {s['final_val_bpb']:.4f} | "
                     f"{s['tok_per_s']:,.0f} | {s['peak_memory_bytes'] / 2**30:.1f} | "
                     f"{s['saved_bytes'] / 2**20:,.0f} ({s['saved_bytes_bf16'] / 2**20:,.0f}) |")
    if len(base) > 1:  # the noise floor: the same recipe, another seed
        v = sorted(base.values())
        lines.append(f"\nBF16 across seeds: {', '.join(f'{x:.4f}' for x in base.values())} (spread {v[-1] - v[0]:.4f}, "
                     f"{100 * (v[-1] - v[0]) / v[0]:.2f}%).")
    table = "\n".join(lines)
    (docs / "table.md").write_text(table + "\n")
    curves = {name: read_metrics(out / name / "metrics.jsonl") for name in runs}
    pairs = {name: f"bf16-s{name.rsplit('-s', 1)[1]}" for name in runs}
    plot_compare(curves, docs, baseline=pairs, title="llama-60m on the main corpus: training loss")
    print(table)


if __name__ == "__main__":
    main()
