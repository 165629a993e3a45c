"""Issue #8: every recipe trained side by side on the main corpus; one launcher.

    python experiments/quality/run.py --data DATA_DIR --out OUT [--recipes a,b,...] [--steps N]

Each recipe runs `adahop train` with the same model, data order, seed, tokens and
hyper-parameters (nothing is tuned per recipe); BF16 and AdaHOP-Lv2 also run a second seed for
the noise floor. Then `report.py OUT` writes the table and plots. Runs that already have a
summary.json are skipped, so the launcher can be re-run in pieces (one device command each).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ALL = "bf16,adahop-lv2,mxfp4,mxfp4-had,adahop-lv1,tseng,nvfp4,averis,averis-mxfp4,quartet,halo-2"
# The fixed settings of the experiment (docs/results.md states them): a 60M-class Llama,
# 512-token sequences, 32 sequences per step.
SETTINGS = dict(model="llama-60m", seq_len=512, batch_size=32, lr=2e-3, warmup_steps=20, min_lr_ratio=0.1,
                weight_decay=0.1, grad_clip=1.0, eval_batches=16, log_every=5, calib_steps=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a folder made by `adahop data prepare` (main corpus, GPT-2 tokens)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipes", default=ALL)
    ap.add_argument("--second-seed", default="bf16,adahop-lv2", help="recipes that also run seed 1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--jobs", help="explicit RECIPE:SEED list (overrides --recipes and --second-seed), in order")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new run after this many seconds")
    args = ap.parse_args()
    t_start = time.time()
    jobs = [(r, 0) for r in args.recipes.split(",") if r]
    jobs += [(r, 1) for r in args.second_seed.split(",") if r and r in args.recipes.split(",")]
    if args.jobs:
        jobs = [(j.split(":")[0], int(j.split(":")[1])) for j in args.jobs.split(",") if j]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for recipe, seed in jobs:
        out = Path(args.out) / f"{recipe}-s{seed}"
        if (out / "summary.json").exists():
            continue
        if args.budget_s is not None and time.time() - t_start > args.budget_s:
            print(f"budget spent: {recipe} seed {seed} not started", flush=True)
            continue
        try:  # claim the job, so that launchers on several GPUs can share one list
            os.close(os.open(Path(args.out) / f".claim-{recipe}-s{seed}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
        cmd = [sys.executable, "-m", "adahop", "train", "--recipe", recipe, "--seed", str(seed), "--data", args.data,
               "--out", str(out), "--steps", str(args.steps), "--eval-every", str(args.eval_every),
               "--ckpt-every", "0", "--keep-ckpts", "1", *flags]
        t = time.time()
        rc = subprocess.run(cmd).returncode
        print(f"{recipe} seed {seed}: exit {rc}, {time.time() - t:.0f} s (GPU {os.environ.get('CUDA_VISIBLE_DEVICES', '-')})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
