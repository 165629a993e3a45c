#!/usr/bin/env python
"""Issue 21's experiment: low-precision master weights and optimizers, side by side on one GPU.

    python scripts/run_optim_experiment.py --data DATA_DIR --out OUT [--concurrent 4] [--steps 120]
    python scripts/run_optim_experiment.py --out OUT --report      # table.md + loss_curves.png

Rows (each under the ``bf16`` and ``adahop-lv2`` recipes): FP32-master AdamW (the reference); BF16
AdamW (round to nearest); SR-AdamW; Kahan-AdamW; M+Adam with BF16, FP8 and FP4 masters. Every
row with BF16 masters, and the reference, runs seeds 0 and 1. States are BF16 for every row but the
reference (FP32). The settings are those of the fidelity issue's quality runs (docs/results.md:
llama-60m, 512 × 32 tokens per step, lr 2e-3, 120 steps), so the FP32 rows repeat those runs.

Several small runs share the GPU at once (``--concurrent``; each is far from filling an H200), each
writing ``summary.json`` and ``metrics.jsonl`` into ``OUT/<row>-<recipe>-s<seed>``; a folder that
already has ``summary.json`` is skipped, and a claim file keeps concurrent launchers from running
one job twice, so the launcher can be re-run in pieces. Note: tokens/s and peak memory of runs that
shared the GPU are lower bounds of a run alone (peak memory is per process and so still its own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = dict(model="llama-60m", seq_len=512, batch_size=32, lr=2e-3, warmup_steps=20, min_lr_ratio=0.1,
                weight_decay=0.1, grad_clip=1.0, eval_batches=16, log_every=5, calib_steps=30)
#: row name → adahop train flags
ROWS = {
    "adamw-fp32": dict(optimizer="adamw", master_weights="fp32", optimizer_states="fp32"),
    "adamw-bf16": dict(optimizer="adamw", master_weights="bf16", optimizer_states="bf16"),
    "sr-adamw-bf16": dict(optimizer="sr-adamw", master_weights="bf16", optimizer_states="bf16"),
    "kahan-adamw-bf16": dict(optimizer="kahan-adamw", master_weights="bf16", optimizer_states="bf16"),
    "madam-bf16": dict(optimizer="m+adam", master_weights="bf16", optimizer_states="bf16"),
    "madam-fp8": dict(optimizer="m+adam", master_weights="fp8", optimizer_states="bf16"),
    "madam-fp4": dict(optimizer="m+adam", master_weights="fp4", optimizer_states="bf16"),
}
TWO_SEEDS = ("adamw-fp32", "adamw-bf16", "sr-adamw-bf16", "kahan-adamw-bf16", "madam-bf16")
RECIPES = ("bf16", "adahop-lv2")


def jobs(rows, recipes) -> list[tuple[str, str, int]]:
    out = [(r, rec, 0) for rec in recipes for r in rows]
    out += [(r, rec, 1) for rec in recipes for r in rows if r in TWO_SEEDS]
    return out


def command(row: str, recipe: str, seed: int, data: str, out: Path, steps: int, eval_every: int, extra) -> list[str]:
    flags = {**SETTINGS, **ROWS[row]}
    args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    return [sys.executable, "-m", "adahop", "train", "--recipe", recipe, "--seed", str(seed), "--data", data,
            "--out", str(out), "--steps", str(steps), "--eval-every", str(eval_every), "--ckpt-every", "0",
            "--keep-ckpts", "1", *args, *extra]


def launch(args) -> int:
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    todo = [j for j in jobs(args.rows.split(","), args.recipes.split(","))
            if not (root / f"{j[0]}-{j[1]}-s{j[2]}" / "summary.json").exists()]
    running: list[tuple[subprocess.Popen, str, float]] = []
    t_start = time.time()
    env = {**os.environ, "TQDM_DISABLE": "1"}
    while todo or running:
        while todo and len(running) < args.concurrent:
            row, recipe, seed = todo.pop(0)
            name = f"{row}-{recipe}-s{seed}"
            if args.budget_s is not None and time.time() - t_start > args.budget_s:
                print(f"budget spent: {name} not started", flush=True)
                continue
            try:  # claim the job, so that launchers on several GPUs can share one list
                os.close(os.open(root / f".claim-{name}", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            log = open(root / f"{name}.log", "w")
            cmd = command(row, recipe, seed, args.data, root / name, args.steps, args.eval_every, args.extra)
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), name, time.time()))
            print(f"started {name}", flush=True)
        time.sleep(2)
        for proc, name, t0 in list(running):
            if proc.poll() is not None:
                running.remove((proc, name, t0))
                if proc.returncode != 0:  # a failed run may be retried by the next launch
                    (root / f".claim-{name}").unlink(missing_ok=True)
                print(f"{name}: exit {proc.returncode}, {time.time() - t0:.0f} s", flush=True)
    return 0


def report(args) -> int:
    """table.md (loss gap to FP32-master AdamW under the same recipe, mean over seeds; bytes per
    parameter; peak memory; tokens/s) and loss_curves.png from OUT's run folders."""
    root = Path(args.out)
    runs = {}
    for d in sorted(root.iterdir()):
        if (d / "summary.json").exists():
            runs[d.name] = json.loads((d / "summary.json").read_text())
    lines = ["| row | recipe | seeds | final val loss | gap to FP32 AdamW % | weights+state B/param | peak memory MB | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for recipe in RECIPES:
        def mean(row):
            vals = [s["final_val_loss"] for n, s in runs.items() if n.startswith(f"{row}-{recipe}-s") and s.get("final_val_loss")]
            return (sum(vals) / len(vals), len(vals)) if vals else (None, 0)
        ref, _ = mean("adamw-fp32")
        for row in ROWS:
            vl, n = mean(row)
            if not n:
                continue
            s = runs[next(k for k in runs if k.startswith(f"{row}-{recipe}-s"))]
            gap = f"{100 * (vl - ref) / ref:+.2f}" if ref else "-"
            lines.append(f"| {row} | {recipe} | {n} | {vl:.4f} | {gap} | {s.get('bytes_per_param', 0):.2f} | "
                         f"{s['peak_memory_bytes'] / 2**20:,.0f} | {s['tok_per_s'] or 0:,.0f} |")
    (root / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from adahop.train.metrics import read_metrics

        fig, axes = plt.subplots(1, len(RECIPES), figsize=(7 * len(RECIPES), 4.5), squeeze=False)
        for ax, recipe in zip(axes[0], RECIPES):
            for name in runs:
                if f"-{recipe}-s0" in name:
                    pts = [(m["step"], m["loss"]) for m in read_metrics(root / name / "metrics.jsonl") if "loss" in m]
                    ax.plot(*zip(*pts), label=name.replace(f"-{recipe}-s0", ""), lw=1)
            ax.set(title=f"recipe {recipe} (seed 0)", xlabel="step", ylabel="train loss")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(root / "loss_curves.png", dpi=120)
    except ImportError:
        pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="a folder made by `adahop data prepare` (main corpus, GPT-2 tokens)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {','.join(ROWS)}")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--concurrent", type=int, default=4, help="runs sharing the GPU at once")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new run after this many seconds")
    ap.add_argument("--report", action="store_true", help="only write table.md and loss_curves.png from OUT")
    ap.add_argument("extra", nargs="*", help="more `adahop train` flags after --, e.g. -- --madam-form workshop")
    args = ap.parse_args()
    if args.report:
        return report(args)
    if not args.data:
        ap.error("--data is required to launch runs")
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        ap.error(f"--rows: unknown {sorted(unknown)}; choose from {','.join(ROWS)}")
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
