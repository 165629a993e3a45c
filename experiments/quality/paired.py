"""Paired validation-loss differences of two arms, seed by seed, at every evaluation step both reached.

    python experiments/quality/paired.py ARM BASE --seeds 0,1,2

``ARM`` and ``BASE`` are run-folder paths with ``{seed}`` in them (e.g.
``docs/results/runs/q20m/adahop-lv2@msr-none-s{seed}``). Runs of one seed share their initialization
and data order, so ARM − BASE at one step is far less noisy than a gap between seed means. Interrupted
runs count up to their last evaluation. Prints a markdown table: step, ARM − BASE per seed, mean ± std
over the seeds present.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from adahop.train.metrics import read_metrics


def val_losses(run: Path) -> dict[int, float]:
    """``{step: val_loss}`` of ``run/metrics.jsonl`` (empty if there is none)."""
    return {r["step"]: r["val_loss"] for r in read_metrics(Path(run) / "metrics.jsonl") if "val_loss" in r}


def paired_rows(arm: str, base: str, seeds: list[int]) -> list[str]:
    """Markdown rows of ARM − BASE; raises ValueError when a pattern lacks ``{seed}``."""
    if "{seed}" not in arm or "{seed}" not in base:
        raise ValueError("ARM and BASE must contain '{seed}', e.g. runs/q/mxfp4-s{seed}")
    a = {s: val_losses(Path(arm.format(seed=s))) for s in seeds}
    b = {s: val_losses(Path(base.format(seed=s))) for s in seeds}
    rows = ["| step | " + " | ".join(f"s{s}" for s in seeds) + " | mean ± std |", "|---" * (len(seeds) + 2) + "|"]
    for step in sorted({st for s in seeds for st in a[s] if st in b[s]}):
        d = {s: a[s][step] - b[s][step] for s in seeds if step in a[s] and step in b[s]}
        mean = statistics.mean(d.values())
        spread = f"{mean:+.4f} ± {statistics.stdev(d.values()):.4f}" if len(d) > 1 else f"{mean:+.4f}"
        cells = " | ".join(f"{d[s]:+.4f}" if s in d else "—" for s in seeds)
        rows.append(f"| {step} | {cells} | {spread} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arm")
    ap.add_argument("base")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    args = ap.parse_args()
    print("\n".join(paired_rows(args.arm, args.base, [int(s) for s in args.seeds.split(",")])))


if __name__ == "__main__":
    main()
