"""The options of `adahop analyze` (its code is in :mod:`adahop.analysis.cli`). Torch-free, so that
``adahop --help`` and option errors answer at once."""

from __future__ import annotations

import argparse

from ..train.config import TrainConfig, add_config_flags

#: the detector rules of :data:`adahop.recipes.spec.DETECTOR_RULES`, spelled out: importing the
#: recipes would import torch (a test checks the two agree)
DETECTOR_RULES = ("ratio", "significance")

__all__ = ["add_arguments"]

#: `adahop train` options an analysis does not take (it trains BF16, unconverted; --out and --calib-steps are its own)
NOT_TRAIN_FLAGS = ("recipe", "out", "eval_every", "eval_batches", "ckpt_every", "keep_ckpts", "log_every", "compile", "backend",
         "calib_steps", "plan", "resume", "reschedule", "parallel")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `adahop analyze`: the training flags of `adahop train` that apply, plus ours."""
    g = p.add_argument_group("what to analyse")
    g.add_argument("--run", default=None, metavar="RUN",
                   help="a run folder of `adahop train`: use its config and data, start from its newest checkpoint")
    g.add_argument("--synthetic", action="store_true",
                   help="only the synthetic Figure 3 (no model): figure3_synthetic.md/.csv/.png in --out")
    g.add_argument("--out", default="analysis/default", help="output folder (default: analysis/default)")
    r = p.add_argument_group("recording")
    r.add_argument("--record-every", type=int, default=None, metavar="N",
                   help="steps of the patterns-over-steps figure: 1, N, 2N, ... and the last (default: every step "
                        "when --record-steps is not given); the vote window is recorded in full regardless")
    r.add_argument("--record-steps", default=None, metavar="A,B,C",
                   help="comma-separated steps (1-based) of the patterns-over-steps figure")
    r.add_argument("--calib-steps", type=int, default=30,
                   help="the vote covers optimizer steps 1 … N, each one recorded, as training's calibration (default: 30)")
    r.add_argument("--rule", default="ratio", choices=DETECTOR_RULES,
                   help="detector rule: ratio (official AdaHOP) or significance (the earlier one) (default: ratio)")
    r.add_argument("--threshold", type=float, default=2.0, help="detector threshold τ (default: 2.0)")
    r.add_argument("--floor", type=float, default=None,
                   help="optional gate: a Row/Column verdict also needs its own CV >= this (default: off)")
    r.add_argument("--min-peak", type=float, default=None,
                   help="optional gate: ... and its largest row/column RMS >= this × the median (default: off)")
    r.add_argument("--table", default="lv2", choices=("lv1", "lv2"), help="strategy table of plan.json (default: lv2)")
    r.add_argument("--layer", default=None, help="layer of the 3-D figure (default: a middle-depth down_proj)")
    r.add_argument("--gain-layers", type=int, default=14,
                   help="layers whose X, W, ∇Y are kept at the last recorded step for iht_gain (all if the model has fewer)")
    r.add_argument("--gain-tokens", type=int, default=2048, help="rows of X and ∇Y kept per captured layer (default: 2048)")
    r.add_argument("--oe-rank", type=int, default=64,
                   help="OE rank for iht_gain and --synthetic (on real layers capped at a quarter of the outer dim)")
    r.add_argument("--dump", action="store_true",
                   help="also save every hooked X, W, ∇Y at full size at each recorded step (dumps/; large)")
    s = p.add_argument_group("--synthetic")
    s.add_argument("--synthetic-size", type=int, default=512, help="M = K = N of the synthetic GEMMs (default: 512)")
    s.add_argument("--synthetic-scale", type=float, default=10.0, help="outlier multiplier (default: 10)")
    s.add_argument("--synthetic-n-out", type=int, default=16, help="outlier rows/columns per operand (default: 16)")
    s.add_argument("--synthetic-seeds", default="0,1,2", help="comma-separated seeds averaged (default: 0,1,2)")
    add_config_flags(p.add_argument_group("training (as `adahop train`)"), TrainConfig, skip=NOT_TRAIN_FLAGS)
