#!/usr/bin/env python
"""Issue 21's experiment: low-precision master weights and optimizers, side by side on one GPU.

    python scripts/run_optim_experiment.py --data DATA_DIR --out OUT [--concurrent 4] [--budget-s 540]
    python scripts/run_optim_experiment.py --out OUT --report      # table.md + loss_curves.png
    python scripts/run_optim_experiment.py --smoke --out /tmp/optim-smoke   # CPU, llama-tiny, 4 steps

Rows (each under the ``bf16`` and ``adahop-lv2`` recipes): FP32-master AdamW (the reference); BF16
AdamW (round to nearest); SR-AdamW; Kahan-AdamW; M+Adam with BF16, FP8 and FP4 masters (round to
nearest), and with FP8 and FP4 masters rounded stochastically (``-sr``). Every
row with BF16 masters, and the reference, runs seeds 0 and 1 (``--seeds``). States are BF16 for
every row but the reference (FP32). The settings are those of the fidelity issue's quality runs
(`experiments/quality/run.py`: llama-60m, 512 × 32 tokens per step, lr 2e-3, 1221 steps = 20M
tokens, compiled), so the FP32 rows repeat those runs. ``--smoke``: llama-tiny, 32 × 4 tokens, 4 steps, a checkpoint every 2, one seed, the
built-in corpus unless ``--data`` is given: every row end to end in minutes on a CPU.

Several small runs share the GPU at once (``--concurrent``; each is far from filling an H200), each
writing ``summary.json`` and ``metrics.jsonl`` into ``OUT/<row>-<recipe>-s<seed>``. Resumable and
bounded: a run that finished (its summary, not interrupted, all its steps) is skipped; every run
checkpoints (``--ckpt-every``) and starts with ``--resume``, so one stopped mid-way continues from its
last checkpoint; ``--budget-s`` bounds this call's wall time: no run starts after it, and at it the
running ones get Ctrl-C (SIGINT: they stop after the step and write a checkpoint), then SIGKILL after
``--grace-s``. Run the same command again to continue. A claim file (host and launcher pid) keeps
concurrent launchers from running one job twice; a claim whose launcher is gone is taken over.
Exit status: 0 when every job is done, 2 when the budget left some to do, 1 when one failed.
Note: tokens/s and peak memory of runs that shared the GPU are lower bounds of a run alone (peak
memory is per process and so still its own); tokens/s of a resumed run is that of its last piece.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean, stdev


def _gate():
    """The memory gate of the quality launcher (experiments/quality/run.py), one copy for both launchers."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "experiments" / "quality" / "run.py"
    spec = importlib.util.spec_from_file_location("quality_run", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GATE = _gate()
SETTINGS = GATE.SETTINGS  # the quality table's setup: issue 21 runs "with the tokens of the fidelity issue's quality runs"
#: --smoke: every row end to end on a CPU in minutes (not a measurement)
SMOKE = dict(model="llama-tiny", seq_len=32, batch_size=4, lr=3e-3, warmup_steps=1, min_lr_ratio=0.1,
             weight_decay=0.1, grad_clip=1.0, eval_batches=2, log_every=1, calib_steps=2)
SMOKE_RUN = dict(steps=4, eval_every=2, ckpt_every=2, seeds="0", data="default")
#: row name → adahop train flags
ROWS = {
    "adamw-fp32": dict(optimizer="adamw", master_weights="fp32", optimizer_states="fp32"),
    "adamw-bf16": dict(optimizer="adamw", master_weights="bf16", optimizer_states="bf16"),
    "sr-adamw-bf16": dict(optimizer="sr-adamw", master_weights="bf16", optimizer_states="bf16"),
    "kahan-adamw-bf16": dict(optimizer="kahan-adamw", master_weights="bf16", optimizer_states="bf16"),
    "madam-bf16": dict(optimizer="m+adam", master_weights="bf16", optimizer_states="bf16"),
    "madam-fp8": dict(optimizer="m+adam", master_weights="fp8", optimizer_states="bf16"),
    "madam-fp4": dict(optimizer="m+adam", master_weights="fp4", optimizer_states="bf16"),
    # FP8/FP4 masters rounded stochastically: under round-to-nearest a step below half an E4M3/E2M1
    # ulp vanishes (docs/optim.md, "FP8 and FP4 masters"), so these are the rows that can train
    "madam-fp8-sr": dict(optimizer="m+adam", master_weights="fp8", optimizer_states="bf16", master_rounding="stochastic"),
    "madam-fp4-sr": dict(optimizer="m+adam", master_weights="fp4", optimizer_states="bf16", master_rounding="stochastic"),
}
TWO_SEEDS = ("adamw-fp32", "adamw-bf16", "sr-adamw-bf16", "kahan-adamw-bf16", "madam-bf16")
RECIPES = ("bf16", "adahop-lv2")


def jobs(rows, recipes, seeds=(0, 1)) -> list[tuple[str, str, int]]:
    """(row, recipe, seed) in launch order: every row's first seed, then the others for TWO_SEEDS rows."""
    out = [(r, rec, seeds[0]) for rec in recipes for r in rows]
    out += [(r, rec, s) for s in seeds[1:] for rec in recipes for r in rows if r in TWO_SEEDS]
    return out


def command(row: str, recipe: str, seed: int, data: str, out: Path, steps: int, eval_every: int, ckpt_every: int,
            extra, settings=SETTINGS, compile: bool = False) -> list[str]:
    """The ``adahop train`` command of one run; ``compile``: with ``--compile`` where the row allows it
    (packed FP8/FP4 masters run eagerly: `adahop.optim.checks` refuses them under torch.compile)."""
    flags = {**settings, **ROWS[row]}
    args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    compiled = ["--compile"] if compile and ROWS[row]["master_weights"] in ("fp32", "bf16") else []
    return [sys.executable, "-m", "adahop", "train", "--recipe", recipe, "--seed", str(seed), "--data", data,
            "--out", str(out), "--steps", str(steps), "--eval-every", str(eval_every), "--ckpt-every", str(ckpt_every),
            "--keep-ckpts", "1", "--resume", *args, *compiled, *extra]


def finished(run: Path, steps: int) -> bool:
    """The run has its summary, was not interrupted and did all ``steps``."""
    try:
        s = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return not s.get("interrupted") and s.get("steps", 0) >= steps


def _claim(root: Path, name: str) -> bool:
    """Take the job's claim file; a claim of a launcher that no longer runs (same host) is taken over."""
    path = root / f".claim-{name}"
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                host, pid = path.read_text().split()
                if host != socket.gethostname():
                    return False
                os.kill(int(pid), 0)  # raises if that launcher is gone
                return False
            except ProcessLookupError:
                path.unlink(missing_ok=True)  # stale: its launcher died
                continue
            except (ValueError, OSError):  # an old empty claim, or unreadable: leave it
                return False
        os.write(fd, me.encode())
        os.close(fd)
        return True
    return False


def launch(args, settings) -> int:
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    seeds = [int(v) for v in args.seeds.split(",")]
    all_jobs = jobs(args.rows.split(","), args.recipes.split(","), seeds)
    todo = [j for j in all_jobs if not finished(root / f"{j[0]}-{j[1]}-s{j[2]}", args.steps)]
    print(f"{len(all_jobs) - len(todo)}/{len(all_jobs)} jobs already done", flush=True)
    running: list[tuple[subprocess.Popen, str, float]] = []
    t_start, stopping, failed = time.time(), False, 0
    env = {**os.environ, "TQDM_DISABLE": "1"}

    def stop_all(why: str) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        print(f"{why}: stopping {len(running)} run(s) after their step (each writes a checkpoint)", flush=True)
        for proc, _, _ in running:
            proc.send_signal(signal.SIGINT)

    try:
        while todo or running:
            over = args.budget_s is not None and time.time() - t_start > args.budget_s
            if over and running:
                stop_all("budget spent")
            # no run starts with less than --min-left-s of the budget: on a machine that does not outlive
            # the call, a run cut short is lost with its checkpoints
            late = args.budget_s is not None and time.time() - t_start > args.budget_s - args.min_left_s
            while todo and not over and not late and not stopping and len(running) < args.concurrent:
                young = sum(time.time() - t < GATE.RAMP_S for _, _, t in running)
                if running and not GATE.room_for_one(args.min_free_gib, young):
                    break  # wait for a run to finish and free its memory
                row, recipe, seed = todo.pop(0)
                name = f"{row}-{recipe}-s{seed}"
                if not _claim(root, name):  # another launcher has it
                    continue
                log = open(root / f"{name}.log", "a")
                cmd = command(row, recipe, seed, args.data, root / name, args.steps, args.eval_every, args.ckpt_every,
                              args.extra, settings, compile=getattr(args, "compile", False))
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                running.append((proc, name, time.time()))
                print(f"started {name}", flush=True)
            if (over or stopping or late) and not running:
                break
            time.sleep(1)
            for proc, name, t0 in list(running):
                if stopping and time.time() - t_start > (args.budget_s or 0) + args.grace_s and proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if proc.poll() is not None:
                    running.remove((proc, name, t0))
                    ok = proc.returncode == 0 and finished(root / name, args.steps)
                    if not ok:  # failed or stopped: the next launch takes it again (and resumes it)
                        (root / f".claim-{name}").unlink(missing_ok=True)
                        failed += proc.returncode not in (0, -signal.SIGKILL) and not stopping
                    print(f"{name}: exit {proc.returncode}, {time.time() - t0:.0f} s"
                          f"{'' if ok else ' (not finished)'}", flush=True)
    except KeyboardInterrupt:
        stop_all("Ctrl-C")
        for proc, name, _ in running:
            try:
                proc.wait(timeout=args.grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
            (root / f".claim-{name}").unlink(missing_ok=True)
        raise
    left = [j for j in all_jobs if not finished(root / f"{j[0]}-{j[1]}-s{j[2]}", args.steps)]
    print(f"{len(all_jobs) - len(left)}/{len(all_jobs)} jobs done in {time.time() - t_start:.0f} s"
          + (f"; {len(left)} left: run the same command again to continue" if left else ""), flush=True)
    return 1 if failed else (2 if left else 0)


def paired_gaps(runs: dict, row: str, recipe: str) -> tuple[dict, dict]:
    """``({seed: final val loss}, {seed: gap % to FP32 AdamW of that seed})`` of ``row`` under
    ``recipe``. Each gap is paired with the reference run of the same seed (same init and data
    order); a seed whose reference is missing gets no gap, so a one-seed row is never compared
    with a mean over other seeds."""
    def losses(r):
        pre = f"{r}-{recipe}-s"
        return {int(n[len(pre):]): s["final_val_loss"] for n, s in runs.items()
                if n.startswith(pre) and n[len(pre):].isdigit() and s.get("final_val_loss")}
    own, ref = losses(row), losses("adamw-fp32")
    return own, {k: 100 * (v - ref[k]) / ref[k] for k, v in own.items() if k in ref}


def _mean_std(vals: list[float]) -> str:
    return f"{mean(vals):+.2f}" + (f" ± {stdev(vals):.2f}" if len(vals) > 1 else "")  # sample std, as results.md


def report(args) -> int:
    """table.md (per-seed final val loss; the gap to FP32-master AdamW of the same recipe and seed,
    mean ± std over seeds; bytes per parameter; peak memory and tokens/s of seed 0) and
    loss_curves.png from OUT's run folders."""
    root = Path(args.out)
    runs = {}
    for d in sorted(root.iterdir()):
        if (d / "summary.json").exists():
            summary = json.loads((d / "summary.json").read_text())
            if not summary.get("interrupted"):  # a run stopped mid-way (budget) is not a result yet
                runs[d.name] = summary
    lines = ["| row | recipe | final val loss per seed | gap to FP32 AdamW of the same seed %, mean ± std | "
             "weights+state B/param | peak memory MiB | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for recipe in RECIPES:
        for row in ROWS:
            own, gaps = paired_gaps(runs, row, recipe)
            if not own:
                continue
            s = runs[f"{row}-{recipe}-s{min(own)}"]
            per_seed = ", ".join(f"s{k} {v:.4f}" for k, v in sorted(own.items()))
            gap = "—" if row == "adamw-fp32" else (_mean_std([gaps[k] for k in sorted(gaps)]) if gaps else "-")
            tps = f"{s['tok_per_s']:,.0f}" if s.get("tok_per_s") else "-"  # None: too few steps to time
            lines.append(f"| {row} | {recipe} | {per_seed} | {gap} | {s.get('bytes_per_param', 0):.2f} | "
                         f"{s['peak_memory_bytes'] / 2**20:,.0f} | {tps} |")
    (root / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from adahop.train.metrics import read_metrics

        shown = [r for r in RECIPES if any(f"-{r}-s0" in n for n in runs)] or list(RECIPES[:1])  # no empty panels
        fig, axes = plt.subplots(1, len(shown), figsize=(7 * len(shown), 4.5), squeeze=False)
        for ax, recipe in zip(axes[0], shown):
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
    ap.add_argument("--data", help="a folder made by `adahop data prepare` (main corpus, GPT-2 tokens); "
                                   "--smoke: default, the built-in corpus")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {','.join(ROWS)}")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--seeds", default=None, help="comma-separated; the first for every row, the others for "
                                                  f"{','.join(TWO_SEEDS)} (default 0,1; --smoke: 0)")
    ap.add_argument("--steps", type=int, default=None, help="default 1221, the quality runs' 20M tokens (--smoke: 4)")
    ap.add_argument("--eval-every", type=int, default=None, help="default 100 (--smoke: 2)")
    ap.add_argument("--ckpt-every", type=int, default=None, help="checkpoint period of each run, for resuming "
                                                                 "(default 100; --smoke: 2)")
    ap.add_argument("--min-free-gib", type=float, default=24,
                    help="start a run only while the GPU keeps this much memory free for it and for each run started "
                         f"in the last {GATE.RAMP_S} s (the quality launcher's gate, experiments/quality/run.py); 0: off")
    ap.add_argument("--concurrent", type=int, default=None, help="runs sharing the GPU at once (default 4; --smoke: 1)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall seconds for this call: no run starts after it, running ones stop with a checkpoint")
    ap.add_argument("--min-left-s", type=float, default=0.0, help="start no run with less than this left of --budget-s")
    ap.add_argument("--grace-s", type=float, default=60.0, help="after --budget-s, seconds before a run is killed")
    ap.add_argument("--no-compile", action="store_true", help="eager runs (default: `adahop train --compile`, but --smoke)")
    ap.add_argument("--smoke", action="store_true",
                    help="llama-tiny, 4 steps, one seed: the pipeline end to end on a CPU")
    ap.add_argument("--report", action="store_true", help="only write table.md and loss_curves.png from OUT")
    ap.add_argument("extra", nargs="*", help="more `adahop train` flags after --, given to every row, e.g. --rows madam-bf16 -- "
                                           "--madam-form workshop (adahop train refuses M+Adam flags with another optimizer)")
    args = ap.parse_args()
    if args.report:
        return report(args)
    base = dict(SMOKE_RUN, concurrent=1) if args.smoke else dict(steps=1221, eval_every=100, ckpt_every=100, seeds="0,1",
                                                                 concurrent=4, data=None)
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.data:
        ap.error("--data is required to launch runs (or --smoke, which uses the built-in corpus)")
    args.compile = not args.smoke and not args.no_compile
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        ap.error(f"--rows: unknown {sorted(unknown)}; choose from {','.join(ROWS)}")
    if args.ckpt_every < 1:
        ap.error("--ckpt-every must be >= 1: runs are resumed from their checkpoints")
    return launch(args, SMOKE if args.smoke else SETTINGS)


if __name__ == "__main__":
    sys.exit(main())
